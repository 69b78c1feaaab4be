"""tools.efficiency's tables and figure: R@1 per epoch, each arm's epochs, seconds and compute to reach
ALBEF_Base's final recall (compute: executed FLOPs and seconds, as ratios to ALBEF_Base's own run), the
side-by-side epoch timing, and efficiency.png."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from tools.stats import mean_std, paired_interval

__all__ = ["ALBEF_ARMS", "BASELINE", "CLOCKS", "GRIT_ARM", "SCORES", "compute_intervals", "compute_table",
           "curves_table", "epochs_to_reach", "plot", "reach_entry", "reach_gap", "reach_interval",
           "timing_table"]

ALBEF_ARMS = ('ALBEF_Base', 'ALBEF_Base50')  # the baselines; every other arm is measured against ALBEF_Base
BASELINE = 'ALBEF_Base'  # the arm whose final recall the others must reach
GRIT_ARM = 'GRIT-VLP'  # the arm every other's compute to that recall is also paired with

SCORES = {'mean_r1': 'zero-shot mean R@1, ITM re-ranked', 'itc_mean_r1': 'zero-shot mean R@1, ITC only'}
# The seconds a point can be shown at: as logged, or its epochs at the per-epoch time measured side by side.
CLOCKS = {'seconds': 'cumulative epoch_seconds as logged',
          'timed_seconds': 'epochs × ALBEF_Base\'s per-epoch seconds × the arm\'s ratio to it, measured side '
                           'by side (--timing)'}
CLOCK_LABELS = {'seconds': 'wall-clock seconds (sum of epoch_seconds)',
                'timed_seconds': 'seconds at the per-epoch time measured side by side'}


def epochs_to_reach(curve: list[dict], target: float, score: str = 'mean_r1') -> dict | None:
    """The first point of a curve whose score is at least target (None: never)."""
    return next((p for p in curve if p[score] >= target), None)


def curves_table(curves: dict[str, dict[int, list[dict]]], seeds: Sequence[int],
                 clock: str = 'seconds') -> tuple[str, dict]:
    """Markdown: mean ± std per arm and epoch for both scorings; each arm's (not the ALBEF baselines') epochs
    and seconds to reach ALBEF_Base's final R@1 per seed (the same seed's ALBEF_Base run). clock: the points'
    seconds shown ('seconds' as logged, or 'timed_seconds', add_timed_seconds). Returns (text, the reach
    record {scoring: {arm: {seed: ...}}})."""
    arms = list(curves)
    lines = [f'Zero-shot test mean R@1 per epoch (seeds {", ".join(map(str, seeds))}; mean ± sample std; '
             f'seconds: {CLOCKS[clock]})', '']
    for score, label in SCORES.items():
        lines += [f'{label}:', '', '| epoch | ' + ' | '.join(f'{a} | {a} s' for a in arms) + ' |',
                  '|---|' + '---|---|' * len(arms)]
        for i, p in enumerate(curves[arms[0]][seeds[0]]):
            cells = []
            for a in arms:
                m, sd = mean_std([curves[a][s][i][score] for s in seeds])
                t = statistics.fmean(curves[a][s][i][clock] for s in seeds)
                cells.append((f'{m:.2f} ± {sd:.2f}' if len(seeds) > 1 else f'{m:.2f}') + f' | {t:.0f}')
            lines.append(f'| {p["epoch"]} | ' + ' | '.join(cells) + ' |')
        lines.append('')
    reach: dict = {}
    others = [a for a in arms if a not in ALBEF_ARMS]
    if BASELINE in curves and others:
        lines += [f'Each arm against {BASELINE}\'s final R@1 (same seed): the first evaluated epoch at or '
                  'above it', '',
                  f'| seed | scoring | {BASELINE} final | its seconds | '
                  + ' | '.join(f'{a} epoch (in epochs of time) | {a} seconds' for a in others) + ' |',
                  '|---|---|---|---|' + '---|---|' * len(others)]
        for score in SCORES:
            reach[score] = {}
            for s in seeds:
                base = curves[BASELINE][s][-1]
                cells = []
                for a in others:
                    hit = epochs_to_reach(curves[a][s], base[score], score)
                    reach[score].setdefault(a, {})[s] = reach_entry(hit, base, score, clock)
                    time = f' ({hit["time_epochs"]:.2f})' if hit and 'time_epochs' in hit else ''
                    cells.append(f'{hit["epoch"]}{time} | {hit[clock]:.0f}' if hit else 'not reached | –')
                lines.append(f'| {s} | {score} | {base[score]:.2f} (epoch {base["epoch"]}) | '
                             f'{base[clock]:.0f} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n', reach


def reach_entry(hit: dict | None, base: dict, score: str, clock: str) -> dict:
    """One arm's reach of one seed: the target (the same seed's ALBEF_Base final point `base`), the first
    point `hit` at or above it (None: never), and, where the points count them, the compute to get there as
    ratios to ALBEF_Base's whole run: executed FLOPs (flops_ratio) and seconds on `clock` (seconds_ratio)."""
    entry = {'target': base[score], 'target_epoch': base['epoch'], 'target_seconds': base['seconds'],
             'epoch': hit['epoch'] if hit else None, 'seconds': hit['seconds'] if hit else None,
             'time_epochs': hit.get('time_epochs') if hit else None}
    if clock == 'timed_seconds':
        entry |= {'timed_seconds': hit['timed_seconds'] if hit else None,
                  'target_timed_seconds': base['timed_seconds']}
    if 'flops' in base and (hit is None or 'flops' in hit):  # a merged older record's points have none
        entry |= {'target_flops': base['flops'], 'flops': hit['flops'] if hit else None,
                  'flops_ratio': hit['flops'] / base['flops'] if hit else None}
    entry['seconds_ratio'] = hit[clock] / base[clock] if hit else None
    return entry


