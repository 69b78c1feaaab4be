"""Rows, curves and timed pairs read back from the records earlier comparisons wrote (`--merge` of
tools.compare and tools.efficiency): a sweep run in parts, on several machines, or whose run folders are
gone. A record is taken only where it was made the way this run would make it; otherwise, or where two
records disagree about one entry, InputFileError names the file."""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Sequence

from grit_io import InputFileError, read_json
from tools.arms import setting_label
from training.logger import current_names

__all__ = ["Curves", "compare_record", "merge_note", "merged_curves", "merged_rows", "merged_table_rows",
           "selected_rows", "selection"]

Curves = dict[tuple[str, int], list[dict]]  # (arm, seed) -> its points


def _record(path: str, tool: str, field: str) -> dict:
    """The JSON record `tool` wrote at path; InputFileError naming it when it is not one (no `field`)."""
    saved = read_json(path, f'{tool} record ({tool} --output_dir .../{tool.split(".")[-1]}.json)')
    if not isinstance(saved, dict) or not isinstance(saved.get(field), dict):
        raise InputFileError(f'{path}: not a {tool} record (no "{field}")')
    return saved


def _same_overrides(made: Sequence[str], asked: Sequence[str]) -> bool:
    """Whether two --set lists make the same runs: equal, or the same items in another order where no key
    repeats (the config applies distinct keys alike in any order; a repeated key's last value wins)."""
    def distinct(items: Sequence[str]) -> bool:
        keys = [item.partition('=')[0].strip() for item in items]
        return len(set(keys)) == len(keys)

    return list(made) == list(asked) or (distinct(made) and distinct(asked) and sorted(made) == sorted(asked))


def compare_record(path: str) -> dict:
    """The record tools.compare wrote at path; InputFileError naming it when it is not one."""
    return _record(path, 'tools.compare', 'sweep')


def _take(store: dict, source: dict, key: Hashable, value: object, path: str, what: str) -> None:
    """store[key] = value, read from path; InputFileError when an earlier file gave it another value."""
    if key in store and store[key] != value:
        raise InputFileError(f'{path}: {what} differs from the same in {source[key]}')
    store[key], source[key] = value, path


def merged_rows(paths: Sequence[str], overrides: Sequence[str], corpus: str = 'synthetic'
                ) -> dict[tuple[str, str, int], dict]:
    """{(arm, setting label, seed): summary row} of earlier compare.json records (null read back as nan);
    InputFileError naming the file when it is not a compare record, was made on another corpus or with
    other --set overrides, or holds a row another file holds with other figures."""
    rows: dict[tuple[str, str, int], dict] = {}
    source: dict = {}
    for path in paths:
        saved = _record(path, 'tools.compare', 'sweep')
        if saved.get('corpus', 'synthetic') != corpus:  # records before --corpus were all synthetic
            raise InputFileError(f'{path}: made on the {saved.get("corpus", "synthetic")} corpus, this '
                                 f'comparison on the {corpus} one: its rows are other runs')
        if not _same_overrides(saved.get('overrides', []), overrides):
            raise InputFileError(f'{path}: made with --set {saved.get("overrides")}, this comparison with '
                                 f'--set {list(overrides)}: its rows are other runs')
        for arm, by_label in saved['sweep'].items():
            for label, by_seed in by_label.items():
                for seed, row in by_seed.items():  # compared as written: null, not nan (nan != nan)
                    _take(rows, source, (arm, label, int(seed)), current_names(row), path,
                          f'{arm} {label} seed {seed}')
    return {key: {k: math.nan if v is None else v for k, v in row.items()} for key, row in rows.items()}


