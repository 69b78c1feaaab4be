"""Online selection (JEST, RHO-LOSS) against the plain-batch arms read two ways (issue 52): at equal compute
and at equal steps, per seed, each gap with its paired 95 % t interval and sign count.

    python -m tools.online_readings --compare output/compare_online/compare.json \
        --curves docs/results/efficiency_strategies.json [--output_dir docs/results]

--compare is a tools.compare record holding the online arms and the plain arms (GRIT-VLP, random batches,
B3, ...) at their selections (e.g. the online arms' run with --merge of the plain arms' record); --curves a
tools.efficiency record with the plain arms' zero-shot test R@1 after every evaluated epoch, per seed, at
the same selections.

- Equal compute: each online run's final test R@1 against the plain arm's final one (12 epochs), same
  seed. The online arms' epochs were set so that their executed FLOPs, training step and scoring forwards
  together, are at most the plain runs' (tools.step_measure.equal_compute_epochs: 31 epochs of the tiny
  config, 0.995 of 12 plain epochs); the reference model's pre-training is outside both.
- Equal steps: each online run's final test R@1 (after its S training steps on N examples: the row's
  `steps`) against the plain arm's R@1 at its last evaluated epoch whose steps do not exceed S (epochs x
  the plain epoch's steps, read from the record's reference run, a plain run on the same data and batch).
  That point lies inside the plain run's 12-epoch schedule (its rate not yet decayed to the floor), which
  favours the online arm; the reading bounds what equal steps give, it is not a plain run scheduled for S
  steps.

Prints one JSON line; with --output_dir also writes online_readings.json and online_readings.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from grit_io import InputFileError
from tools.arms import ONLINE_ARMS
from tools.cli import add_output_dir, emit_record, tool_parser
from tools.compare_tables import gap_cell
from tools.records import Curves, compare_record, merged_curves, selected_rows, selection
from tools.stats import paired_interval
from training.cli import Parser, run_main

__all__ = ["build_parser", "equal_steps_epoch", "main", "markdown", "readings", "record_curves"]

READINGS = ('equal_compute', 'equal_steps')
SCORES = {'mean_r1': 'test mean R@1, ITM re-ranked', 'itc_mean_r1': 'test mean R@1, ITC only'}


def build_parser() -> Parser:
    """The tool's command line."""
    p = tool_parser("tools.online_readings", __doc__.splitlines()[0])
    p.add_argument("--compare", required=True, help="tools.compare's compare.json with the online and the "
                                                    "plain arms at their selections")
    p.add_argument("--curves", required=True, nargs="+",
                   help="tools.efficiency's efficiency.json records with the plain arms' per-epoch curves at "
                        "the --compare record's selections (several: their seeds together; an arm's seed in "
                        "two files must be the same curve)")
    p.add_argument("--plain", nargs="*", default=None,
                   help="arms to read against (default: every other arm of --compare, online ones included)")
    add_output_dir(p, "online_readings.json and online_readings.md")
    return p


def equal_steps_epoch(curve: list[dict], steps: int, plain_steps_per_epoch: int) -> dict | None:
    """The last point of a plain run's curve whose epochs x plain_steps_per_epoch <= steps (None: none)."""
    points = [p for p in curve if p['epoch'] * plain_steps_per_epoch <= steps]
    return points[-1] if points else None


def record_curves(paths: Sequence[str], record: dict) -> Curves:
    """{(arm, seed): points} of several tools.efficiency records together, for the arms of the compare record
    at its selections (tools.records.merged_curves: InputFileError naming the file that is no such record,
    ran an arm at another rate or setting, or gives an arm's seed another curve)."""
    runs = {arm: selection(record, arm) for arm in record['selected_lr']}
    return merged_curves(paths, runs, None, micro=False, timing_epochs=0)[0]


def _gap(pairs: dict[int, tuple[float, float]]) -> dict:
    """Per-seed (online, plain) values -> the gaps, their interval and the seeds."""
    seeds = sorted(pairs)
    gaps = [pairs[s][0] - pairs[s][1] for s in seeds]
    return {'seeds': seeds, 'per_seed': gaps, 'interval': paired_interval(gaps)}


