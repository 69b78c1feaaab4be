"""tools.step_bench: the CLI prints one JSON object whose FLOPs match an independent count of the step."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.utils import flop_counter

from models.pretrain import ALBEF_Base
from models.tokenization import tokenizer_from_vocab
from training.config_resolve import resolve_config

pytestmark = pytest.mark.usefixtures("in_repo")  # tests/conftest.py: repo root, one thread, synthetic data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/tiny/Pretrain.yaml"
BATCH = 4
FIELDS = ("samples_per_s", "step_seconds", "flops_per_sample", "achieved_flops", "matmul_peak_flops",
          "mfu", "peak_memory_bytes")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("step_bench")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The old hyphenated spellings (--batch-size, --peak-sizes) still answer as aliases.
    proc = subprocess.run(
        [sys.executable, "-m", "tools.step_bench", "--config", CONFIG, "--batch_size", str(BATCH),
         "--steps", "2", "--warmup", "1", "--device", "cpu", "--variants", "default,bf16",
         "--threads", "1", "--peak-sizes", "512", "--output_dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # one JSON object, nothing else on stdout
    record = json.loads(lines[0])
    assert json.loads((out / "step_bench.json").read_text()) == record  # the same record, written
    return record


def independent_count() -> int:
    """FlopCounterMode over one forward + backward of the tiny model on a random batch of BATCH."""
    config = resolve_config("pretrain", CONFIG, check_paths=False)
    tokenizer = tokenizer_from_vocab(config.vocab_file)
    model = ALBEF_Base(dataclasses.replace(config, vision_init=None), tokenizer).train()
    res, length = config.image_res, config.max_tokens
    ids = torch.randint(5, len(tokenizer), (BATCH, length))
    text = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    def forward(q, k, v, *args, **kwargs):  # shapes (B, heads, L, head dim)
        return flop_counter.sdpa_flop_count(q, k, v)

    def backward(grad, q, k, v, *args, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad, q, k, v)

    aten = torch.ops.aten  # torch leaves the CPU attention kernel uncounted: its own formulas
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: forward,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=mapping)
    with counter:
        out = model(torch.randn(BATCH, 3, res, res), text, image_key=torch.arange(BATCH))
        (out["loss_itc"] + out["loss_cons"] + out["loss_itm"] + out["loss_mlm"]).backward()
    return counter.get_total_flops()


def test_json_fields(result):
    assert result["device"] == "cpu" and result["batch_size"] == BATCH and result["threads"] == 1
    assert "counted" in result["flops"]
    assert set(result["variants"]) == {"default", "bf16"}
    for name, v in result["variants"].items():
        assert "error" not in v, (name, v)
        for key in FIELDS:
            assert isinstance(v[key], (int, float)) and v[key] > 0, (name, key, v[key])
        assert 0 < v["mfu"] < 1.5, (name, v["mfu"])
        assert v["achieved_flops"] == pytest.approx(v["flops_per_sample"] * v["samples_per_s"])
        assert v["tokenizer"] == "vocab_file data/synthetic/vocab.txt"
        assert all(math.isfinite(x) for x in v["losses"].values()), (name, v["losses"])
    assert result["variants"]["bf16"]["dtype"] == "bfloat16 autocast"


def test_flops_match_an_independent_count(result):
    flops = independent_count()
    for v in result["variants"].values():  # bf16 autocast runs the same ops on the same shapes
        assert v["flops_per_step"] == flops
        assert v["flops_per_sample"] == flops / BATCH
        assert any("attention" in op for op in v["flops_share_by_op"])  # attention is counted


def test_unknown_variant_is_refused():
    proc = subprocess.run([sys.executable, "-m", "tools.step_bench", "--config", CONFIG,
                           "--variants", "default,fp8"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "fp8" in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert proc.stderr.rstrip().endswith("(see python -m tools.step_bench --help)")


def test_bf16_compile_is_bf16_under_compile(monkeypatch):
    """bf16_compile (amp and compile together): the bf16 step compiled, its first step timed as the compile.
    With dynamo's 'eager' backend (inductor takes minutes on the CPU) it runs bf16's ops: the same losses."""
    from tools import step_bench

    real = torch.compile
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(model) or real(
        model, backend="eager", **kw))
    args, _ = step_bench.parse_args(["--config", CONFIG, "--batch_size", "2", "--steps", "1", "--warmup", "1",
                                     "--device", "cpu", "--peak_sizes", "64", "--variants", "bf16_compile"])
    try:
        both = step_bench.run_variant(args, "bf16_compile")
    finally:
        torch._dynamo.reset()
    plain = step_bench.run_variant(args, "bf16")
    assert len(compiled) == 1 and both["dtype"] == plain["dtype"] == "bfloat16 autocast"
    assert both["compile_seconds"] > 0 and "first_step_seconds" not in both
    assert both["losses"] == pytest.approx(plain["losses"], rel=1e-5)
