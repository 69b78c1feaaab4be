"""How sure each ordering of a comparison is, and how many seeds it would need (issue 49, deliverable 4):
for every arm against a baseline, per figure, the seed std of the paired gap, the gap in units of that std
and the seeds at which the gap's 95 % t interval would exclude zero if mean and std held.

    python -m tools.seed_noise --compare docs/results/compare_strategies_seeds1-7.json \
        [--baseline GRIT-VLP] [--figures mean_r1 itc_mean_r1 r_mean] [--fit_seeds 1 2 3 4 5 6 7] \
        [--output_dir docs/results]

--compare is a tools.compare record. Each arm is read at its selection (tools.records.selected_rows) and
paired with the baseline seed by seed, on the seeds both have.

Per arm and figure the record gives:
- the per-seed gaps (arm minus baseline);
- their mean, their sample std, and the paired t interval with the sign count (tools.stats.paired_interval);
- the standardised gap, mean / std;
- seeds_needed: the smallest n (at most --max_seeds) with t(0.975, n - 1) · std / sqrt(n) < |mean|;
- the 95 % prediction interval of one more seed's gap (tools.stats.prediction_interval). The t interval bounds
  the mean gap; a seed never run should land in the prediction interval, 95 % of the time.

--fit_seeds takes the intervals from those seeds only and checks the record's other seeds against them, out
of sample: how many land inside the mean's interval and how many inside the prediction interval.

A std in points depends on the figure's scale. R_mean averages R@1, R@5 and R@10, and its gaps and stds
are both smaller than R@1's. So the standardised gap, not the std, says which figure ranks arms with fewer
seeds.

Prints one JSON line; with --output_dir also writes seed_noise.json and seed_noise.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from grit_io import InputFileError
from tools.cli import add_output_dir, emit_record, tool_parser
from tools.records import compare_record, selected_rows
from tools.stats import mean_std, paired_interval, prediction_interval
from training.cli import Parser, run_main

__all__ = ["FIGURES", "build_parser", "main", "markdown", "noise", "seeds_needed"]

FIGURES = {'mean_r1': 'test mean R@1, ITM re-ranked', 'itc_mean_r1': 'test mean R@1, ITC only',
           'r_mean': 'test R_mean (R@1, 5, 10 of both directions), re-ranked'}


def seeds_needed(mean: float, std: float, max_seeds: int = 100, level: float = 0.95) -> int | None:
    """The smallest n >= 2 whose t interval half-width t(level, n - 1) · std / sqrt(n) is below |mean|; None
    when none up to max_seeds is (or the gap is 0 or not a number)."""
    from scipy.stats import t

    if not (math.isfinite(mean) and math.isfinite(std)) or mean == 0:
        return None
    if std == 0:
        return 2
    for n in range(2, max_seeds + 1):
        if float(t.ppf(0.5 + level / 2, n - 1)) * std / math.sqrt(n) < abs(mean):
            return n
    return None


def noise(record: dict, baseline: str, figures: Sequence[str], max_seeds: int = 100,
          fit_seeds: Sequence[int] | None = None) -> dict:
    """{arm: {figure: {'seeds', 'per_seed', 'mean', 'std', 'standardised', 'interval', 'prediction',
    'seeds_needed'[, 'held_out']}}} of every arm of `record` but the baseline, paired with it seed by seed at
    both selections; with `fit_seeds`, the intervals are those seeds' and 'held_out' checks the others."""
    arms = list(record['selected_lr'])
    if baseline not in arms:
        raise ValueError(f"--baseline {baseline!r} is not an arm of the record (its arms: {arms})")
    base = selected_rows(record, baseline)
    out: dict = {}
    for arm in (a for a in arms if a != baseline):
        rows = selected_rows(record, arm)
        paired = sorted(set(rows) & set(base))
        unpaired = sorted(set(fit_seeds or ()) - set(paired))
        if unpaired:
            raise ValueError(f"--fit_seeds {unpaired}: {arm} and {baseline} are not both at their selection "
                             f"on those seeds (paired seeds: {paired})")
        seeds = [s for s in paired if fit_seeds is None or s in fit_seeds]
        out[arm] = {}
        for figure in figures:
            missing = [s for s in paired if figure not in rows[s] or figure not in base[s]]
            if missing:
                raise ValueError(f"{arm} or {baseline}: rows of seeds {missing} lack {figure!r}")
            gaps = [rows[s][figure] - base[s][figure] for s in seeds]
            mean, std = mean_std(gaps) if len(gaps) > 1 else (math.nan, math.nan)
            g = out[arm][figure] = {
                'seeds': seeds, 'per_seed': gaps, 'mean': mean, 'std': std,
                'standardised': mean / std if std and math.isfinite(std) else math.nan,
                'interval': paired_interval(gaps), 'prediction': prediction_interval(gaps),
                'seeds_needed': seeds_needed(mean, std, max_seeds)}
            if fit_seeds is not None:
                held = {s: rows[s][figure] - base[s][figure] for s in paired if s not in seeds}
                g['held_out'] = {
                    'per_seed': held,
                    'inside_interval': sum(g['interval']['low'] <= v <= g['interval']['high']
                                           for v in held.values()),
                    'inside_prediction': sum(g['prediction']['low'] <= v <= g['prediction']['high']
                                             for v in held.values())}
    return out