def _spread(values: list[float]) -> str:
    """'mean ± sample std' of ratios ('–' for none, the value alone for one)."""
    if not values:
        return '–'
    m, sd = mean_std(values)
    return f'{m:.3f} ± {sd:.3f}' if len(values) > 1 else f'{m:.3f}'


def reach_interval(per_seed: dict[int, dict], key: str) -> dict:
    """An arm's compute to ALBEF_Base's final R@1 as a ratio to ALBEF_Base's run (`key`: flops_ratio or
    seconds_ratio), over the seeds: {'mean', 'low', 'high' (the 95 % t interval, tools.stats.paired_interval),
    'below' (seeds that got there with less compute than ALBEF_Base's run), 'reached', 'n'}. A seed that never
    reached counts as not below, and leaves the bounds nan: its ratio is unknown (above its run's), so a mean
    over the seeds that reached would flatter the arm. nan throughout where the points carry no `key`."""
    values = [v.get(key) for v in per_seed.values() if v['epoch'] is not None]
    if any(x is None for x in values):  # a merged older record's points have no FLOPs
        return {'mean': float('nan'), 'low': float('nan'), 'high': float('nan'), 'below': 0,
                'reached': len(values), 'n': len(per_seed)}
    gap = paired_interval([x - 1 for x in values])  # against 1, ALBEF_Base's own compute
    whole = len(values) == len(per_seed)
    return {'mean': gap['mean'] + 1, 'low': gap['low'] + 1 if whole else float('nan'),
            'high': gap['high'] + 1 if whole else float('nan'), 'below': gap['behind'],
            'reached': len(values), 'n': len(per_seed)}


def reach_gap(per_seed: dict[int, dict], grit: dict[int, dict], key: str) -> dict:
    """An arm's compute share (`key`) minus GRIT-VLP's, paired by seed: tools.stats.paired_interval's
    {'mean', 'low', 'high', 'ahead' (seeds where the arm needed more), 'behind' (less), 'level', 'n'} over the
    seeds both reached, and 'missing', the seeds either did not: any leaves the bounds nan, as in
    reach_interval."""
    both = [s for s in per_seed if per_seed[s].get(key) is not None and grit.get(s, {}).get(key) is not None]
    gap = paired_interval([per_seed[s][key] - grit[s][key] for s in both])
    missing = len(per_seed) - len(both)
    return {**gap, **({'low': float('nan'), 'high': float('nan')} if missing else {}), 'missing': missing}


def compute_intervals(reach: dict) -> dict:
    """{score: {arm: {flops_ratio: reach_interval, seconds_ratio: reach_interval, and for an arm beside
    GRIT-VLP flops_gap_to_grit: reach_gap of the FLOPs}}} of curves_table's reach."""
    return {score: {arm: {**{key: reach_interval(per_seed, key) for key in ('flops_ratio', 'seconds_ratio')},
                          **({'flops_gap_to_grit': reach_gap(per_seed, per_arm[GRIT_ARM], 'flops_ratio')}
                             if arm != GRIT_ARM and GRIT_ARM in per_arm else {})}
                    for arm, per_seed in per_arm.items()} for score, per_arm in reach.items()}


def _interval_cell(iv: dict) -> str:
    """'mean [low, high], B of N below 1' ('–' where no seed reached; where one did not, the mean said to be
    over the seeds that reached, which flatters the arm, and no bounds)."""
    if not iv['reached'] or iv['mean'] != iv['mean']:
        return '–'
    if iv['reached'] < iv['n']:
        return f'{iv["mean"]:.3f} over the {iv["reached"]} reached, {iv["below"]} of {iv["n"]} below 1'
    return f'{iv["mean"]:.3f} [{iv["low"]:.3f}, {iv["high"]:.3f}], {iv["below"]} of {iv["n"]} below 1'


