"""Online batch selection's cost at the paper's sizes: its share of the step for super-batches of k = 2, 4
and 10 (issue 52). `python -m tools.selection_bench` prints one JSON line.

    python -m tools.selection_bench [--config configs/Pretrain.yaml] [--ks 2 4 10] [--batch_size 128] \
        [--strategies jest rho] [--step_seconds 0.9] [--output_dir DIR] [--set key=value ...]

A step of online selection (grit.online, docs/batch-construction.md) is the training step on N plus, per
rank, the scoring forwards of its K = k x N candidates (ALBEF_Base.contrastive_logits: the uni-modal
encoders, no gradient, every image token), once by the learner and once by the reference model (the
learnability score; hard_learner needs the learner's only), plus the selection itself on the two (K, K)
logit matrices. Counted as tools.step_bench counts the step: torch's FLOP counter over the config's model
with random weights on a synthetic batch at max_tokens (--count_batch samples: FLOPs per sample and per
candidate hardly depend on the batch, and the paper's 128 would take the CPU an hour), on the CPU. The
selection's own work, a few (K, K) reductions per chunk, is timed, not counted: best of --repeats on
random logits of K = k x --batch_size at --device, beside --step_seconds (default 0.9 s: the paper's
GRIT-VLP step on an A100, docs/speed-and-scale.md, the figure tools.strategy_bench uses too).

Per k and scorer count s (2 with a reference, 1 without): scoring_share = s k f_score / (f_train +
s k f_score), the share of a selection step's executed FLOPs that scores; step_ratio = 1 + s k f_score /
f_train, a selection step's FLOPs over a plain step's; epoch_ratio = step_ratio / k, a pass over the data
(k times fewer steps) over a plain epoch's; scoring_seconds_estimate = (step_ratio - 1) x --step_seconds,
the scoring forwards' time if they ran at the training step's FLOP rate (an assumption: an inference
forward usually runs faster per FLOP). JEST scores with a cheaper model than it trains (FlexiViT at a
lower resolution); the learner here scores at full cost, as grit.online does.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence

import torch

from grit.strategies import ONLINE, build
from tools.cli import add_config_args, add_output_dir, emit_record, resolve_device, tool_config, tool_parser
from tools.step_bench import build_bench_tokenizer
from tools.step_measure import device_name, selection_flops_per_candidate, step_flops_per_sample, sync
from training.cli import Parser, run_main

__all__ = ["build_parser", "main", "selection_seconds", "shares"]

PAPER_CONFIG = "configs/Pretrain.yaml"


def build_parser() -> Parser:
    """The benchmark's command line."""
    p = tool_parser("tools.selection_bench", __doc__.splitlines()[0])
    add_config_args(p, f"the pre-training config whose model is counted (default: {PAPER_CONFIG}, the "
                       "paper's sizes)", required=False)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 10],
                   help="super-batch factors k (default: 2 4 10)")
    p.add_argument("--batch_size", type=int, default=None,
                   help="N per rank for the selection's timing and the step arithmetic (default: the "
                        "config's batch_size, the paper's 128)")
    p.add_argument("--count_batch", type=int, default=2,
                   help="samples of the synthetic batch the FLOPs are counted on, >= 2 (default: 2)")
    p.add_argument("--strategies", nargs="+", default=sorted(ONLINE), choices=sorted(ONLINE),
                   help=f"selections to time (default: {' '.join(sorted(ONLINE))}), each with its config "
                        "block's defaults besides super_batch")
    p.add_argument("--repeats", type=int, default=3, help="timed selections per k and strategy, best kept "
                                                          "(default: 3)")
    p.add_argument("--step_seconds", type=float, default=0.9,
                   help="the training step the times are set beside (default: 0.9, the paper's)")
    p.add_argument("--device", default=None, help="where the selection is timed: cpu | cuda (default: cuda "
                                                  "if available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the logits and the draws (default: 0)")
    add_output_dir(p, "selection_bench.json (the printed record)")
    return p


