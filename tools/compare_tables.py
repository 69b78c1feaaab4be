"""tools.compare's record as a reader sees it: the markdown table of the arms at their selections (spread
over seeds, paired gaps with their intervals, each strategy's cost), the sweep table, the text of a paired
interval, and the further test splits a record holds."""

from __future__ import annotations

import math
import statistics

from grit_io import InputFileError, read_json
from tools.arms import arm_strategies, setting_label

__all__ = ["TABLE", "extra_tests", "interval_text", "markdown_table", "read_costs", "sweep_table"]


def extra_tests(record: dict) -> list[str]:
    """The further test splits whose figures a retrieval record or summary row holds ('artist_mean_r1' ->
    'artist'), in name order; the val and test splits are not among them."""
    return sorted({k[:-len('_itc_mean_r1')] for k in record if k.endswith('_itc_mean_r1')}
                  - {'val', 'test', ''})


def interval_text(stats: dict) -> str:
    """A paired gap as printed: '+2.17 [+0.53, +3.81], ahead on 5 of 6 seeds' (t interval, 95 %)."""
    if math.isnan(stats['mean']):
        return '–'
    bounds = '' if math.isnan(stats['low']) else f' [{stats["low"]:+.2f}, {stats["high"]:+.2f}]'
    return f'{stats["mean"]:+.2f}{bounds}, ahead on {stats["ahead"]} of {stats["n"]} seeds'


# The table's columns: (summary key, header, digits); a figure as mean ± sample std, median and range below.
TABLE = (('mean_r1', 'test mean R@1, ITM re-ranked', 2), ('itc_mean_r1', 'ITC only', 2),
         ('probe', 'ITM probe', 3), ('loss_itm', 'final loss_itm', 3),
         ('itm_epoch', 'epoch ITM leaves chance (1-based)', 1),
         ('hardness', 'hardness i2t', 3), ('hardness_t2i', 'hardness t2i', 3),
         ('itm_false_negatives', 'mined ITM false negatives', 3),
         ('batch_same_scene', 'same-scene share of batches', 4),
         ('sampler_share', 'batching work, share of the run', 4))


def _cell(v: dict, digits: int, n: int) -> str:
    """A figure's spread over seeds as a table cell: mean ± sample std, median [min, max]."""
    if math.isnan(v['mean']):
        return '–'
    if n == 1:  # one seed: its value, no spread
        return f'{v["mean"]:.{digits}f}'
    return (f'{v["mean"]:.{digits}f} ± {v["std"]:.{digits}f}<br>{v["median"]:.{digits}f} '
            f'[{v["min"]:.{digits}f}, {v["max"]:.{digits}f}]')


def gap_cell(gap: dict | None, n: int) -> str:
    """A paired gap as a table cell: mean [95 % t interval], seeds ahead, and the per-seed gaps."""
    if gap is None:
        return ''
    if n == 1:
        return f'{gap["mean"]:+.2f}'
    return (interval_text(gap['interval']).replace(', ahead', '<br>ahead') + '<br>('
            + ', '.join(f'{x:+.1f}' for x in gap['per_seed']) + ')')


def markdown_table(record: dict, costs: dict[str, float] | None = None) -> str:
    """The comparison as one markdown table, an arm per row at its selection: each figure's mean ± sample
    std over the seeds with its median and range, the paired gaps to GRIT-VLP (test R@1 re-ranked, and the
    same on each further test split) with their 95 % t intervals and sign counts, and (costs: strategy ->
    share of a paper-size step, tools.strategy_bench) the strategy's cost."""
    summary, gaps = record['summary'], record.get('gaps_to', {}).get('GRIT-VLP', {})
    n = len(record['seeds'])
    strategies = arm_strategies(list(summary), record.get('overrides', [])) if costs is not None else {}
    extra = extra_tests(next(iter(summary.values())))
    table = list(TABLE)
    for name in reversed(extra):  # after the test split's two recalls
        table[2:2] = [(f'{name}_mean_r1', f'{name} test mean R@1, re-ranked', 2),
                      (f'{name}_itc_mean_r1', f'{name}: ITC only', 2)]
    gap_keys = ['mean_r1'] + [f'{name}_mean_r1' for name in extra]
    head = ['arm', 'selected on val'] + [h for _, h, _ in table]
    head += ['gap to GRIT-VLP (paired)'] + [f'{name} gap to GRIT-VLP' for name in extra]
    head += ['cost, share of a step'] if costs is not None else []
    seeds = ', '.join(map(str, record['seeds']))
    about = (f'one seed ({seeds}): its values' if n == 1 else
             f'mean ± sample std over {n} seeds ({seeds}); below: median [min, max]. Gaps: mean '
             '[95 % t interval], the seeds on which the arm is ahead, and the per-seed gaps')
    lines = [about, '', '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for arm, stats in summary.items():
        chosen = f'lr {stats["lr"]:g}' + (f', {stats["setting"]}' if stats.get('setting') else '')
        cells = [arm, chosen] + [_cell(stats[key], digits, n) for key, _, digits in table]
        cells += [gap_cell(gaps.get(arm, {}).get(key), n) for key in gap_keys]
        if costs is not None:
            share = 0.0 if strategies[arm] == 'random' else costs.get(strategies[arm])
            cells.append('–' if share is None else f'{100 * share:.2f} %')
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n'


def sweep_table(record: dict) -> str:
    """The sweep as markdown: each arm's settings with their mean val R@1 (re-ranked, what selects) and mean
    test R@1 over the seeds, the selected one in bold (test is shown, never used to select)."""
    lines = ['| arm | setting | val mean R@1 | test mean R@1 |', '|---|---|---|---|']
    for arm, by_label in record['sweep'].items():
        chosen = record['selected_lr'][arm]
        chosen = setting_label(tuple(chosen) if isinstance(chosen, list) else chosen)
        for label, rows in by_label.items():
            val = statistics.fmean(r['val_mean_r1'] for r in rows.values())
            test = statistics.fmean(r['mean_r1'] for r in rows.values())
            cells = [arm, label, f'{val:.2f}', f'{test:.2f}']
            if label == chosen:
                cells = [f'**{c}**' for c in cells]
            lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n'


def read_costs(path: str) -> dict[str, float]:
    """strategy -> share of a paper-size step, from tools.strategy_bench's JSON; InputFileError naming the
    file when it is missing or is not that JSON."""
    saved = read_json(path, 'strategy benchmark (tools.strategy_bench --output_dir)')
    try:
        return {r['strategy']: float(r['share_of_step']) for r in saved['strategies']}
    except (KeyError, TypeError, ValueError) as e:
        raise InputFileError(f'{path}: not tools.strategy_bench\'s JSON (no strategies[].strategy and '
                             f'share_of_step: {e!r})') from e
