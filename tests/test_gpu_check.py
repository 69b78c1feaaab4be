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

from tools.gpu_check import GB, build_parser, judge, judge_quick, pytest_summary, quick_parts


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


# ----------------------------------------------------------------------------- --quick (issue 33)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --quick runs for real")
def test_quick_without_cuda_skips_cleanly(tmp_path):
    out = str(tmp_path / "quick")
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--quick", "--output_dir", out], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "gpu-check --quick skipped: no CUDA device" in done.stdout
    with open(os.path.join(out, "gpu_check.json")) as f:
        report = json.load(f)
    assert report["mode"] == "quick" and report["status"] == "skipped" and report["device"] is None
    assert "step_bench" not in report and "tests" not in report  # nothing ran


def test_quick_measures_each_change_on_and_off_eager_compiled_and_with_cuda_graphs(tmp_path):
    args = build_parser().parse_args(["--quick", "--output_dir", str(tmp_path)])
    parts = {name: (argv, timeout) for name, argv, timeout in quick_parts(args)}
    assert list(parts) == ["step_eager", "step_compiled", "attention", "tests"]
    assert sum(timeout for _, timeout in parts.values()) <= 700  # each part bounded; 9 min in all on an H200

    def variants(name: str) -> list[str]:
        argv = parts[name][0]
        return argv[argv.index("--variants") + 1].split(",")

    eager = variants("step_eager")
    assert eager[:2] == ["bf16", "bf16+albef"] and "bf16+grad_checkpointing" in eager
    changes = {"no_share_image_kv", "no_fused_qkv", "no_mlm_masked_only", "fp32_layer_norm"}
    assert {v.removeprefix("bf16+") for v in eager} >= changes
    assert variants("step_compiled") == ["bf16+compile", "bf16+compile+cudagraphs"]
    argv = parts["step_eager"][0]
    assert argv[argv.index("--batch_size") + 1] == "128" and "configs/Pretrain.yaml" in argv


def test_quick_targets_and_effects_are_judged_from_the_measurements():
    step = {"bf16": {"mfu": 0.42, "samples_per_s": 1400.0, "flops_per_sample": 207e9},
            "bf16+albef": {"mfu": 0.30, "samples_per_s": 1000.0},
            "bf16+no_share_image_kv": {"mfu": 0.37, "samples_per_s": 1250.0},
            "bf16+grad_checkpointing": {"mfu": 0.30, "peak_memory_bytes": 7 * GB},
            "bf16+compile": {"mfu": 0.48}, "bf16+compile+cudagraphs": {"mfu": 0.55}}
    targets = judge_quick(step)
    assert targets["eager_mfu"] == {"value": 0.42, "target": ">= 0.4", "met": True}
    assert targets["compiled_mfu"]["value"] == 0.55 and targets["compiled_mfu"]["met"]  # the better one
    assert targets["checkpointed_memory"] == {"value_gb": 7.0, "target": "< 24 GB", "met": True}
    executed = targets["executed_gflop_per_sample"]
    assert executed["value"] == 207.0 and executed["met"]
    assert targets["effects"] == {"albef": 1.4, "no_share_image_kv": 1.12}  # the others were not measured
    # Checkpointing and image-token dropout are not changes of the shipped step: dropout gets its speed-up.
    timed = judge_quick({**step, "bf16+grad_checkpointing": {"samples_per_s": 50.0},
                         "bf16+drop50": {"samples_per_s": 140.0}})
    assert set(timed["effects"]) == {"albef", "no_share_image_kv"}
    assert timed["token_drop_speedups"] == {"drop50": round(140.0 / step["bf16"]["samples_per_s"], 3)}
    slow = judge_quick({"bf16": {"mfu": 0.2, "samples_per_s": 1.0}, "bf16+compile": {"mfu": 0.45}})
    assert not slow["eager_mfu"]["met"] and not slow["compiled_mfu"]["met"]
    assert slow["checkpointed_memory"] is None and slow["effects"] == {}
