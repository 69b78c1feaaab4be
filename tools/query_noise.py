"""How much of an ordering's seed noise is the test split's finite size (issue 49, deliverable 4): the paired
gap of two arms' test mean R@1 (ITM re-ranked) split into the part more test scenes would shrink and the
part only more seeds, or less noisy training, would.

    python -m tools.query_noise --compare_dir output/compare_s1-10 --seeds 8 9 10 --arms GRIT-VLP B3 GCBS \
        [--lrs 5e-4 5e-4 5e-4] [--epochs 12] [--record docs/results/compare_strategies_seeds1-10.json] \
        [--factors 2 4 10] [--output_dir DIR]

It reads the per-query rankings (zeroshot/rankings_test.json) of the runs tools.compare left in
--compare_dir, the first of --arms the baseline, each arm at its selection at --epochs (tools.arms; by
default tools.compare's 24-epoch one) or at --lrs. The
unit is a test image: its text-retrieval hit at 1 and the image-retrieval hits of its captions, weighted as
mean R@1 = (text R@1 + image R@1) / 2 weighs them, so that the mean of the images' values is mean R@1 and a
scene's correlated queries (its captions, both directions) count once. For each arm the per-image
difference from the baseline, y[i, s], is an images x seeds table. Its seed-by-image interaction, the
residual of the two-way table, sigma^2 = sum r^2 / ((n - 1)(S - 1)), is the part of each seed's gap that
depends on which scenes the test split happens to hold: it adds Q = sigma^2 / n to the gap's seed
variance. Averaged over k test splits of this size (new scenes of the same world), the seed variance would
be V - Q (1 - 1/k), where V is the gap's seed variance: these seeds', or with --record that of a
tools.compare record's seeds (more of them), read at both arms' selections. (One split k times larger
also has a k times larger gallery, which changes R@1 itself; the average of k splits does not.)

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
from tools.runs import COMPARISON_EPOCHS, check_schedule, reading_schedule, run_dir
from tools.stats import mean_std
from training.cli import Parser, run_main

__all__ = ["build_parser", "decompose", "image_hits", "interaction_variance", "main", "markdown",
           "paired_table"]


def image_hits(rankings: dict) -> tuple[list[int], np.ndarray]:
    """(image indices, (images,) values) of a rankings_test.json: each image's text-retrieval hit at 1 (ITM
    re-ranked) over 2 plus its captions' image-retrieval hits over 2 x (captions / images), so that the
    values' mean is mean R@1 (as a fraction)."""
    images = sorted(q['image_index'] for q in rankings['image_to_text'])
    row = {i: k for k, i in enumerate(images)}
    text = np.zeros(len(images))
    for q in rankings['image_to_text']:
        text[row[q['image_index']]] = float(q['text_ids'][0] in q['gt_text_ids'])
    captions = rankings['text_to_image']
    image = np.zeros(len(images))
    for q in captions:
        if q['gt_image_id'] not in row:
            raise ValueError(f"caption {q['text_index']} matches image {q['gt_image_id']}, which ranks no "
                             "texts")
        image[row[q['gt_image_id']]] += float(q['image_ids'][0] == q['gt_image_id'])
    return images, text / 2 + image * len(images) / (2 * len(captions))


def interaction_variance(d: np.ndarray) -> float:
    """The seed-by-unit interaction variance of a (units n, seeds S) table: the two-way residual's sum of
    squares over (n - 1)(S - 1); nan below two seeds or two units."""
    n, s = d.shape
    if s < 2 or n < 2:
        return math.nan
    r = d - d.mean(0, keepdims=True) - d.mean(1, keepdims=True) + d.mean()
    return float((r ** 2).sum() / ((n - 1) * (s - 1)))