def selection_seconds(name: str, batch_size: int, k: int, device: torch.device, repeats: int,
                      seed: int) -> float:
    """Best time of strategy `name` choosing N = batch_size of K = k N candidates from random (K, K) logits
    of the learner and the reference (softmax ITC scale), after one warm-up selection."""
    selection = build(name, batch_size, super_batch=k)
    K = selection.candidates
    g = torch.Generator().manual_seed(seed)
    learner, reference = (torch.randn(K, K, generator=g).mul_(5).to(device) for _ in range(2))
    best = float("inf")
    for r in range(repeats + 1):
        draw = torch.Generator().manual_seed(seed + r)
        sync(device)
        t0 = time.perf_counter()
        picked = selection.select(learner, reference, "softmax", None, draw)
        sync(device)
        if r:  # the first is the warm-up
            best = min(best, time.perf_counter() - t0)
        if picked.unique().numel() != batch_size:
            raise RuntimeError(f"{name}: the selection did not return {batch_size} distinct candidates")
    return best


def shares(train_flops: float, score_flops: float, k: int, scorers: int, step_seconds: float) -> dict:
    """A selection step's cost against a plain step's from the FLOPs per sample (train) and per candidate and
    scoring model (score): the module docstring's scoring_share, step_ratio, epoch_ratio, seconds."""
    scoring = scorers * k * score_flops
    return {'scorers': scorers, 'scoring_share': scoring / (train_flops + scoring),
            'step_ratio': 1 + scoring / train_flops, 'epoch_ratio': (1 + scoring / train_flops) / k,
            'scoring_seconds_estimate': scoring / train_flops * step_seconds}


def main(argv: Sequence[str] | None = None) -> dict:
    """Count, time and print one JSON object (also returned)."""
    args = build_parser().parse_args(argv)
    args.config = args.config or PAPER_CONFIG
    if min(args.ks) < 1 or args.repeats < 1 or args.count_batch < 2:
        build_parser().error("--ks and --repeats must be >= 1 and --count_batch >= 2 (ITM mines in-batch "
                             "negatives)")
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    config = tool_config("pretrain", args)
    N = args.batch_size or config.batch_size
    # Counted on --count_batch samples, with tools.step_bench's vocabulary (nothing to download).
    config = dataclasses.replace(config, batch_size=args.count_batch)
    with tempfile.TemporaryDirectory(prefix="selection_bench_") as workdir:
        tokenizer, vocab_note = build_bench_tokenizer(config, workdir)
    train, score = step_flops_per_sample(config, tokenizer), selection_flops_per_candidate(config, tokenizer)
    rows = []
    for k in args.ks:
        row = {'k': k, 'candidates': k * N, 'filtering_ratio': 1 - 1 / k,
               'learnability': shares(train, score, k, 2, args.step_seconds),
               'hard_learner': shares(train, score, k, 1, args.step_seconds)}
        for name in args.strategies:
            seconds = selection_seconds(name, N, k, device, args.repeats, args.seed)
            row[f'{name}_select_seconds'] = seconds
            row[f'{name}_select_share_of_step'] = seconds / args.step_seconds
        rows.append(row)
    record = {
        'tool': 'selection_bench', 'config': args.config, 'set': args.set, 'image_res': config.image_res,
        'max_tokens': config.max_tokens, 'tokenizer': vocab_note, 'batch_size': N,
        'count_batch': args.count_batch, 'train_gflop_per_sample': train / 1e9,
        'score_gflop_per_candidate': score / 1e9, 'step_seconds': args.step_seconds,
        'device': str(device), 'device_name': device_name(device), 'threads': torch.get_num_threads(),
        'torch': torch.__version__, 'rows': rows,
    }
    return emit_record(record, args.output_dir, "selection_bench")


if __name__ == "__main__":
    run_main(main)