def compute_table(reach: dict, clock: str) -> str:
    """Markdown: each arm's compute to ALBEF_Base's final R@1 as a share of ALBEF_Base's own run, executed
    FLOPs and seconds (clock), mean ± sample std over the seeds that reached it, and the seeds that did; then
    each ratio's 95 % t interval over the seeds and the seeds below 1 (reach_interval)."""
    lines = [f'Compute to reach {BASELINE}\'s final R@1, as a share of {BASELINE}\'s run to its last '
             'evaluated epoch (same seed; mean ± sample std over the seeds that reached it; seconds: '
             f'{CLOCKS[clock]}); then each share\'s mean [95 % t interval] over the seeds, the interval only '
             'where every seed reached, and the seeds on which it is below 1 (less compute than '
             f'{BASELINE}\'s run; a seed that never reached is not)', '',
             '| scoring | arm | executed FLOPs | seconds | seeds reached | FLOPs: interval, seeds below 1 '
             '| seconds: interval, seeds below 1 |', '|---|---|---|---|---|---|---|']
    intervals = compute_intervals(reach)
    for score, per_arm in reach.items():
        for arm, per_seed in per_arm.items():
            hits = [v for v in per_seed.values() if v['epoch'] is not None]
            cells = []
            for key in ('flops_ratio', 'seconds_ratio'):
                values = [v[key] for v in hits if v.get(key) is not None]
                # A merged older record's points have no FLOPs: say over how many seeds a figure is.
                cells.append(_spread(values) + (f' ({len(values)} seeds)' if len(values) < len(hits) else ''))
            ivs = [_interval_cell(intervals[score][arm][key]) for key in ('flops_ratio', 'seconds_ratio')]
            lines.append(f'| {score} | {arm} | {cells[0]} | {cells[1]} | {len(hits)} of {len(per_seed)} | '
                         f'{ivs[0]} | {ivs[1]} |')
    gaps = [(score, arm, ivs['flops_gap_to_grit']) for score, per_arm in intervals.items()
            for arm, ivs in per_arm.items() if 'flops_gap_to_grit' in ivs]
    if gaps:
        lines += ['', f'Each arm\'s FLOPs share minus {GRIT_ARM}\'s, paired by seed: mean [95 % t interval] '
                  '(none where a seed of either never reached), and the seeds on which the arm needed less, '
                  'as much, more', '', f'| scoring | arm | gap to {GRIT_ARM} | less / level / more |',
                  '|---|---|---|---|']
        for score, arm, g in gaps:
            bounds = f' [{g["low"]:+.3f}, {g["high"]:+.3f}]' if g['low'] == g['low'] else ''
            unreached = f' ({g["missing"]} seeds not reached or without FLOPs)' if g['missing'] else ''
            lines.append(f'| {score} | {arm} | {g["mean"]:+.3f}{bounds}{unreached} | '
                         f'{g["behind"]} / {g["level"]} / {g["ahead"]} |')
    return '\n'.join(lines) + '\n'


def timing_table(timing: dict[str, dict], epochs: int) -> str:
    """Markdown: each arm's per-epoch seconds beside ALBEF_Base's, timed side by side."""
    lines = [f'Per-epoch seconds, each arm side by side with {BASELINE} ({epochs}-epoch runs, seed 1, one '
             'thread each, median over the epochs after the first)', '',
             f'| arm | its epoch | {BASELINE}\'s beside it | ratio | its strategy\'s work per epoch |',
             '|---|---|---|---|---|']
    lines += [f'| {arm} | {t["epoch_seconds"]:.2f} s | {t["albef_base_epoch_seconds"]:.2f} s | '
              f'{t["ratio"]:.3f} | {t["sampler_seconds"]:.3f} s |' for arm, t in timing.items()]
    return '\n'.join(lines) + '\n'


def plot(curves: dict[str, dict[int, list[dict]]], seeds: Sequence[int], path: str,
         clock: str = 'seconds', corpus: str = 'the synthetic world') -> str:
    """efficiency.png: R@1 (re-ranked, ITC only) against epochs and against seconds (clock: the points' key,
    as in curves_table), mean ± std band; corpus: what the runs pre-trained on, for the title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    for row, (score, label) in enumerate(SCORES.items()):
        for col, x in enumerate(('epoch', clock)):
            ax = axes[row][col]
            for arm, per_seed in curves.items():
                n = len(per_seed[seeds[0]])
                xs = [statistics.fmean(per_seed[s][i][x] for s in seeds) for i in range(n)]
                stats = [mean_std([per_seed[s][i][score] for s in seeds]) for i in range(n)]
                means = [m for m, _ in stats]
                ax.plot(xs, means, marker='o', markersize=3, label=arm)
                if len(seeds) > 1:
                    ax.fill_between(xs, [m - sd for m, sd in stats], [m + sd for m, sd in stats], alpha=0.2)
            ax.set_xlabel('epoch' if x == 'epoch' else CLOCK_LABELS[clock])
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f'Tiny pre-training on {corpus}, seeds {", ".join(map(str, seeds))} '
                 '(tools.efficiency)')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