def paired_table(base: Sequence[tuple[list[int], np.ndarray]],
                 arm: Sequence[tuple[list[int], np.ndarray]]) -> np.ndarray:
    """(images, seeds): the per-image difference arm - base of image_hits() values, seed by seed; ValueError
    when the runs cannot be paired (another count of seeds, other test images)."""
    if len(base) != len(arm):
        raise ValueError(f'{len(base)} baseline runs against {len(arm)} of the arm: they pair seed by seed')
    images = {tuple(i) for i, _ in [*base, *arm]}
    if len(images) != 1:
        raise ValueError('the runs rank different test images (a bad sample skipped in one run?): they '
                         'cannot be paired query by query')
    return np.stack([a - b for (_, a), (_, b) in zip(arm, base)], axis=1)


def decompose(d: np.ndarray, seed_gaps: Sequence[float] | None = None,
              factors: Sequence[float] = (2, 4, 10)) -> dict:
    """Of a paired_table d (images, seeds): the gap of mean R@1 (points) per seed, its seed variance V (of
    `seed_gaps` when given, else of these seeds), the test split's part Q of V, and the gap's seed std
    averaged over `factors` test splits (sqrt(V - Q (1 - 1/k))) and over unboundedly many."""
    sigma2 = interaction_variance(d)
    q = 100 ** 2 * sigma2 / d.shape[0]
    gaps = (100 * d.mean(0)).tolist()
    variance_from = list(seed_gaps) if seed_gaps is not None else gaps
    v = mean_std(variance_from)[1] ** 2 if len(variance_from) > 1 else math.nan
    return {'images': d.shape[0], 'interaction_variance': sigma2, 'gaps': gaps, 'seed_variance': v,
            'seed_std': math.sqrt(v), 'variance_from_seeds': len(variance_from),
            'test_split_variance': q, 'test_split_share': q / v if v else math.nan,
            'std_with_more_test': {f'{k:g}': math.sqrt(max(v - q * (1 - 1 / k), 0.0)) for k in factors},
            'std_floor': math.sqrt(max(v - q, 0.0))}


def _load(compare_dir: str, arm: str, seeds: Sequence[int], lr: float, setting: str | None,
          trained: int | None = None) -> list[tuple[list[int], np.ndarray]]:
    """image_hits() of each seed's run of `arm`, each run of `trained` epochs (None: any); InputFileError
    naming a missing rankings file or a run of another schedule."""
    out = []
    for seed in seeds:
        folder = run_dir(compare_dir, arm, seed, lr, setting)
        check_schedule(folder, trained)
        path = os.path.join(folder, 'zeroshot', 'rankings_test.json')
        if not os.path.isfile(path):
            where = f'lr {lr:g}' + (f', {setting}' if setting else '')
            raise InputFileError(f'no rankings of {arm!r} ({where}) seed {seed}: {path} is missing (run '
                                 'python -m tools.compare first)')
        try:
            out.append(image_hits(read_json(path, 'rankings')))
        except (KeyError, ValueError) as e:
            raise InputFileError(f'{path}: not a rankings file tools.compare writes ({e})') from e
    return out


def _record_gaps(path: str, baseline: str, arm: str, seeds: Sequence[int],
                 gaps: Sequence[float]) -> list[float]:
    """The record's per-seed gaps of mean_r1 (arm - baseline, both at their selections), checked against the
    rankings' on the seeds both hold: the record must be of the same runs."""
    record = compare_record(path)
    if arm not in record['selected_lr'] or baseline not in record['selected_lr']:
        raise InputFileError(f'--record {path}: it holds no selection of {arm!r} or {baseline!r}')
    rows = [selected_rows(record, a) for a in (baseline, arm)]
    paired = sorted(set(rows[0]) & set(rows[1]))
    for seed, gap in zip(seeds, gaps):
        if seed in paired and abs(rows[1][seed]['mean_r1'] - rows[0][seed]['mean_r1'] - gap) > 0.01:
            raise InputFileError(f'--record {path}: {arm} - {baseline} on seed {seed} is '
                                 f'{rows[1][seed]["mean_r1"] - rows[0][seed]["mean_r1"]:+.2f} there and '
                                 f'{gap:+.2f} in the rankings: not the same runs')
    return [rows[1][s]['mean_r1'] - rows[0][s]['mean_r1'] for s in paired]