def _row(arm: str, figure: str, g: dict) -> str:
    """One table row."""
    i, p = g['interval'], g['prediction']
    needed = g['seeds_needed'] if g['seeds_needed'] is not None else '> max'
    row = (f"| {arm} | {figure} | {len(g['seeds'])} | {g['mean']:+.2f} | {g['std']:.2f} | "
           f"{g['standardised']:+.2f} | [{i['low']:+.2f}, {i['high']:+.2f}] | "
           f"{i['ahead']} / {i['behind']} | {needed} | [{p['low']:+.2f}, {p['high']:+.2f}] |")
    if 'held_out' in g:
        h = g['held_out']
        held = ', '.join(f'{v:+.1f}' for v in h['per_seed'].values())
        row += f" {held} | {h['inside_interval']} / {h['inside_prediction']} of {len(h['per_seed'])} |"
    return row


def markdown(result: dict) -> str:
    """The record as a markdown table: a row per arm and figure."""
    fit = result.get('fit_seeds')
    lines = [f"Each arm against {result['baseline']}, paired by seed at both selections: the gap's mean, its "
             "seed std, the standardised gap (mean / std), the 95 % t interval of the mean, seeds ahead / "
             "behind, the seeds at which that interval would exclude zero if mean and std held, and the 95 % "
             "prediction interval of one more seed's gap."
             + (f" Intervals from seeds {', '.join(map(str, fit))} only; the record's other seeds are held "
                "out, each gap listed and counted inside the mean's interval / inside the prediction "
                "interval." if fit else ''), '',
             '| arm | figure | seeds | mean gap | seed std of the gap | mean / std | 95 % t interval | '
             'ahead / behind | seeds needed | 95 % prediction interval, one new seed |'
             + (' held-out gaps | inside t / prediction |' if fit else ''),
             '|---' * (12 if fit else 10) + '|']
    for arm, figures in result['arms'].items():
        lines += [_row(arm, figure, g) for figure, g in figures.items()]
    return '\n'.join(lines) + '\n'


def build_parser() -> Parser:
    """The tool's command line."""
    p = tool_parser("tools.seed_noise", __doc__.splitlines()[0])
    p.add_argument("--compare", required=True, help="a tools.compare record (compare.json)")
    p.add_argument("--baseline", default="GRIT-VLP",
                   help="the arm every other is paired with (default: GRIT-VLP)")
    p.add_argument("--figures", nargs="+", default=list(FIGURES), choices=list(FIGURES),
                   help="the figures of each row to read (default: all three)")
    p.add_argument("--max_seeds", type=int, default=100, help="the most seeds seeds_needed looks at")
    p.add_argument("--fit_seeds", type=int, nargs="+", default=None,
                   help="take the intervals from these seeds only and check the record's other seeds against "
                        "them (default: every seed, nothing held out)")
    add_output_dir(p, "seed_noise.json and seed_noise.md")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Read the record; print every ordering's noise as one JSON line (and write it with --output_dir)."""
    args = build_parser().parse_args(argv)
    record = compare_record(args.compare)
    try:
        arms = noise(record, args.baseline, args.figures, args.max_seeds, args.fit_seeds)
    except ValueError as e:
        raise InputFileError(f'{args.compare}: {e}') from e
    result = {'compare': args.compare, 'baseline': args.baseline, 'figures': args.figures,
              'fit_seeds': args.fit_seeds, 'arms': arms}
    return emit_record(result, args.output_dir, 'seed_noise', markdown(result))


if __name__ == "__main__":
    run_main(main)
