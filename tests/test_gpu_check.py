"""tools.gpu_check (`make gpu-check`): on a machine without CUDA it skips with the reason and exits 0; the
report's parsing and the issue-27 targets' judgement on hand-made measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from tools.gpu_check import GB, judge, pytest_summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real")
def test_without_cuda_the_check_skips_every_gpu_test_with_its_reason_and_exits_0(tmp_path):
    out = str(tmp_path / "gpu_check")
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--output_dir", out], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "gpu-check skipped: no CUDA device" in done.stdout
    with open(os.path.join(out, "gpu_check.json")) as f:
        report = json.load(f)
    assert report["status"] == "skipped" and report["device"] is None
    tests = report["tests"]
    assert tests["skipped"] >= 8 and not tests.get("passed") and not tests.get("failed")
    assert any("no CUDA device" in reason for reason in tests["skip_reasons"])


def test_pytest_summary_reads_counts_and_skip_reasons():
    text = ("ss.\nSKIPPED [3] tests/test_gpu.py:20: no CUDA device: torch.cuda.is_available() is False\n"
            "SKIPPED [1] tests/test_gpu.py:90: NCCL needs CUDA\n1 passed, 4 skipped in 2.1s\n")
    assert pytest_summary(text) == {"passed": 1, "skipped": 4, "skip_reasons": [
        "NCCL needs CUDA", "no CUDA device: torch.cuda.is_available() is False"]}


def test_the_targets_are_judged_from_the_measurements():
    step = {"batch64": {"mfu": 0.41, "step_seconds": 0.2}, "batch128": {"mfu": 0.47, "step_seconds": 0.4},
            "batch64_checkpointed": {"mfu": 0.6}, "batch128_checkpointed": {"peak_memory_bytes": 20 * GB}}
    grit = {"collector_fill_s": 1.0}  # 375 steps of 0.4 s fill a queue: 1 s is 0.67 %
    targets = judge(step, grit)
    assert targets["bf16_mfu"] == {"value": 0.47, "target": ">= 0.45", "met": True}  # not the checkpointed
    assert targets["batch128_checkpointed_memory"]["met"] and targets["batch128_checkpointed_memory"][
        "value_gb"] == 20.0
    assert targets["grit_share_of_step_time"]["value"] == pytest.approx(1 / 150, abs=1e-5)
    assert targets["grit_share_of_step_time"]["met"]
    slow = judge({"batch128": {"mfu": 0.3, "step_seconds": 0.001}}, grit)
    assert not slow["bf16_mfu"]["met"] and not slow["grit_share_of_step_time"]["met"]
    assert slow["batch128_checkpointed_memory"] is None  # not measured, not judged