def merged_curves(paths: Sequence[str], runs: dict[str, tuple[float, str | None]],
                  epochs: Sequence[int] | None, micro: bool, timing_epochs: int,
                  corpus: str = 'synthetic') -> tuple[Curves, dict[str, dict]]:
    """({(arm, seed): curve}, {arm: timing}) of earlier efficiency.json records, for the arms of `runs` (arm
    -> its rate and setting) the files ran the same way, at these 1-based epochs; a timing only when the file
    timed pairs of timing_epochs epochs (epochs None: whatever epochs each file evaluated). InputFileError
    naming the file when it is not an efficiency record, ran an arm at another rate or setting, other epochs,
    --micro or corpus (a record without one is the synthetic world's), or differs from another file's."""
    curves: Curves = {}
    timing: dict[str, dict] = {}
    source: dict = {}
    for path in paths:
        saved = _record(path, 'tools.efficiency', 'curves')
        if bool(saved.get('micro')) != micro:
            raise InputFileError(f'{path}: made with micro={saved.get("micro")}, this run with micro={micro}')
        if (made_on := saved.get('corpus', 'synthetic')) != corpus:
            raise InputFileError(f'{path}: made on the {made_on} corpus, this run on the {corpus} one')
        for arm in [a for a in saved['curves'] if a in runs]:
            made = (saved.get('learning_rates', {}).get(arm), saved.get('settings', {}).get(arm))
            if made != runs[arm]:
                raise InputFileError(f'{path}: ran {arm} at (lr, setting) {made}, this run at {runs[arm]}')
            for seed, curve in saved['curves'][arm].items():
                if epochs is not None and (made := [p['epoch'] for p in curve]) != list(epochs):
                    raise InputFileError(f'{path}: {arm} seed {seed} has epochs {made}, this run evaluates '
                                         f'{list(epochs)}')
                # Each point's seconds at the side-by-side time are this run's to give (add_timed_seconds).
                found = [{k: v for k, v in p.items() if k != 'timed_seconds'} for p in curve]
                _take(curves, source, (arm, int(seed)), found, path, f'{arm} seed {seed}')
            timed = saved.get('timing', {}).get(arm)
            timed = current_names(timed) if timed else timed
            if timed and saved.get('timing_epochs') == timing_epochs:
                _take(timing, source, arm, timed, path, f'{arm}\'s timing')
    return curves, timing


def merged_table_rows(paths: Sequence[str], table: int, preset: str, sets: Sequence[str], finetune: bool,
                      wanted: Collection[tuple[str, int]]) -> dict[tuple[str, int], dict]:
    """{(row, seed): metrics} of the `wanted` (row, seed)s earlier tools.ablate table<N>.json records hold
    (metrics under today's names; the fine-tuned figures dropped when this run does not fine-tune, as its own
    rows have none); InputFileError naming the file when it is not an ablate record, is another table's or
    preset's, was made with other --set overrides, lacks the fine-tuned figures this run asks for in a wanted
    row, or holds a wanted row another file holds with other figures."""
    rows: dict[tuple[str, int], dict] = {}
    source: dict = {}
    for path in paths:
        saved = _record(path, 'tools.ablate', 'rows')
        made = {'table': saved.get('table'), 'preset': saved.get('preset'),
                '--set': list(saved.get('set', []))}
        for what, this in (('table', table), ('preset', preset), ('--set', list(sets))):
            if made[what] != this:
                raise InputFileError(f'{path}: made with {what} {made[what]}, this run with {what} {this}: '
                                     'its rows are other runs')
        for row, per_seed in saved['rows'].items():
            for seed, metrics in per_seed.items():
                if (row, int(seed)) not in wanted:
                    continue
                if finetune and metrics.get('ft_tr_r1') is None:
                    raise InputFileError(f'{path}: {row} seed {seed} was not fine-tuned (made with '
                                         '--no_finetune); this run fine-tunes')
                kept = {k: v for k, v in current_names(metrics).items()
                        if finetune or not k.startswith('ft_')}
                _take(rows, source, (row, int(seed)), kept, path, f'{row} seed {seed}')
    return rows


def merge_note(files: Sequence[str], parts: Sequence[str]) -> str:
    """The line of a tool's .md saying what was read from --merge's files instead of run ('' if nothing)."""
    return f'\nRead from {", ".join(files)} (--merge), not run: {"; ".join(parts)}\n' if parts else ''


def selection(record: dict, arm: str) -> tuple[float, str | None]:
    """An arm's selected (learning rate, grid setting or None) in a tools.compare record."""
    chosen = record['selected_lr'][arm]
    return (chosen[0], chosen[1]) if isinstance(chosen, list) else (chosen, None)


def selected_rows(record: dict, arm: str) -> dict[int, dict]:
    """A tools.compare record's rows of `arm` at its selection -> {seed: row}."""
    lr, setting = selection(record, arm)
    label = setting_label((lr, setting) if setting is not None else lr)
    return {int(seed): row for seed, row in record['sweep'][arm][label].items()}
