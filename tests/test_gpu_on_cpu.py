"""`make test` runs the GPU-marked tests (tests/test_gpu.py) in their CPU mode, GRIT_GPU_TEST_DEVICE=cpu:
bf16/fp16 autocast with the scaler against fp32, fused AdamW against the per-parameter AdamW, gradient
checkpointing by its effect (every layer runs twice, the gradients bitwise equal), GRIT's grouping and the
bad-sample masks. `make test-slow` adds torch.compile with inductor against eager: a cold compile takes
about a minute here, and inductor's CPU code is not what a GPU run executes (tests/test_compile.py keeps
the compiled training path in `make test`, with dynamo's eager backend; the GPU check runs inductor).

Left to other tests: the NCCL group (CUDA only: it skips with its reason) and the device's save-and-resume
run, which on the CPU is the script run that tests/test_pretrain.py and tests/test_robustness.py resume.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import HANG_GUARD_S, ROOT

RESUME = "tests/test_gpu.py::test_save_and_resume_on_the_device_equals_the_unbroken_run"
INDUCTOR = "tests/test_gpu.py::test_compiled_training_forward_matches_eager"


def _gpu_tests_on_cpu(*args: str) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    env = dict(os.environ, GRIT_GPU_TEST_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|deselected|failed)", summary)}
    return proc, counts


def test_the_gpu_tests_pass_in_their_cpu_mode():
    proc, counts = _gpu_tests_on_cpu("--deselect", RESUME, "--deselect", INDUCTOR, "tests/test_gpu.py")
    assert counts == {"passed": 6, "skipped": 1, "deselected": 2}, counts
    assert "SKIPPED [1] tests/test_gpu.py" in proc.stdout and "CUDA only" in proc.stdout  # NCCL


@pytest.mark.slow  # a cold inductor compile: about a minute here
def test_the_inductor_compile_matches_eager_in_cpu_mode():
    _, counts = _gpu_tests_on_cpu(INDUCTOR)
    assert counts == {"passed": 1}, counts
