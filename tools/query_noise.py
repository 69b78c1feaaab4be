"""How much of an ordering's seed noise is the test split's finite size (issue 49, deliverable 4): the paired
gap of two arms' test mean R@1 (ITM re-ranked) split into the part a larger test split would shrink and the
part only more seeds, or less noisy training, would.

    python -m tools.query_noise --compare_dir output/compare_s1-10 --seeds 8 9 10 --arms GRIT-VLP B3 \
        [--lrs 5e-4 5e-4] [--record docs/results/compare_strategies_seeds1-10.json] [--factors 2 4 10] \
        [--output_dir DIR]

It reads the per-query rankings (zeroshot/rankings_test.json) of the runs tools.compare left in
--compare_dir, the first arm the baseline, each at its selection (tools.arms) or at --lrs. Per direction
(text retrieval: a query per image; image retrieval: a query per caption) the per-query difference of the two
arms' hits at 1, d[q, s] (-1, 0 or 1), is a queries x seeds table. Its seed-by-query interaction, the residual
of the two-way table, sigma^2 = sum r^2 / ((n - 1)(S - 1)), is the part of each seed's gap that depends on
which queries the test split happens to hold: it adds Q = sigma^2 / n to the seed variance of the gap (both
directions averaged, in points^2). A test split k times larger (new scenes of the same world) leaves the
seed variance V - Q (1 - 1/k), where V is the gap's seed variance: these seeds', or with --record that of a
tools.compare record's seeds (more of them), read at both arms' selections.

Prints one JSON line; with --output_dir also writes query_noise.json and query_noise.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from grit_io import InputFileError, read_json
from tools.arms import ARMS, arm_setting
from tools.cli import add_output_dir, emit_record, tool_parser
from tools.records import compare_record, selected_rows
from tools.runs import run_dir
from tools.stats import mean_std
from training.cli import Parser, run_main

__all__ = ["build_parser", "hits", "interaction_variance", "main", "markdown", "decompose"]


def hits(rankings: dict) -> dict[str, np.ndarray]:
    """{'text': (images,), 'image': (captions,)}: 1.0 where the query's first-ranked candidate (ITM re-ranked)
    is a match, in query-index order, from a rankings_test.json."""
    i2t = sorted(rankings['image_to_text'], key=lambda q: q['image_index'])
    t2i = sorted(rankings['text_to_image'], key=lambda q: q['text_index'])
    return {'text': np.array([float(q['text_ids'][0] in q['gt_text_ids']) for q in i2t]),
            'image': np.array([float(q['image_ids'][0] == q['gt_image_id']) for q in t2i])}


def interaction_variance(d: np.ndarray) -> float:
    """The seed-by-query interaction variance of a (queries n, seeds S) table: the two-way residual's sum of
    squares over (n - 1)(S - 1); nan below two seeds."""
    n, s = d.shape
    if s < 2 or n < 2:
        return math.nan
    r = d - d.mean(0, keepdims=True) - d.mean(1, keepdims=True) + d.mean()
    return float((r ** 2).sum() / ((n - 1) * (s - 1)))


def decompose(base: list[dict[str, np.ndarray]], arm: list[dict[str, np.ndarray]],
              seed_gaps: Sequence[float] | None = None, factors: Sequence[float] = (2, 4, 10)) -> dict:
    """The gap arm - base of mean R@1 (points) per seed (lists of hits(), one per seed, paired), its seed
    variance V (of `seed_gaps` when given, else of these seeds), the test split's share Q of V and the seed
    std of the gap with a test split `factors` times larger (sqrt(V - Q (1 - 1/k))) and an unbounded one."""
    per_direction = {}
    for direction in ('text', 'image'):
        sizes = {len(h[direction]) for h in base + arm}
        if len(sizes) != 1:
            raise ValueError(f'the runs rank different numbers of {direction}-retrieval queries: '
                             f'{sorted(sizes)}')
        d = np.stack([a[direction] - b[direction] for a, b in zip(arm, base)], axis=1)  # (queries, seeds)
        per_direction[direction] = {'queries': d.shape[0], 'interaction_variance': interaction_variance(d),
                                    'gap': (100 * d.mean(0)).tolist()}
    gaps = [(t + i) / 2 for t, i in zip(per_direction['text']['gap'], per_direction['image']['gap'])]
    # The mean of the two directions' R@1, in points: each direction's interaction over its queries, halved.
    q = sum(100 ** 2 * p['interaction_variance'] / p['queries'] for p in per_direction.values()) / 4
    variance_from = list(seed_gaps) if seed_gaps is not None else gaps
    v = mean_std(variance_from)[1] ** 2 if len(variance_from) > 1 else math.nan
    return {'per_direction': per_direction, 'gaps': gaps, 'seed_variance': v,
            'seed_std': math.sqrt(v), 'variance_from_seeds': len(variance_from),
            'test_split_variance': q, 'test_split_share': q / v if v else math.nan,
            'std_with_larger_test': {f'{k:g}': math.sqrt(max(v - q * (1 - 1 / k), 0.0)) for k in factors},
            'std_floor': math.sqrt(max(v - q, 0.0))}


def _load(compare_dir: str, arm: str, seeds: Sequence[int], lr: float, setting: str | None) -> list[dict]:
    """hits() of each seed's run of `arm`; InputFileError naming a missing rankings file."""
    out = []
    for seed in seeds:
        path = os.path.join(run_dir(compare_dir, arm, seed, lr, setting), 'zeroshot', 'rankings_test.json')
        if not os.path.isfile(path):
            where = f'lr {lr:g}' + (f', {setting}' if setting else '')
            raise InputFileError(f'no rankings of {arm!r} ({where}) seed {seed}: {path} is missing (run '
                                 'python -m tools.compare first)')
        out.append(hits(read_json(path, 'rankings')))
    return out


