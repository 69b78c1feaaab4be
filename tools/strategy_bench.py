"""Every batch-construction strategy's cost and effect: `python -m tools.strategy_bench` prints one JSON line.

For each strategy (grit.strategies: grit, b3, gcbs, rwr), one queue fill of L clustered synthetic
features (tools.grit_bench.clustered_features) is grouped by GritCollector as in training (example
shuffle, sub-queues of M, the strategy's order of each), timed (best of --repeats, after a warm-up fill),
and the batches of N cut from its G are scored by the mean hardest in-batch negative similarity beside
random batches of the same features. The per-step cost follows by arithmetic: a fill holds the samples
of L / (N x W) steps, and with sharded grouping every rank orders 1/W of its sub-queues, so the cost per
step and rank is N x fill_seconds / L (for W <= L / M), reported as a share of --step_seconds (default
0.9 s: the paper's GRIT-VLP epoch of ~5 M pairs in 2 h 30 m on 4 A100s, 4 x 128 per step;
docs/speed-and-scale.md). `--scale D ...` instead runs tools.grit_bench --scale with each strategy:
the sampler's end of epoch (the partial queue's grouping, composing the next epoch) and its memory at D
examples per rank. With --output_dir the JSON object is also written to DIR/strategy_bench.json.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Sequence

import torch

from grit.collector import GritCollector
from grit.strategies import NAMES, ONLINE, build
from tools.cli import add_output_dir, emit_record, tool_parser
from tools.grit_bench import batch_hardness, clustered_features
from training.cli import Parser, run_main
from training.config import Batching

GROUPING = [n for n in NAMES if n not in ("random", *ONLINE)]  # online selection groups nothing


def build_parser() -> Parser:
    """The benchmark's command line."""
    p = tool_parser("tools.strategy_bench", __doc__.splitlines()[0])
    p.add_argument("--strategies", nargs="*", default=GROUPING, choices=GROUPING,
                   help=f"strategies to measure (default: {' '.join(GROUPING)}), each with its config "
                        "block's defaults (training.config.Batching)")
    p.add_argument("--queue_size", type=int, default=48000,
                   help="L: examples per queue fill (default: 48000)")
    p.add_argument("--search_space", type=int, default=1920, help="M: sub-queue size (default: 1920)")
    p.add_argument("--dim", type=int, default=256, help="feature dimension (default: 256)")
    p.add_argument("--batch_size", type=int, default=128, help="N: per-rank batch (default: 128)")
    p.add_argument("--clusters", type=int, default=400, help="Gaussian mixture components (default: 400)")
    p.add_argument("--repeats", type=int, default=2, help="timed fills per strategy, best kept (default: 2)")
    p.add_argument("--step_seconds", type=float, default=0.9,
                   help="the training step the cost is a share of (default: 0.9, the paper's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the features and the fills (default: 0)")
    p.add_argument("--scale", type=int, nargs="*", default=None, metavar="D",
                   help="instead: each strategy's end of epoch and memory at D examples (tools.grit_bench "
                        "--scale --strategy)")
    add_output_dir(p, "strategy_bench.json (the printed record)")
    return p


def one_fill(name: str, args, image: torch.Tensor, text: torch.Tensor) -> dict:
    """Group fills of L with strategy `name`: the best time of a fill and the hardness of its batches."""
    L, M, N = args.queue_size, args.search_space, args.batch_size
    grouping = build(name, N, **Batching().options(name))
    collector = GritCollector(L, M, args.dim, L, grouping=grouping)
    index = torch.arange(L)
    times = []
    for repeat in range(args.repeats + 1):  # the first fill warms up (allocations, imports, METIS)
        collector.reset(seed=args.seed + repeat)
        t0 = time.perf_counter()
        collector.add(image, text, index)
        seconds = time.perf_counter() - t0
        G = collector.finalize()
        if repeat:
            times.append(seconds)
    assert torch.equal(G.sort().values, index), f"{name}: a fill must group every example once"
    batches = G[:L // N * N].long().view(-1, N)
    fill = min(times)
    per_step = N * fill / L
    return {"strategy": name, "describe": grouping.describe(), "fill_seconds": round(fill, 3),
            "per_step_and_rank_ms": round(1000 * per_step, 2),
            "share_of_step": round(per_step / args.step_seconds, 5),
            "hardness": round(batch_hardness(image, text, batches), 4)}


def at_scale(args) -> dict:
    """tools.grit_bench --scale for every strategy, each in its own process."""
    from tools.launch import child_env, python_command

    rows = {}
    for name in args.strategies:
        command = ["tools.grit_bench", "--scale", *map(str, args.scale), "--strategy", name,
                   "--queue_size", str(args.queue_size), "--search_space", str(args.search_space),
                   "--dim", str(args.dim), "--batch_size", str(args.batch_size), "--seed", str(args.seed)]
        proc = subprocess.run(python_command(command), capture_output=True, text=True,
                              env=child_env(threads=1))
        rows[name] = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                      else {"error": proc.stderr.strip()[-800:]})
    return {"mode": "each strategy's end of epoch at scale (tools.grit_bench --scale)", "strategies": rows}


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark and print one JSON object (also returned)."""
    p = build_parser()
    args = p.parse_args(argv)
    L, M, N = args.queue_size, args.search_space, args.batch_size
    if not 1 <= N <= M <= L:
        p.error("need 1 <= batch_size <= search_space <= queue_size")
    if args.scale:
        return emit_record(at_scale(args), args.output_dir, "strategy_bench")
    torch.set_num_threads(1)  # as the collector's grouping runs beside training; timings comparable
    image, text = clustered_features(L, args.dim, args.clusters, args.seed, torch.device("cpu"))
    g = torch.Generator().manual_seed(args.seed)
    random_batches = torch.randperm(L, generator=g)[:L // N * N].view(-1, N)
    rows = [one_fill(name, args, image, text) for name in args.strategies]
    return emit_record({"queue_size": L, "search_space": M, "dim": args.dim, "batch_size": N,
                        "clusters": args.clusters, "threads": 1, "device": "cpu",
                        "step_seconds": args.step_seconds,
                        "random_hardness": round(batch_hardness(image, text, random_batches), 4),
                        "strategies": rows}, args.output_dir, "strategy_bench")


if __name__ == "__main__":
    run_main(main)
