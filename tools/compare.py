"""GRIT-VLP against random batches as a reviewer would run it: each arm's learning rate selected on val, the
test split reported at that selection, per seed, re-ranked and ITC-only, with the ITM probe.

    python -m tools.compare --seeds 1 2 3 --lrs 1.25e-4 2.5e-4 5e-4 1e-3 \
        [--arms GRIT-VLP "GRIT-VLP M/N=96" "random batches"] [--epochs 24] [--output_dir DIR] [--reuse] \
        [--set key=value ...] [--merge COMPARE_JSON ...]
    python -m tools.compare --seeds 11 12 13 --selected     # each arm at its 24-epoch selection only
    python -m tools.compare --seeds 4 5 6 --selected --arms GRIT-VLP B3 \
        --epochs 12                                          # the tiny config's schedule (SELECTED_LR)
    python -m tools.compare --corpus real --seeds 1 2 3 --lrs 2.5e-4 5e-4 1e-3 --selected_settings \
        --arms GRIT-VLP "random batches" B3 GCBS "GRIT-VLP + S-ITC" --output_dir output/compare_real

Every arm (tools.arms.ARMS) pre-trains configs/tiny/Pretrain.yaml once per learning rate and seed (the
schedule's floor and warm-up start scaled with it) for --epochs: by default 24, twice the config's 12, the
protocol issue 49 adopted for its seed noise (tools.runs.COMPARISON_EPOCHS; --epochs 12 is the config's own,
the protocol before it, whose selections are SELECTED_LR), and an arm with a hyper-parameter
(tools.arms.GRIDS: the same two-setting grid size for every such arm) once per setting too, and is
evaluated zero-shot with `python -m Retrieval --evaluate` (configs/tiny/Retrieval.yaml: val and test, ITM
re-ranked and by the ITC cosine alone) and tools.probe.
Each arm's learning rate (and grid setting) is the one with the best mean val R@1 (re-ranked) over the
seeds (select_lr: the test split is never read to select); the per-seed test rows at it, their mean,
sample std, median and range, and the gaps to random batches and to GRIT-VLP per seed are printed, then a
JSON object with every run (also <output_dir>/compare.json), and <output_dir>/compare.md: a markdown
table (an arm per row at its selection; --costs adds each strategy's measured cost), then the sweep (each
setting's mean val and test R@1, the selection in bold). A row's batch
figures: the last epoch's hardness both ways and mined-negative false-negative rate, and the same-scene
share of the batches over epochs 1.. (tools.batch_scenes rebuilds it for runs that did not log it). Runs
go two side by side, one thread each (tools.launch.run_side_by_side): about 8 minutes per 24-epoch run on a
2-core CPU (4 at 12 epochs). --reuse keeps a run whose result.json records the same command (the code is
not compared: reuse within one checkout; nor is the folder, so a copied run folder is reused). `make demo`
runs one seed of two arms at their selected rates (tools.arms.SELECTED_LR).
--corpus real runs the same protocol on tools.make_real's corpora (tools.runs.CORPORA: configs/real/,
val and test of held-out concepts and the held-out artist's test split; no probe, which is the synthetic
world's); --selected_settings holds each grid arm at its synthetic selection (SELECTED_SETTING) and sweeps
the rates only, so that every arm gets the same number of runs.
--merge reads rows from earlier compare.json records instead of running them (a sweep run in parts, on
other machines, or kept after its run folders are gone): a row there of an asked arm, setting and seed is
taken as it is, the files must have been made with the same schedule and --set, and the record names what
came from where (merged_from).
--record NAME names the record (default compare: NAME.json, NAME.md) so that commands run in parallel into
one folder of runs (a seed each) keep each its own; a second command writing the same record into the same
folder is refused at its start, naming the first (tools.cli.record_claim).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from grit_io import InputFileError
from tools.arms import (
    ARMS,
    GRIDS,
    ONLINE_ARMS,
    REFERENCE,
    SELECTED_LR,
    arm_overrides,
    selected_setting,
    selection,
    setting_label,
)
from tools.batch_scenes import with_batch_scenes
from tools.cli import add_record_name, emit_record, record_claim, tool_parser
from tools.compare_summary import report, summary_row
from tools.compare_tables import markdown_table, read_costs, sweep_table
from tools.launch import ROOT, in_root
from tools.records import merge_note, merged_rows
from tools.runs import CORPORA, last_checkpoint, prepare_pretraining, run_dir, run_pairs
from training.cli import Parser, run_main
from training.config import TaskConfig
from training.config_resolve import resolve_config

__all__ = ["STRATEGY_BENCH", "Schedule", "build_parser", "comparison_schedule", "default_output_dir", "main",
           "sweep_key", "sweep_order"]

STRATEGY_BENCH = 'docs/results/strategy_bench.json'  # the strategies' measured cost (tools.strategy_bench)


def sweep_key(lr: float, setting: str | None) -> float | tuple:
    """A sweep setting: the learning rate, or (lr, grid setting) for an arm with a grid."""
    return (lr, setting) if setting is not None else lr


def train_reference(output_dir: str, overrides: Sequence[str], corpus, reuse: bool) -> dict:
    """The online selection arms' reference model (tools.arms.REFERENCE), pre-trained and evaluated in
    <output_dir>/reference/ (reused with --reuse) -> {'checkpoint', 'arm', 'seed', 'lr', 'steps', its test
    R@1 re-ranked and ITC-only}: reported beside the arms, whose compute excludes its training."""
    arm, seed = REFERENCE['arm'], REFERENCE['seed']
    lr = SELECTED_LR[arm]
    directory = os.path.join(output_dir, 'reference')
    sets = arm_overrides(arm, lr, None, corpus.pretrain) + list(overrides)
    log, retrieval, _ = run_pairs({'reference': (directory, ['--seed', str(seed), '--set', *sets],
                                                 list(overrides))}, reuse=reuse, corpus=corpus)['reference']
    return {'checkpoint': last_checkpoint(os.path.join(directory, 'pretrain')), 'arm': arm, 'seed': seed,
            'lr': lr, 'epochs': len(log), 'steps': log[-1].get('step'),
            'test_mean_r1': retrieval.get('test_mean_r1'),
            'test_itc_mean_r1': retrieval.get('test_itc_mean_r1')}


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser('tools.compare', __doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, nargs='+', required=True,
                   help='pre-training seeds (each arm, each rate)')
    p.add_argument('--lrs', type=float, nargs='+', default=None,
                   help='peak learning rates every arm is swept over (default: the config\'s, no sweep)')
    p.add_argument('--selected', action='store_true',
                   help='each arm at its selection only, at the schedule trained: SELECTED_LR_24 at the '
                        'default 24 epochs, SELECTED_LR at --epochs 12, SELECTED_LR_REAL with --corpus real '
                        '(tools.arms.selection); and SELECTED_SETTING for an arm with a grid: the sweeps\' '
                        'selections; no sweep)')
    p.add_argument('--selected_settings', action='store_true',
                   help='each grid arm at its selected setting (SELECTED_SETTING) with the rates swept: the '
                        'same number of runs for every arm (default: the rates times the arm\'s grid)')
    p.add_argument('--corpus', choices=list(CORPORA), default='synthetic',
                   help='what the runs pre-train on and are evaluated on (tools.runs.CORPORA; real: '
                        'python -m tools.make_real first; default: synthetic)')
    p.add_argument('--arms', nargs='+', choices=list(ARMS), default=['GRIT-VLP', 'random batches'],
                   help='the arms (default: GRIT-VLP and random batches)')
    p.add_argument('--output_dir', default=None,
                   help='folder of the runs (<output_dir>/seed<S>/<arm>_lr<lr>/...) and of compare.json, the '
                        'printed record (default: output/compare[_<corpus>][_e<epochs>][_cosine<epochs>], '
                        'each part where the corpus or schedule is not the synthetic config\'s own: a run\'s '
                        'folder names neither, so two of them in one folder would overwrite each other\'s '
                        'runs; output/compare is the folder tools.efficiency reuses)')
    p.add_argument('--epochs', type=int, default=None,
                   help='pre-training epochs of every run, the cosine schedule\'s length with them '
                        '(default: the corpus\'s comparison schedule, synthetic '
                        f'{CORPORA["synthetic"].epochs} (issue 49), real its config\'s own; or a schedule in '
                        '--set)')
    p.add_argument('--reuse', action='store_true',
                   help='keep the runs whose result.json records the same pre-training command')
    p.add_argument('--set', dest='overrides', nargs='*', action='extend', default=[], metavar='KEY=VALUE',
                   help='config overrides for every pre-training (the evaluations get those their config '
                        'takes)')
    p.add_argument('--costs', default=None,
                   help='tools.strategy_bench\'s JSON: each strategy\'s cost at the paper\'s sizes, a column '
                        f'of compare.md (default: the repository\'s {STRATEGY_BENCH}; left out when missing)')
    p.add_argument('--merge', nargs='+', default=[], metavar='COMPARE_JSON',
                   help='earlier compare.json records made with the same schedule and --set: a row they '
                        'hold (arm, setting, seed) is read from them, not run; the record names them '
                        '(merged_from)')
    add_record_name(p, 'compare')
    return p


def sweep_order(arm: str, key: float | tuple) -> tuple[float, int]:
    """Where a sweep key (a rate, or (rate, grid setting)) of `arm` sorts: by rate, then by the setting's
    place in the arm's grid (GRIDS)."""
    lr, setting = key if isinstance(key, tuple) else (key, None)
    grid = GRIDS.get(arm, [])
    return lr, grid.index(setting) if setting in grid else -1


