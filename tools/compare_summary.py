"""A comparison's numbers from its runs: one run's summary row (with the epoch its ITM leaves chance), the
learning rate val selects, and the printed report of a sweep with each arm's paired gaps to the baselines;
tools.compare runs the arms, tools.compare_tables renders its record."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from tools.arms import setting_label
from tools.compare_tables import extra_tests, interval_text
from tools.stats import paired_interval, spread

__all__ = ["COLUMNS", "ITM_CHANCE", "ITM_LEFT_CHANCE", "columns", "gap_figures", "itm_epoch", "report",
           "select_lr", "side_by_side", "summary_row"]

ITM_CHANCE = 0.637  # ITM's loss when it says p(match) = 1/3 (one positive, two mined negatives per pair)
ITM_LEFT_CHANCE = 0.02  # itm_epoch: the first epoch (1-based) whose mean loss_itm is this far below chance


def itm_epoch(rows: list[dict]) -> int:
    """The first epoch (1-based) whose mean ITM loss is ITM_LEFT_CHANCE below chance: when ITM starts to
    learn, what separates a low seed from a high one (docs/batch-construction.md). A run where it never
    does counts as one epoch past its end (censored, not dropped)."""
    return next((r['epoch'] + 1 for r in rows if r['loss_itm'] < ITM_CHANCE - ITM_LEFT_CHANCE), len(rows) + 1)


def summary_row(rows: list[dict], retrieval: dict, probe_result: dict) -> dict:
    """The numbers of one run that the tables show: test (and val) R@1 re-ranked and ITC-only, the probe."""
    # The batch figures of the last epoch (nan where a run has none: an older run, random batches' groups);
    # the same-scene share over the epochs after the first (one epoch's is a few dozen examples).
    same_scene = [r['batch_same_scene'] for r in rows if r.get('epoch', 0) > 0 and 'batch_same_scene' in r]
    out = {'loss_itm': rows[-1]['loss_itm'], 'hardness': rows[-1]['hardness'],
           **{k: rows[-1].get(k, math.nan) for k in ('hardness_t2i', 'itm_false_negatives',
                                                   'batch_groups')},
           'batch_same_scene': statistics.fmean(same_scene) if same_scene else math.nan,
           'itm_epoch': itm_epoch(rows),
           'steps': rows[-1].get('step', math.nan),  # training steps (tools.online_readings' equal steps)
           'train_seconds': sum(r['train_seconds'] for r in rows),
           # The strategy's own work (feature collection, grouping, dealing) as a share of the run's wall
           # clock: a ratio within one run, so it holds however fast the shared machine was that hour, which
           # its seconds alone do not (the step itself is the same model and batch for every arm). The run's
           # length is its epochs times their median time, so an epoch stretched by a pause (a stopped or
           # swapped-out process) does not shrink the share.
           'sampler_share': (sum(r['sampler_seconds'] for r in rows)
                             / (len(rows) * statistics.median(r['epoch_seconds'] for r in rows))
                             if all('sampler_seconds' in r and 'epoch_seconds' in r for r in rows)
                             else math.nan),
           'txt_r1': retrieval['test_txt_r1'], 'img_r1': retrieval['test_img_r1'],
           'mean_r1': retrieval['test_mean_r1'], 'r_mean': retrieval['test_r_mean'],
           'itc_txt_r1': retrieval['test_itc_txt_r1'], 'itc_img_r1': retrieval['test_itc_img_r1'],
           'itc_mean_r1': retrieval['test_itc_mean_r1'],
           'val_mean_r1': retrieval['val_mean_r1'], 'val_itc_mean_r1': retrieval['val_itc_mean_r1'],
           'probe': probe_result['overall'] if probe_result else math.nan}
    out.update({f'probe_{k}': v['accuracy'] for k, v in (probe_result or {}).get('per_kind', {}).items()})
    for name in extra_tests(retrieval):  # a corpus's further test splits (tools.runs.Corpus.tests)
        out.update({f'{name}_{k}': retrieval[f'{name}_{k}'] for k in ('mean_r1', 'itc_mean_r1', 'txt_r1',
                                                                       'img_r1')})
    return out


def side_by_side(runs: dict[str, tuple[list[dict], dict, dict]]) -> str:
    """Runs side by side: hardness and ITM loss per epoch, zero-shot R@1 (re-ranked, ITC only), probe."""
    names = list(runs)
    head = f'{"":>22}' + ''.join(f'{n:>16}' for n in names)
    lines = ['hardness = mean ITC similarity of the hardest in-batch ITM negative (epoch 0 is random'
             ' in both)', head]
    for e, _ in enumerate(runs[names[0]][0]):
        for key in ('hardness', 'loss_itm'):
            lines.append(f'{f"epoch {e} {key}":>22}' + ''.join(f'{runs[n][0][e][key]:>16.4f}' for n in names))
    lines += ['', 'zero-shot retrieval, synthetic test split (1,000 images of scenes no training split holds;'
              ' chance R@1 0.1 %)', head]
    for key, label in (('test_txt_r1', 'text R@1'), ('test_img_r1', 'image R@1'),
                       ('test_mean_r1', 'mean R@1'), ('test_itc_mean_r1', 'ITC-only mean R@1'),
                       ('test_r_mean', 'r_mean')):
        lines.append(f'{label:>22}' + ''.join(f'{runs[n][1][key]:>16.2f}' for n in names))
    lines += ['', 'compositional ITM probe: true caption vs one thing changed (chance 0.5)', head]
    for kind in runs[names[0]][2]['per_kind']:
        accuracies = (runs[n][2]['per_kind'][kind]['accuracy'] for n in names)
        lines.append(f'{kind:>22}' + ''.join(f'{a:>16.4f}' for a in accuracies))
    lines.append(f'{"overall":>22}' + ''.join(f'{runs[n][2]["overall"]:>16.4f}' for n in names))
    return '\n'.join(lines)


def select_lr(val_scores: dict[float, list[float]]) -> float:
    """The learning rate whose mean val score over the seeds is highest (the first of equal ones): the
    selection sees val numbers only, so the test split cannot steer it."""
    return max(val_scores, key=lambda lr: statistics.fmean(val_scores[lr]))


COLUMNS = ('loss_itm', 'itm_epoch', 'hardness', 'hardness_t2i', 'itm_false_negatives',
           'batch_same_scene', 'batch_groups', 'sampler_share', 'mean_r1', 'itc_mean_r1', 'txt_r1', 'img_r1',
           'probe', 'val_mean_r1')


def _width(column: str) -> int:
    """A printed column's width: its name's, at least 11."""
    return max(11, len(column))


def columns(row: dict) -> tuple[str, ...]:
    """The printed columns of a sweep whose rows look like `row`: COLUMNS, then each further test split's
    mean R@1 re-ranked and by ITC alone."""
    return COLUMNS + tuple(f'{name}_{k}' for name in extra_tests(row) for k in ('mean_r1', 'itc_mean_r1'))


def gap_figures(row: dict) -> tuple[str, ...]:
    """The figures whose gaps between arms are reported: test mean R@1 re-ranked and ITC only, the probe,
    and the same two recalls of each further test split."""
    return ('mean_r1', 'itc_mean_r1', 'probe') + tuple(f'{name}_{k}' for name in extra_tests(row)
                                                      for k in ('mean_r1', 'itc_mean_r1'))


def report(sweep: dict[str, dict[float | tuple, dict[int, dict]]], seeds: Sequence[int],
           baselines: Sequence[str] = ('random batches', 'GRIT-VLP', 'random + sigmoid')
           ) -> tuple[str, dict]:
    """The printed tables and the JSON summary of a sweep {arm: {setting: {seed: summary_row}}}; a setting
    is a learning rate, or (lr, grid setting) for an arm with a hyper-parameter grid (GRIDS). Each arm's
    setting is the one of best mean val R@1 (re-ranked); the test rows at it are reported per seed with
    mean, sample std, median and range, and the gaps to each baseline present, paired by seed, each with
    its 95 % t interval and the count of seeds on each side (tools.stats.paired_interval)."""
    first = next(iter(next(iter(next(iter(sweep.values())).values())).values()))
    shown, gapped = columns(first), gap_figures(first)
    lines = ['sweep, mean over seeds (selection: best val mean R@1 re-ranked; test never used)',
             f'{"arm":>18} {"setting":>16} {"val R@1":>9} {"val ITC":>9} {"test R@1":>9} {"test ITC":>9}']
    selected = {}
    for arm, by_setting in sweep.items():
        selected[arm] = select_lr({k: [by_setting[k][s]['val_mean_r1'] for s in seeds] for k in by_setting})
        for key, rows in by_setting.items():
            means = [statistics.fmean(rows[s][k] for s in seeds)
                     for k in ('val_mean_r1', 'val_itc_mean_r1', 'mean_r1', 'itc_mean_r1')]
            mark = ' <' if key == selected[arm] else ''
            lines.append(f'{arm:>18} {setting_label(key):>16}' + ''.join(f'{m:>10.2f}' for m in means) + mark)
    lines += ['', 'test split at each arm\'s selected setting (mean R@1 = mean of text and image R@1; '
              'ITC = ranked by the cosine alone)',
              f'{"seed":>6} {"arm":>18} {"setting":>16}' + ''.join(f' {c:>{_width(c)}}' for c in shown)]
    summary = {}
    for arm, key in selected.items():
        rows = sweep[arm][key]
        label = setting_label(key)
        for s in seeds:
            lines.append(f'{s:>6} {arm:>18} {label:>16}'
                         + ''.join(f' {rows[s][c]:>{_width(c)}.4f}' for c in shown))
        stats = {c: spread([rows[s][c] for s in seeds]) for c in shown}
        for what in ('mean', 'std', 'median', 'min', 'max'):
            lines.append(f'{what:>6} {arm:>18} {label:>16}'
                         + ''.join(f' {stats[c][what]:>{_width(c)}.4f}' for c in shown))
        lr = key[0] if isinstance(key, tuple) else key
        summary[arm] = {'lr': lr, 'setting': key[1] if isinstance(key, tuple) else None, **stats}
    gaps: dict[str, dict] = {}
    for baseline in [b for b in baselines if b in selected]:
        lines += ['', f'gap to {baseline}, paired by seed: mean [95 % t interval], seeds ahead; per seed']
        gaps[baseline] = {}
        for arm in selected:
            if arm == baseline:
                continue
            per_seed = {c: [sweep[arm][selected[arm]][s][c] - sweep[baseline][selected[baseline]][s][c]
                            for s in seeds] for c in gapped}
            gaps[baseline][arm] = {c: {'per_seed': v, **spread(v), 'interval': paired_interval(v)}
                                   for c, v in per_seed.items()}
            for c, v in per_seed.items():
                lines.append(f'{arm:>18} {c:>18}: {interval_text(gaps[baseline][arm][c]["interval"])}; '
                             + ', '.join(f'{x:+.2f}' for x in v))
    selected_json = {a: (list(k) if isinstance(k, tuple) else k) for a, k in selected.items()}
    # 'gaps' stays the gap to random batches (as before); every baseline's under gaps_to.
    return '\n'.join(lines), {'selected_lr': selected_json, 'summary': summary,
                              'gaps': gaps.get('random batches', {}), 'gaps_to': gaps}