def readings(record: dict, curves: Curves, plain: Sequence[str] | None = None) -> dict:
    """Both readings of every online arm of `record` against every plain arm -> {online: {plain: {reading:
    {score: gap}}}} with the plain points each equal-steps gap used; curves: record_curves'."""
    online = [a for a in record['selected_lr'] if a in ONLINE_ARMS]
    # Every other arm by default, the other online arm too (at equal compute; it has no per-epoch curve).
    plain = list(plain) if plain is not None else list(record['selected_lr'])
    missing = [a for a in plain if a not in record['selected_lr']]
    if not online or missing:
        raise ValueError(f"--compare has no online arm ({', '.join(ONLINE_ARMS)})" if not online else
                         f"--compare lacks the plain arm(s) {missing}")
    reference = record.get('reference') or {}
    if not reference.get('steps') or not reference.get('epochs'):
        raise ValueError("--compare has no reference run with its steps and epochs (tools.compare records it "
                         "for online arms): the plain epoch's steps are read from it")
    per_epoch = int(reference['steps']) // int(reference['epochs'])
    out: dict = {'plain_steps_per_epoch': per_epoch, 'arms': {}}
    for arm in online:
        rows = selected_rows(record, arm)
        missing_steps = [s for s, r in rows.items() if not r.get('steps')]
        if missing_steps:
            raise ValueError(f"{arm}: rows of seeds {missing_steps} lack 'steps' (a record of tools.compare "
                             "before the field: run it again with --reuse)")
        out['arms'][arm] = {}
        for base in (b for b in plain if b != arm):
            base_rows = selected_rows(record, base)
            entry: dict = {'equal_compute': {}, 'equal_steps': {}, 'equal_steps_points': {}}
            seeds = sorted(set(rows) & set(base_rows))
            for score in SCORES:
                final = {s: (rows[s][score], base_rows[s][score]) for s in seeds}
                entry['equal_compute'][score] = _gap(final)
            points = {}
            for seed, row in rows.items():
                curve = curves.get((base, seed))
                point = equal_steps_epoch(curve, int(row['steps']), per_epoch) if curve else None
                if point is not None:
                    points[seed] = point
            entry['equal_steps_points'] = {
                s: {'online_steps': int(rows[s]['steps']), 'plain_epoch': p['epoch'],
                    'plain_steps': p['epoch'] * per_epoch} for s, p in sorted(points.items())}
            for score in SCORES:
                entry['equal_steps'][score] = _gap({s: (rows[s][score], p[score]) for s, p in points.items()})
            out['arms'][arm][base] = entry
    return out


def _cell(gap: dict) -> str:
    """A gap as a table cell (tools.compare's), '–' without seeds."""
    return gap_cell(gap, len(gap['seeds'])) if gap['seeds'] else '–'


def markdown(result: dict) -> str:
    """The readings as a markdown table: a row per online and plain arm, a column per reading and score."""
    lines = ['Online selection against each plain arm, paired by seed: gap in test mean R@1 (online minus '
             'plain), mean [95 % t interval], seeds ahead; per seed. Equal compute: both runs\' finals. '
             'Equal steps: the online final against the plain run at its last evaluated epoch of at most as '
             f'many steps ({result["plain_steps_per_epoch"]} per plain epoch).', '',
             '| online | against | equal compute, re-ranked | equal compute, ITC only | equal steps, '
             're-ranked | equal steps, ITC only | plain epoch at equal steps |', '|---' * 7 + '|']
    for arm, bases in result['arms'].items():
        for base, e in bases.items():
            epochs = sorted({p['plain_epoch'] for p in e['equal_steps_points'].values()})
            cells = [_cell(e[reading][score]) for reading in READINGS for score in SCORES]
            lines.append(f"| {arm} | {base} | {' | '.join(cells)} | {', '.join(map(str, epochs)) or '–'} |")
    return '\n'.join(lines) + '\n'


def main(argv: Sequence[str] | None = None) -> dict:
    """Read both records, print the readings as one JSON line (and write them with --output_dir)."""
    args = build_parser().parse_args(argv)
    record = compare_record(args.compare)
    curves = record_curves(args.curves, record)
    try:
        result = {'compare': args.compare, 'curves': args.curves, **readings(record, curves, args.plain)}
    except ValueError as e:
        raise InputFileError(f'{args.compare}: {e}') from e
    return emit_record(result, args.output_dir, 'online_readings', markdown(result))


if __name__ == "__main__":
    run_main(main)