@dataclass(frozen=True)
class Schedule:
    """What every pre-training of a comparison trains for, and how the user asked for it."""

    base: TaskConfig        # the pre-training config resolved with `overrides`
    epochs: int             # the epochs every run trains
    own: int                # the corpus's pre-training config's own max_epoch
    overrides: list[str]    # every run's --set: the schedule first, then the user's
    scheduled: list[str]    # the user's --set items that set the schedule
    source: str             # how the schedule was asked for, as messages name it


def comparison_schedule(parser: Parser, args: argparse.Namespace) -> Schedule:
    """The schedule --epochs, a schedule in --set or the corpus's default (tools.runs.CORPORA) asks for;
    --epochs beside a schedule in --set, or a schedule set for the online arms, ends in parser.error."""
    schedule = {'max_epoch', 'schedular.epochs', 'scheduler.epochs'}
    scheduled = [o for o in args.overrides if o.partition('=')[0].strip() in schedule]
    if args.epochs is not None and args.epochs < 1:
        parser.error(f'--epochs {args.epochs}: at least 1')
    if args.epochs is not None and scheduled:
        parser.error(f'--epochs {args.epochs} and --set {" ".join(scheduled)} both set the schedule: '
                     'give one')
    corpus = CORPORA[args.corpus]
    with in_root():
        own = resolve_config('pretrain', corpus.pretrain, [], check_paths=False).max_epoch
    # The comparison's schedule (tools.runs.COMPARISON_EPOCHS on the synthetic world) goes first, as the
    # records made with --set max_epoch=24 schedular.epochs=24 before it was the default spell it, so that
    # they merge and their runs are reused; the config's own schedule adds nothing, as it always did.
    epochs = args.epochs or (None if scheduled else corpus.epochs)
    overrides = ([f'max_epoch={epochs}', f'schedular.epochs={epochs}'] if epochs and epochs != own else []
                 ) + list(args.overrides)
    source = (f'--set {" ".join(scheduled)}' if scheduled else f'--epochs {args.epochs}' if args.epochs
              else f'the default --epochs {epochs}')
    if online := [a for a in args.arms if a in ONLINE_ARMS and any(
            o.partition('=')[0].strip() in schedule for o in overrides)]:
        # Their epochs are set for equal compute with the tiny config's 12 (tools.arms.ARMS), and the schedule
        # comes last: one set for every arm would silently train them at another compute than they claim.
        parser.error(f'{source}: {", ".join(online)} run at equal compute with 12 epochs of plain batches on '
                     'the tiny config (their max_epoch in tools.arms.ARMS), which a schedule set for every '
                     f'arm would override; run them at the config\'s own schedule, --epochs {own}')
    with in_root():
        base = resolve_config('pretrain', corpus.pretrain, overrides, check_paths=False)
    return Schedule(base, base.max_epoch or base.schedular.epochs, own, overrides, scheduled, source)