def markdown(result: dict) -> str:
    """The record as a short markdown table."""
    r = result['noise']
    larger = ' | '.join(f'{s:.2f}' for s in r['std_with_larger_test'].values())
    heads = ' | '.join(f'test x {k}' for k in r['std_with_larger_test'])
    return '\n'.join([
        f"{result['arms'][1]} minus {result['arms'][0]}, test mean R@1 re-ranked, per-query rankings of "
        f"seeds "
        f"{', '.join(map(str, result['seeds']))}; seed variance from {r['variance_from_seeds']} seeds. "
        "Points; the interaction variance is per query (hits 0/1).", '',
        f"| queries (text / image retrieval) | interaction variance (text / image) | seed std of the gap | "
        f"test split's share of its variance | {heads} | unbounded test |",
        '|---' * (5 + len(r['std_with_larger_test'])) + '|',
        f"| {r['per_direction']['text']['queries']} / {r['per_direction']['image']['queries']} | "
        f"{r['per_direction']['text']['interaction_variance']:.3f} / "
        f"{r['per_direction']['image']['interaction_variance']:.3f} | {r['seed_std']:.2f} | "
        f"{r['test_split_share']:.0%} | {larger} | {r['std_floor']:.2f} |"]) + '\n'


def build_parser() -> Parser:
    """The tool's command line."""
    p = tool_parser("tools.query_noise", __doc__.split("\n\n")[0])
    p.add_argument("--compare_dir", required=True, help="the --output_dir of a tools.compare run")
    p.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds whose rankings are read")
    p.add_argument("--arms", nargs=2, choices=list(ARMS), default=["GRIT-VLP", "B3"],
                   help="the baseline and the arm (default: GRIT-VLP B3)")
    p.add_argument("--lrs", type=float, nargs=2, default=None,
                   help="the two arms' learning rates (default: their selections, tools.arms)")
    p.add_argument("--record", default=None,
                   help="a tools.compare record whose seeds give the gap's seed variance (default: --seeds')")
    p.add_argument("--factors", type=float, nargs="+", default=[2, 4, 10],
                   help="test splits this many times larger to predict the gap's seed std at")
    add_output_dir(p, "query_noise.json and query_noise.md")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Read the rankings; print the decomposition as one JSON line (and write it with --output_dir)."""
    args = build_parser().parse_args(argv)
    if len(args.seeds) < 2:
        raise InputFileError("--seeds: the interaction needs at least two seeds")
    settings = arm_setting(args.arms, args.lrs)
    base, arm = (_load(args.compare_dir, a, args.seeds, *settings[a]) for a in args.arms)
    seed_gaps = None
    if args.record:
        record = compare_record(args.record)
        rows = [selected_rows(record, a) for a in args.arms]
        seeds = sorted(set(rows[0]) & set(rows[1]))
        seed_gaps = [rows[1][s]['mean_r1'] - rows[0][s]['mean_r1'] for s in seeds]
    try:
        noise = decompose(base, arm, seed_gaps, args.factors)
    except ValueError as e:
        raise InputFileError(f'{args.compare_dir}: {e}') from e
    result = {'compare_dir': args.compare_dir, 'seeds': args.seeds, 'arms': args.arms,
              'lrs': {a: settings[a][0] for a in args.arms}, 'record': args.record, 'noise': noise}
    return emit_record(result, args.output_dir, 'query_noise', markdown(result))


if __name__ == "__main__":
    run_main(main)
