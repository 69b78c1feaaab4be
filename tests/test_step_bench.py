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
from conftest import HANG_GUARD_S
from torch.utils import flop_counter

from models.losses import WithObjectives
from models.pretrain import ALBEF_Base
from models.tokenization import tokenizer_from_vocab
from training.config_resolve import resolve_config

pytestmark = pytest.mark.usefixtures("in_repo")  # tests/conftest.py: repo root, one thread, synthetic data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/tiny/Pretrain.yaml"
BATCH = 4
FIELDS = ("samples_per_s", "step_seconds", "flops_per_sample", "achieved_flops", "matmul_peak_flops",
          "mfu", "mfu_executed", "model_flops_per_sample", "peak_memory_bytes")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("step_bench")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The old hyphenated spellings (--batch-size, --peak-sizes) still answer as aliases.
    proc = subprocess.run(
        [sys.executable, "-m", "tools.step_bench", "--config", CONFIG, "--batch_size", str(BATCH),
         "--steps", "2", "--warmup", "1", "--device", "cpu", "--variants", "default,bf16,albef",
         "--threads", "1", "--peak-sizes", "512", "--output_dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # one JSON object, nothing else on stdout
    record = json.loads(lines[0])
    assert json.loads((out / "step_bench.json").read_text()) == record  # the same record, written
    return record


def independent_count(**keys) -> int:
    """FlopCounterMode over one forward + backward of the tiny model (config keys `keys` on top) on a random
    batch of BATCH."""
    config = dataclasses.replace(resolve_config("pretrain", CONFIG, check_paths=False), **keys)
    tokenizer = tokenizer_from_vocab(config.vocab_file)
    model = ALBEF_Base(dataclasses.replace(config, vision_init=None), tokenizer).train()
    net = WithObjectives(model)  # the forward and its objectives (models.losses), as Pretrain.py's step
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
        out = net(torch.randn(BATCH, 3, res, res), text, image_key=torch.arange(BATCH))
        (out["loss_itc"] + out["loss_cons"] + out["loss_itm"] + out["loss_mlm"]).backward()
    return counter.get_total_flops()


def test_json_fields(result):
    assert result["device"] == "cpu" and result["batch_size"] == BATCH and result["threads"] == 1
    assert "counted" in result["flops"]
    assert set(result["variants"]) == {"default", "bf16", "albef"}
    for name, v in result["variants"].items():
        assert "error" not in v, (name, v)
        for key in FIELDS:
            assert isinstance(v[key], (int, float)) and v[key] > 0, (name, key, v[key])
        assert v["achieved_flops"] == pytest.approx(v["flops_per_sample"] * v["samples_per_s"])
        # Two MFUs: ALBEF's step (the same work for every variant) and the variant's own, per second.
        assert v["model_flops_per_sample"] == result["model_flops_per_sample"]
        model_rate = v["model_flops_per_sample"] * v["samples_per_s"]
        assert v["mfu"] == pytest.approx(model_rate / v["matmul_peak_flops"])
        assert v["mfu_executed"] == pytest.approx(v["achieved_flops"] / v["matmul_peak_flops"])
        assert v["tokenizer"] == "vocab_file data/synthetic/vocab.txt"
        assert all(math.isfinite(x) for x in v["losses"].values()), (name, v["losses"])
    assert result["variants"]["bf16"]["dtype"] == "bfloat16 autocast"


def test_flops_match_an_independent_count(result):
    flops = independent_count()
    for name in ("default", "bf16"):  # bf16 autocast runs the same ops on the same shapes
        v = result["variants"][name]
        assert v["flops_per_step"] == flops
        assert v["flops_per_sample"] == flops / BATCH
        assert any("attention" in op for op in v["flops_share_by_op"])  # attention is counted
        assert v["config_changes"] == {}
    # Model FLOPs: ALBEF's step, each fusion layer's image keys and values once per row, MLM logits at every
    # position, ITM's last fusion layer at every position; the shipped step executes less of it.
    albef = independent_count(share_image_kv=False, fused_qkv=False, mlm_masked_only=False,
                              itm_cls_only=False, share_caption_attention=False)
    assert result["model_flops_per_sample"] == albef / BATCH
    assert result["variants"]["albef"]["flops_per_sample"] == albef / BATCH
    assert flops < albef
    assert result["variants"]["albef"]["config_changes"] == {
        "share_image_kv": False, "fused_qkv": False, "mlm_masked_only": False, "itm_cls_only": False,
        "share_caption_attention": False, "amp_layer_norm": "float32"}


def test_variants_are_switches_joined_by_plus():
    from tools.step_bench import variant_switches

    assert variant_switches("default") == frozenset()
    assert variant_switches("bf16_compile") == variant_switches("compile+bf16") == {"bf16", "compile"}
    assert variant_switches("bf16+cudagraphs") == {"bf16", "compile", "cudagraphs"}  # CUDA graphs compile
    with pytest.raises(ValueError, match="fp8"):
        variant_switches("bf16+fp8")


def test_a_baseline_child_runs_in_the_other_checkout():
    """--baseline's child is the other checkout's tools.step_bench, run in its root (here: this checkout)."""
    from tools import step_bench, step_bench_runs

    args, child_argv = step_bench.parse_args(
        ["--config", CONFIG, "--batch_size", "2", "--steps", "1", "--warmup", "0", "--device", "cpu",
         "--threads", "1", "--peak_sizes", "64", "--variants", "albef", "--baseline", ROOT, "--rounds", "1"])
    assert args.baseline == ROOT and args.rounds == 1
    record = step_bench_runs.spawn_variant(child_argv, "albef", ROOT)
    assert "error" not in record, record
    assert record["step_seconds"] > 0 and record["config_changes"]["share_image_kv"] is False
    with pytest.raises(SystemExit):  # not a checkout of this repository
        step_bench.parse_args(["--config", CONFIG, "--baseline", os.path.dirname(ROOT)])


def test_baseline_alternates_and_keeps_the_best_run(monkeypatch):
    from tools import step_bench_runs

    calls = []
    times = iter([3.0, 2.0, 1.0, 4.0, 2.5, 0.5])  # baseline, this, baseline, this, ...

    def fake(argv, variant, checkout=None):
        calls.append(checkout)
        return {"step_seconds": next(times)}

    monkeypatch.setattr(step_bench_runs, "spawn_variant", fake)
    mine, baseline = step_bench_runs.alternate([], ["default"], ROOT, rounds=3)
    assert calls == [ROOT, None] * 3  # B A B A B A
    assert mine["default"]["step_seconds_runs"] == [2.0, 4.0, 0.5] and mine["default"]["step_seconds"] == 0.5
    assert baseline["variants"]["default"]["step_seconds"] == 1.0
    assert baseline["speedup"]["default"] == 2.0
    assert baseline["speedup_per_round"]["default"] == [1.5, 0.25, 5.0]
    assert baseline["speedup_median"]["default"] == 1.5
    assert baseline["checkout"] == ROOT and len(baseline["commit"]) == 40  # the commit it measured


def test_the_baseline_runs_its_own_variant_opposite_each_one_here(monkeypatch):
    """--baseline_variant default: the baseline's step opposite drop50 and drop75, switches it lacks."""
    from tools import step_bench, step_bench_runs

    calls = []

    def fake(argv, variant, checkout=None):
        calls.append((variant, checkout))
        return {"step_seconds": 1.0}

    monkeypatch.setattr(step_bench_runs, "spawn_variant", fake)
    _, baseline = step_bench_runs.alternate([], ["drop50", "drop75"], ROOT, rounds=1, opposite="default")
    assert calls == [("default", ROOT), ("drop50", None), ("default", ROOT), ("drop75", None)]
    assert baseline["opposite"] == {"drop50": "default", "drop75": "default"}
    assert step_bench.variant_switches("drop50") == {"drop50"}
    config = step_bench.load_bench_config(step_bench.parse_args(["--config", CONFIG])[0], "drop75")
    assert config.image_token_drop == 0.75
    with pytest.raises(ValueError, match="one image-token dropout rate"):
        step_bench.load_bench_config(step_bench.parse_args(["--config", CONFIG])[0], "drop50+drop75")
    with pytest.raises(SystemExit):  # the opposite variant belongs to a baseline
        step_bench.parse_args(["--config", CONFIG, "--baseline_variant", "default"])
    # A masked step does less than the paper's per sample: no MFU in the paper's FLOPs, its executed one kept.
    measured = {"albef": {"flops_per_sample": 10.0, "samples_per_s": 2.0, "matmul_peak_flops": 100.0},
                "drop50": {"flops_per_sample": 6.0, "samples_per_s": 3.0, "matmul_peak_flops": 100.0,
                           "image_token_drop": 0.5}}
    assert step_bench.add_model_flops(measured, [], 8) == 10.0
    assert measured["albef"]["mfu"] == 0.2 and measured["drop50"]["mfu"] is None


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


class OneAttentionLayer(torch.nn.Module):
    """x (B, L, H) -> q, k, v projections, heads x scaled-dot-product attention, output projection; the
    output's sum is `loss_itc` (the other three losses zero) and `loss`, their sum, as a model with its
    objectives (models.losses.WithObjectives) returns them to tools.step_measure.forward_loss."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (torch.nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x, text, image_key):
        B, L, H = x.shape
        q, k, v = (f(x).view(B, L, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, H)
        zero = x.new_zeros(())
        loss_itc = self.out(a).sum()
        return {"loss_itc": loss_itc, "loss_cons": zero, "loss_itm": zero, "loss_mlm": zero,
                "loss": loss_itc + zero + zero + zero}


def test_count_flops_equals_the_closed_form_of_a_tiny_attention_layer():
    """step_bench.count_flops against the closed form, counted by hand: forward 2BLH^2 per projection
    (4) and 2BL^2H per attention product (2); backward: weight gradients of the three input projections
    (the input needs none), weight and input gradients of the output projection, and attention's five
    products (scores recomputed, as torch counts flash attention)."""
    from tools.step_measure import count_flops

    B, L, H = 3, 7, 16
    torch.manual_seed(0)
    model = OneAttentionLayer(H, heads=4)
    total, by_op = count_flops(model, (torch.randn(B, L, H), None, None), torch.device("cpu"), None)
    forward = 4 * 2 * B * L * H * H + 2 * 2 * B * L * L * H
    backward = 3 * 2 * B * L * H * H + 2 * 2 * B * L * H * H + 5 * 2 * B * L * L * H
    assert total == forward + backward == 18 * B * L * H * H + 14 * B * L * L * H
    assert sum(by_op.values()) == total and any("attention" in op for op in by_op)