def default_output_dir(corpus: str, schedule: Schedule) -> str:
    """output/compare[_<corpus>][_e<epochs>][_cosine<epochs>]: a run's folder names neither the corpus nor
    the schedule, so the default folder does, and two comparisons left at their defaults never overwrite
    each other's runs."""
    cosine = schedule.base.schedular.epochs
    return ('output/compare' + ('' if corpus == 'synthetic' else f'_{corpus}')
            + ('' if schedule.epochs == schedule.own else f'_e{schedule.epochs}')
            + ('' if cosine == schedule.epochs else f'_cosine{cosine}'))


def main(argv: Sequence[str] | None = None) -> dict:
    """Sweep, select on val, report test; returns the JSON record (sweep, selected_lr, summary, gaps)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.selected and args.lrs:
        parser.error('--selected and --lrs exclude each other: the selected rates, or a sweep')
    if args.selected and args.selected_settings:
        parser.error('--selected already holds every arm at its selected setting (drop --selected_settings)')
    schedule = comparison_schedule(parser, args)
    base, epochs, own, overrides = schedule.base, schedule.epochs, schedule.own, schedule.overrides
    scheduled, source, corpus = schedule.scheduled, schedule.source, CORPORA[args.corpus]
    chosen = {}
    output_dir = os.path.abspath(args.output_dir or default_output_dir(args.corpus, schedule))
    with contextlib.ExitStack() as claim:  # the record claimed once the arguments and --merge are checked
        if args.selected and base.schedular.epochs != epochs:
            # Every sweep behind a selection ran its cosine over the epochs it trained; keyed on max_epoch
            # alone, a cut-short or stretched schedule would silently take a rate selected under another one.
            parser.error(f'--selected: max_epoch={epochs} with schedular.epochs={base.schedular.epochs}; the '
                         'selections were swept with the two equal (set both, or sweep this schedule with '
                         '--lrs)')
        if args.selected or args.selected_settings:
            try:  # (lr, setting) per arm, selected at the schedule asked for; a sweep needs the setting only
                chosen = {arm: selection(arm, args.corpus, epochs) if args.selected
                          else (None, selected_setting(arm)) for arm in args.arms}
            except ValueError as e:
                own_hint = '' if epochs == own else f'; --epochs {own} takes the config\'s own schedule\'s'
                parser.error(f'--selected{"_settings" * args.selected_settings}: {e}{own_hint}')
        arm_lrs = {arm: [chosen[arm][0]] if args.selected else args.lrs or [None] for arm in args.arms}
        # An arm's hyper-parameter grid is swept beside the rates; --selected(_settings) takes the selected
        # one.
        arm_settings = {arm: [chosen[arm][1]] if chosen else GRIDS.get(arm, [None]) for arm in args.arms}
        try:
            merge = merged_rows([os.path.abspath(m) for m in args.merge], overrides, args.corpus)
        except InputFileError as e:
            if scheduled or epochs == own:
                raise
            raise InputFileError(f'{e} (the schedule\'s overrides come from {source}; --epochs {own} for a '
                                 'record of the config\'s own schedule)') from e
        claim.enter_context(record_claim(output_dir, args.record, 'tools.compare'))
        sweep: dict[str, dict[float | tuple, dict[int, dict]]] = {}
        merged_from: dict[str, dict[str, list[int]]] = {}  # arm -> setting -> the seeds read
        with in_root():
            prepare_pretraining(overrides, corpus.pretrain)
            runs = {}
            for seed in args.seeds:  # seed-major: a cut-short sweep has whole seeds
                for lr in sorted({lr for lrs in arm_lrs.values() for lr in lrs}, key=lambda x: x or 0):
                    for arm in [a for a in args.arms if lr in arm_lrs[a]]:
                        for setting in arm_settings[arm]:
                            key = sweep_key(lr if lr is not None else base.optimizer.lr, setting)
                            if (arm, setting_label(key), seed) in merge:  # read, not run
                                row = merge[(arm, setting_label(key), seed)]
                                sweep.setdefault(arm, {}).setdefault(key, {})[seed] = row
                                by_label = merged_from.setdefault(arm, {})
                                by_label.setdefault(setting_label(key), []).append(seed)
                                continue
                            sets = arm_overrides(arm, lr, setting, corpus.pretrain) + overrides
                            # The evaluations get the user's overrides (those shaping the model), not the
                            # arm's.
                            runs[(arm, lr, setting, seed)] = (
                                run_dir(output_dir, arm, seed, lr, setting),
                                ['--seed', str(seed), *(['--set', *sets] if sets else [])], list(overrides))
            reference = None
            if any(arm in ONLINE_ARMS for arm, *_ in runs):  # their reference model first, then the arms
                reference = train_reference(output_dir, overrides, corpus, args.reuse)
                for (arm, *_), (_, arguments, _) in runs.items():
                    if arm in ONLINE_ARMS:
                        arguments += [f'batching.{ONLINE_ARMS[arm]}.reference={reference["checkpoint"]}']
            results = run_pairs(runs, reuse=args.reuse, corpus=corpus) if runs else {}
        for (arm, lr, setting, seed), (log, retrieval, probe) in results.items():
            pre_dir = os.path.join(runs[(arm, lr, setting, seed)][0], 'pretrain')
            # batch_same_scene rebuilt from the checkpoints of a run made before it was logged
            with in_root():
                log = with_batch_scenes(log, pre_dir)
            key = sweep_key(lr if lr is not None else base.optimizer.lr, setting)
            sweep.setdefault(arm, {}).setdefault(key, {})[seed] = summary_row(log, retrieval, probe)
        # The arms in the order asked for, each arm's settings by rate then grid order and its seeds
        # ascending, whichever order the runs finished or were reused in (the record and its sweep table
        # read in order).
        sweep = {arm: {key: dict(sorted(sweep[arm][key].items()))
                       for key in sorted(sweep[arm], key=lambda key, arm=arm: sweep_order(arm, key))}
                 for arm in args.arms}
        merged_from = {arm: merged_from[arm] for arm in args.arms if arm in merged_from}
        text, record = report(sweep, args.seeds)
        print(text)
        record = {'sweep': {arm: {setting_label(k): rows for k, rows in by_key.items()}
                            for arm, by_key in sweep.items()},
                  **record, 'seeds': args.seeds, 'corpus': args.corpus, 'epochs': epochs,
                  'overrides': overrides,
                  **({'merged_from': {'files': args.merge, 'rows': merged_from}} if merged_from else {}),
                  **({'reference': reference} if reference else {}),
                  'protocol': 'each arm at the learning rate of best mean val R@1 (re-ranked); test reported'}
        # The shipped one may be absent from a copy: no column then.
        default_costs = os.path.join(ROOT, STRATEGY_BENCH)
        costs = (read_costs(os.path.abspath(args.costs)) if args.costs
                 else read_costs(default_costs) if os.path.isfile(default_costs) else None)
        with in_root():  # the arms' configs are read where their relative paths point
            table = (markdown_table(record, costs) + '\nThe sweep (selected in bold):\n\n'
                     + sweep_table(record))
        read = [f'{arm} {label} seeds {", ".join(map(str, seeds))}'
                for arm, by_label in merged_from.items() for label, seeds in by_label.items()]
        table += merge_note(args.merge, read)
        return emit_record(record, output_dir, args.record, table)


if __name__ == '__main__':
    run_main(main)