def markdown(result: dict) -> str:
    """The record as a markdown table, a row per arm."""
    factors = list(next(iter(result['arms'].values()))['std_with_more_test'])
    seeds = ', '.join(map(str, result['seeds']))
    source = f" from the record's seeds ({result['record']})" if result['record'] else ''
    head = ("| arm | seeds (std) | images | interaction variance | seed std of the gap | test split's share "
            "| " + ' | '.join(f'k = {k}' for k in factors) + ' | unbounded |')
    lines = [f"Each arm minus {result['baseline']}, test mean R@1 re-ranked (points), from the per-query "
             f"rankings of seeds {seeds}, a test image and its captions as one unit; the gap's seed "
             f"std{source}, the test split's share of its variance, and its std averaged over k test splits "
             "of this size.", '', head, '|---' * (7 + len(factors)) + '|']
    for arm, r in result['arms'].items():
        more = ' | '.join(f'{s:.2f}' for s in r['std_with_more_test'].values())
        lines.append(f"| {arm} | {r['variance_from_seeds']} | {r['images']} | "
                     f"{r['interaction_variance']:.4f} | {r['seed_std']:.2f} | {r['test_split_share']:.0%} | "
                     f"{more} | {r['std_floor']:.2f} |")
    return '\n'.join(lines) + '\n'


def build_parser() -> Parser:
    """The tool's command line."""
    p = tool_parser("tools.query_noise", __doc__.split("\n\n")[0])
    p.add_argument("--compare_dir", required=True, help="the --output_dir of a tools.compare run")
    p.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds whose rankings are read")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["GRIT-VLP", "B3"],
                   help="the baseline, then the arms paired with it (default: GRIT-VLP B3)")
    p.add_argument("--lrs", type=float, nargs="+", default=None,
                   help="the arms' learning rates, in --arms' order (default: their selections, tools.arms)")
    p.add_argument("--epochs", type=int, default=None,
                   help="the schedule the runs trained, whose selections are read without --lrs, and which "
                        f"every run read must have trained (default: tools.compare's, {COMPARISON_EPOCHS}; "
                        "with --lrs and no --epochs, the runs as they are)")
    p.add_argument("--record", default=None,
                   help="a tools.compare record of the same runs whose seeds give the gap's seed variance "
                        "(default: --seeds')")
    p.add_argument("--factors", type=float, nargs="+", default=[2, 4, 10],
                   help="numbers of test splits of this size to give the gap's seed std averaged over")
    add_output_dir(p, "query_noise.json and query_noise.md")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Read the rankings; print the decomposition as one JSON line (and write it with --output_dir)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.seeds) < 2 or len(args.arms) < 2:
        parser.error("--seeds and --arms: the interaction needs two seeds or more, and a baseline and an arm")
    try:
        epochs, trained = reading_schedule(args.epochs, args.lrs)  # the synthetic world's: no config read
    except ValueError as e:
        parser.error(str(e))
    try:
        settings = arm_setting(args.arms, args.lrs, epochs=epochs)
    except ValueError as e:
        parser.error(f"--lrs or --arms: {e}")
    baseline, *others = args.arms
    base = _load(args.compare_dir, baseline, args.seeds, *settings[baseline], trained)
    arms = {}
    for arm in others:
        runs = _load(args.compare_dir, arm, args.seeds, *settings[arm], trained)
        try:
            d = paired_table(base, runs)
            gaps = (100 * d.mean(0)).tolist()
            seed_gaps = _record_gaps(args.record, baseline, arm, args.seeds, gaps) if args.record else None
            arms[arm] = decompose(d, seed_gaps, args.factors)
        except ValueError as e:
            raise InputFileError(f'{args.compare_dir}, {arm}: {e}') from e
    result = {'compare_dir': args.compare_dir, 'seeds': args.seeds, 'baseline': baseline,
              'lrs': {a: settings[a][0] for a in args.arms}, 'record': args.record, 'arms': arms}
    return emit_record(result, args.output_dir, 'query_noise', markdown(result))


if __name__ == "__main__":
    run_main(main)
