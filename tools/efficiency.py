"""The paper's efficiency claim in miniature: zero-shot R@1 against epochs and against wall-clock seconds for
ALBEF_Base, ALBEF_Base50 and GRIT-VLP (or any of tools.arms' arms), per seed, and after how many epochs
each arm reaches ALBEF_Base's final recall.

    python -m tools.efficiency --seeds 1 2 3 [--output_dir output/compare] [--epochs 1 2 4 ...] [--micro]
        [--arms ALBEF_Base GRIT-VLP B3 ...] [--timing EPOCHS] [--merge EFFICIENCY_JSON ...] [--corpus real]

The arms are tools.arms' (ARMS): ALBEF_Base (random batches, 15 % masking, no consistency loss),
ALBEF_Base50 (the same with 50 % masking) and GRIT-VLP (the tiny config: 50 % masking, GRIT at M/N = 15,
consistency loss 0.2), each pre-trained with configs/tiny/Pretrain.yaml for its 12 epochs. GRIT-VLP runs
at its learning rate selected on val (tools.arms.SELECTED_LR); the two ALBEF arms, random-batch arms
like tools.compare's, at the random-batch arm's (a choice: they were not swept separately); every other arm
at its selected rate and grid setting (tools.arms.SELECTED_LR, SELECTED_SETTING). The runs are
tools.compare's, in its folders, so with the same --output_dir a finished compare run is reused. Every
epoch's checkpoint (or those --epochs names, 1-based) is evaluated zero-shot on the test split (ITM
re-ranked and ITC only); wall-clock is the sum of the log's epoch_seconds (GRIT's work included) up to
that epoch, with the runs two side by side on one thread each, and, since seconds vary with the machine's
load, the time in epochs of training steps: the epochs plus the strategy's work over the run's median
step time per epoch (time_epochs; the step is the same for every arm). --timing E also measures each arm's
per-epoch seconds side by side with ALBEF_Base's: fresh E-epoch pre-trainings of both at once, one thread
each, into <output_dir>/timing/ (run it on an otherwise idle machine; a pair timed before with the same
commands is read from its result.json); the tables' and the figure's seconds are then each point's epochs
at its arm's measured per-epoch time (ALBEF_Base's times the arm's ratio to it), which compare across arms
as the logged seconds do not.

Compute to the target (issue 51): every point also carries the executed FLOPs of the run so far: each
epoch's logged steps times the batch (one process: the runs' batch_size) times the FLOPs per sample of
that epoch's step, counted once per arm as tools.step_bench counts them
(tools.step_measure.step_flops_per_sample: forward + backward of the arm's model at random weights on a
synthetic batch at max_tokens; with image_token_drop the masked step until the unmasked epochs). GRIT's and
the other strategies' own work is not in the FLOPs (it is in the seconds). With --timing, an arm that drops
image tokens has its masked and its unmasked epochs timed apart (--timing must leave it a masked epoch
after the first). The reach then gives each arm's FLOPs and seconds to ALBEF_Base's final recall as ratios
to ALBEF_Base's run up to its last evaluated epoch, same seed, and efficiency.md a table of those ratios
(mean ± sample std over the seeds that reached it).

Written into --output_dir: efficiency.json (every point), efficiency.md (mean ± sample std per epoch,
and the epochs, seconds and compute to reach ALBEF_Base's final R@1 per seed), efficiency.png (2 x 2:
re-ranked and ITC-only R@1 against epochs and against seconds; mean over seeds with a band of ± one std).
--micro runs the pipeline in about two minutes (tools.ablate's micro preset: 100 images, 2 epochs).
--corpus real runs the same on tools.make_real's corpora (tools.runs.CORPORA: configs/real/, 6 epochs, the
real corpora's selections, tools.arms.SELECTED_LR_REAL), evaluated on their test split.
--merge reads curves and timed pairs from earlier efficiency.json records instead of running them (arms
measured in parts, or kept after their run folders are gone): an asked arm's curve of a seed, and its timing
with --timing of the same epoch count, are taken as they are when the file ran that arm at the same rate and
setting, the same --epochs and --micro; the record names what came from where (merged_from).
--record NAME names the files written (default efficiency: NAME.json, NAME.md, NAME.png); a second command
writing the same record into the same folder is refused at its start (tools.cli.record_claim).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
from collections.abc import Mapping, Sequence

from tools.ablate import PRESETS, ensure_micro_data
from tools.arms import ARMS, arm_overrides, selection
from tools.cli import add_record_name, emit_record, record_claim, tool_parser
from tools.efficiency_tables import (
    BASELINE,
    compute_intervals,
    compute_table,
    curves_table,
    epochs_to_reach,
    plot,
    timing_table,
)
from tools.launch import in_root, run_side_by_side
from tools.records import merge_note, merged_curves
from tools.runs import (
    CORPORA,
    PRETRAIN_CONFIG,
    Corpus,
    evaluation_commands,
    fresh,
    prepare_pretraining,
    pretrain_command,
    read_log,
    read_retrieval,
    run_dir,
    run_pairs,
    saved_result,
    slug,
)
from tools.step_measure import step_flops_per_sample
from training.cli import Parser, run_main
from training.config import PretrainConfig
from training.config_resolve import resolve_config

__all__ = ["ALBEF_RATE_OF", "EFFICIENCY_ARMS", "add_timed_seconds", "arm_run", "build_parser", "curves_table",
           "epoch_flops", "epoch_timing", "epochs_to_reach", "evaluate_epochs", "main", "plot", "point",
           "time_beside_baseline", "timing_table", "zeroshot_dir"]

EFFICIENCY_ARMS = ('ALBEF_Base', 'ALBEF_Base50', 'GRIT-VLP')
# The ALBEF arms are random-batch arms that were not swept apart: each runs at this arm's selected rate.
ALBEF_RATE_OF = {'ALBEF_Base': 'random batches', 'ALBEF_Base50': 'random batches'}


def arm_run(arm: str, corpus: str = 'synthetic') -> tuple[float, str | None]:
    """An arm's learning rate and grid setting on `corpus`: an ALBEF arm's that of ALBEF_RATE_OF, any other's
    its own selection on val (tools.arms.selection)."""
    if arm in ALBEF_RATE_OF:
        return selection(ALBEF_RATE_OF[arm], corpus)[0], None
    return selection(arm, corpus)


def zeroshot_dir(directory: str, e: int, last: int) -> str:
    """Where a run's epoch e (0-based) is evaluated: zeroshot/ for its last epoch (tools.compare's),
    zeroshot_eEE/ for the others."""
    return os.path.join(directory, 'zeroshot' if e == last else f'zeroshot_e{e:02d}')


def evaluate_epochs(directory: str, epochs: Sequence[int], last: int, sets: Sequence[str],
                    eval_sets: Sequence[str], corpus: Corpus = CORPORA['synthetic']) -> list[list[str]]:
    """The `Retrieval --evaluate` commands of a run's epochs (0-based) not yet evaluated."""
    commands = []
    for e in epochs:
        out = zeroshot_dir(directory, e, last)
        log = os.path.join(out, 'log.txt')
        if os.path.isfile(log) and any('test_txt_r1' in r for r in read_log(log)):
            continue
        checkpoint = os.path.join(directory, 'pretrain', f'checkpoint_{e:02d}.pth')
        # the retrieval of val and test only: no further test split, no probe
        commands.append(evaluation_commands(checkpoint, out, sets, eval_sets, corpus)[0])
    return commands


def epoch_flops(config: PretrainConfig) -> list[float]:
    """Executed FLOPs per sample of each epoch's step of a pre-training (step_flops_per_sample): with
    image_token_drop, the masked step until the unmasked epochs, then the full one."""
    full = step_flops_per_sample(dataclasses.replace(config, image_token_drop=0.0, unmasked_epochs=0))
    masked = step_flops_per_sample(config) if config.image_token_drop else full
    masked_epochs = config.max_epoch - config.unmasked_epochs
    return [masked if e < masked_epochs else full for e in range(config.max_epoch)]


def point(directory: str, e: int, log: list[dict], flops: Sequence[float] | None = None,
          batch_size: int | None = None) -> dict:
    """One curve point: epoch (1-based), cumulative seconds and epochs of time, test R@1 re-ranked and ITC
    only; with each epoch's FLOPs per sample (epoch_flops) and the batch of the (one-process) run, the
    executed FLOPs so far
    (each epoch's logged steps times its step's count)."""
    record = read_retrieval(zeroshot_dir(directory, e, log[-1]['epoch']))
    # Seconds depend on how busy the shared machine was that hour (runs of one arm differ by 2x here), so
    # the time is also given in epochs of training steps: the epochs plus the strategy's own work
    # (sampler_seconds) over the run's median step time per epoch, a ratio within one run. The step is the
    # same model and batch for every arm but one that drops image tokens, whose cheaper epochs this counts
    # as whole ones: its compute is in the FLOPs and the timed seconds.
    step = statistics.median(r['epoch_seconds'] - r.get('sampler_seconds', 0.0) for r in log)
    work = sum(r.get('sampler_seconds', 0.0) for r in log[:e + 1])
    found = {'epoch': e + 1, 'seconds': sum(r['epoch_seconds'] for r in log[:e + 1]),
             'time_epochs': e + 1 + work / step,
             'mean_r1': record['test_mean_r1'], 'itc_mean_r1': record['test_itc_mean_r1']}
    if flops is not None and batch_size is not None:
        steps = [r['step'] - (log[i - 1]['step'] if i else 0) for i, r in enumerate(log[:e + 1])]
        found['flops'] = sum(n * batch_size * f for n, f in zip(steps, flops))
    return found


def epoch_timing(base_log: list[dict], arm_log: list[dict], masked_epochs: int | None = None) -> dict:
    """Per-epoch seconds of an arm's run and of the ALBEF_Base run timed beside it: medians over the epochs
    after the first (which also builds the data and warms up), their ratio, the arm's strategy seconds.
    masked_epochs (an arm with image_token_drop and unmasked epochs): the ratio is its masked epochs' (after
    the first), and unmasked_ratio that of its unmasked epochs, whose step is the full one."""
    def median(log: list[dict], key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in log)

    base = median(base_log[1:], 'epoch_seconds')
    arm = median(arm_log[1:] if masked_epochs is None else arm_log[1:masked_epochs], 'epoch_seconds')
    found = {'epoch_seconds': arm, 'albef_base_epoch_seconds': base, 'ratio': arm / base,
             'sampler_seconds': median(arm_log[1:], 'sampler_seconds')}
    if masked_epochs is not None and masked_epochs < len(arm_log):
        found['unmasked_ratio'] = median(arm_log[masked_epochs:], 'epoch_seconds') / base
    return found


def add_timed_seconds(curves: dict[str, dict[int, list[dict]]], timing: dict[str, dict],
                      masked_epochs: Mapping[str, int] | None = None) -> None:
    """Give every point `timed_seconds`: the sum over its epochs of its arm's per-epoch seconds from the
    side-by-side timing (--timing): ALBEF_Base's epoch (the median of its runs beside the arms) times the
    arm's ratio to the ALBEF_Base run beside it. The ratio, not the arm's own seconds: the machine's load
    moved between the pairs (ALBEF_Base's epoch took 30 to 36 s across them). Unlike the logged seconds,
    these compare across arms. masked_epochs: an arm's epochs that drop image tokens (the rest, its unmasked
    epochs, at its unmasked_ratio)."""
    base = statistics.median(t['albef_base_epoch_seconds'] for t in timing.values())
    masked_epochs = masked_epochs or {}
    for arm, per_seed in curves.items():
        t = timing.get(arm, {'ratio': 1.0})  # ALBEF_Base: its own epoch
        masked = masked_epochs.get(arm) if 'unmasked_ratio' in t else None
        for curve in per_seed.values():
            for p in curve:
                epochs = p['epoch'] if masked is None else min(p['epoch'], masked)
                unmasked = (p['epoch'] - epochs) * t.get('unmasked_ratio', 0.0)
                p['timed_seconds'] = base * (epochs * t['ratio'] + unmasked)


def time_beside_baseline(runs: dict[str, tuple[float, str | None]], output_dir: str, epochs: int,
                         base_sets: Sequence[str], config: str = PRETRAIN_CONFIG) -> dict[str, dict]:
    """Each arm's per-epoch time measured side by side with ALBEF_Base's: a fresh `epochs`-epoch pre-training
    of both (seed 1, one thread each, the same config as their curves' runs but for the epoch count) into
    output_dir/timing/<arm>/, on a machine nothing else uses; a pair already timed with the same commands
    (its result.json, tools.runs.saved_result) is read, not run again. Returns {arm: epoch_timing}."""
    timing = {}
    for arm in [a for a in runs if a != BASELINE]:
        pair = []
        for a in (BASELINE, arm):
            lr, setting = runs[a]
            sets = arm_overrides(a, lr, setting, config) + list(base_sets) + [f'max_epoch={epochs}',
                                                                              f'schedular.epochs={epochs}']
            directory = os.path.join(output_dir, 'timing', slug(arm), slug(a))
            command = pretrain_command(directory, ['--seed', '1', '--set', *sets], config, clear=False)
            pair.append((command, directory))
        # One record for the pair, reused as tools.compare reuses a run: its two commands joined.
        pair_dir, both = os.path.join(output_dir, 'timing', slug(arm)), pair[0][0] + pair[1][0]
        saved = saved_result(pair_dir, both)
        if saved:
            timing[arm] = saved['timing']
            continue
        # The arm's (last) sets: with image-token dropout its masked and unmasked epochs are timed apart.
        resolved = resolve_config('pretrain', config, sets, check_paths=False)
        masked = resolved.max_epoch - resolved.unmasked_epochs if resolved.image_token_drop else None
        if masked is not None and masked < 2:
            raise ValueError(f'--timing {epochs}: {arm} drops image tokens in {masked} of those epochs, none '
                             'after the first; time more epochs')
        for _, d in pair:
            fresh(d)
        run_side_by_side([(c, os.path.join(d, 'stdout.txt')) for c, d in pair], threads=1)
        base_log, arm_log = (read_log(os.path.join(d, 'log.txt')) for _, d in pair)
        timing[arm] = epoch_timing(base_log, arm_log, masked)
        with open(os.path.join(pair_dir, 'result.json'), 'w', encoding='utf-8') as f:
            json.dump({'command': both, 'timing': timing[arm]}, f)
    return timing


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser('tools.efficiency', __doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, nargs='+', required=True, help='pre-training seeds of every arm')
    p.add_argument('--epochs', type=int, nargs='+', default=None,
                   help='the epochs (1-based) to evaluate (default: every epoch)')
    p.add_argument('--output_dir', default='output/compare',
                   help='folder of the runs (tools.compare\'s layout: a compare run there is reused) and of '
                        'efficiency.{json,md,png} (default: output/compare)')
    p.add_argument('--arms', nargs='+', choices=list(ARMS), default=list(EFFICIENCY_ARMS),
                   help='the arms (default: ALBEF_Base, ALBEF_Base50, GRIT-VLP); an arm other than the ALBEF '
                        'ones runs at its selection (tools.arms.SELECTED_LR, SELECTED_SETTING)')
    p.add_argument('--timing', type=int, default=0, metavar='EPOCHS',
                   help=f'also time each arm\'s epochs side by side with {BASELINE}\'s: fresh EPOCHS-epoch '
                        'pre-trainings of both, one thread each, on an otherwise idle machine (default: 0, '
                        'none)')
    p.add_argument('--corpus', choices=list(CORPORA), default='synthetic',
                   help='what the runs pre-train on and are evaluated on (tools.runs.CORPORA; real: '
                        'python -m tools.make_real first; default: synthetic)')
    p.add_argument('--micro', action='store_true',
                   help='tools.ablate\'s micro preset: 100 images, 2 epochs, evaluated on the same 100')
    p.add_argument('--merge', nargs='+', default=[], metavar='EFFICIENCY_JSON',
                   help='earlier efficiency.json records: the curves (and --timing pairs of as many epochs) '
                        'of the arms they ran at the same rate, setting, --epochs and --micro are read from '
                        'them, not run; the record names them (merged_from)')
    add_record_name(p, 'efficiency')
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Pre-train (or reuse) each arm and seed, evaluate its epochs, write the table and the figure."""
    parser = build_parser()
    args = parser.parse_args(argv)
    output_dir = os.path.abspath(args.output_dir)
    with contextlib.ExitStack() as claim:  # the record claimed once the arguments and --merge are checked
        micro = PRESETS['micro']
        base_sets = list(micro.pretrain_set) if args.micro else []
        eval_sets = list(micro.retrieval_set) if args.micro else []
        if args.timing and (args.timing < 2 or BASELINE not in args.arms):
            parser.error(f'--timing needs at least 2 epochs and {BASELINE} in --arms (timed beside each arm)')
        if args.micro and args.corpus != 'synthetic':
            parser.error('--micro is a preset of the synthetic world: drop it or --corpus')
        corpus = CORPORA[args.corpus]
        with in_root():
            prepare_pretraining(base_sets, corpus.pretrain)
            if args.micro:
                ensure_micro_data()
            max_epoch = resolve_config('pretrain', corpus.pretrain, base_sets, check_paths=False).max_epoch
            epochs = sorted({e - 1 for e in args.epochs}) if args.epochs else list(range(max_epoch))
            if epochs[0] < 0 or epochs[-1] >= max_epoch:
                parser.error(f'--epochs must lie in 1..{max_epoch} (the pre-training\'s max_epoch)')
            try:
                runs = {arm: arm_run(arm, args.corpus) for arm in args.arms}
            except ValueError as e:
                parser.error(f'--arms: {e}')
            if BASELINE not in runs:
                print(f'tools.efficiency: without {BASELINE} in --arms there is no final recall to reach; '
                      'only the curves are written', flush=True)
            merged, merged_timing = merged_curves([os.path.abspath(m) for m in args.merge], runs,
                                                  [e + 1 for e in epochs], args.micro, args.timing,
                                                  args.corpus)
            spec = {}
            for seed in args.seeds:
                for arm, (lr, setting) in runs.items():
                    if (arm, seed) in merged:
                        continue
                    sets = arm_overrides(arm, lr, setting, corpus.pretrain) + base_sets
                    spec[(arm, seed)] = (run_dir(output_dir, arm, seed, lr, setting),
                                         ['--seed', str(seed), '--set', *sets], [])
            claim.enter_context(record_claim(output_dir, args.record, 'tools.efficiency'))
            probe_args = ['--limit', str(micro.limit)] if args.micro else []
            if spec:
                run_pairs(spec, reuse=True, eval_overrides=eval_sets, probe_args=probe_args, corpus=corpus)
            commands = [(c, os.path.join(c[c.index('--output_dir') + 1], 'stdout.txt'))
                        for d, _, sets in spec.values()
                        for c in evaluate_epochs(d, epochs, max_epoch - 1, sets, eval_sets, corpus)]
            for start in range(0, len(commands), 2):
                run_side_by_side(commands[start:start + 2])
            # Each arm's step counted once (its model on a synthetic batch): the FLOPs its epochs execute.
            configs = {arm: resolve_config('pretrain', corpus.pretrain,
                                           arm_overrides(arm, lr, setting, corpus.pretrain) + base_sets,
                                           check_paths=False)
                       for arm, (lr, setting) in runs.items()}
            flops = {arm: epoch_flops(config) for arm, config in configs.items()}
            timing = {}
            if args.timing:
                to_time = {a: r for a, r in runs.items() if a not in merged_timing}
                timed = time_beside_baseline(to_time, output_dir, args.timing, base_sets, corpus.pretrain)
                timing = {a: merged_timing[a] if a in merged_timing else timed[a]
                          for a in runs if a != BASELINE}
        curves: dict[str, dict[int, list[dict]]] = {}
        for arm in runs:
            for seed in args.seeds:
                if (arm, seed) in merged:
                    curves.setdefault(arm, {})[seed] = merged[(arm, seed)]
                    continue
                directory = spec[(arm, seed)][0]
                log = read_log(os.path.join(directory, 'pretrain', 'log.txt'))
                curves.setdefault(arm, {})[seed] = [
                    point(directory, e, log, flops[arm], configs[arm].batch_size) for e in epochs]
        merged_from = {'files': args.merge,
                       'curves': {a: [s for s in args.seeds if (a, s) in merged] for a in runs
                                  if any((a, s) in merged for s in args.seeds)},
                       'timing': [a for a in timing if a in merged_timing]} if args.merge else {}
        # With --timing the seconds are the side-by-side ones: the logged seconds of runs made hours apart
        # on a shared machine differ 2x for one arm.
        clock = 'timed_seconds' if timing else 'seconds'
        if timing:
            masked = {arm: c.max_epoch - c.unmasked_epochs for arm, c in configs.items()
                      if c.image_token_drop}
            add_timed_seconds(curves, timing, masked)
        text, reach = curves_table(curves, args.seeds, clock)
        if reach:
            text += '\n' + compute_table(reach, clock)
        if timing:
            text += '\n' + timing_table(timing, args.timing)
        curves_read = '; '.join(f'{a} seeds {", ".join(map(str, ss))}'
                                for a, ss in merged_from.get('curves', {}).items())
        read = [f'the curves of {curves_read}'] if curves_read else []
        read += [f'the timing of {", ".join(merged_from["timing"])}'] if merged_from.get('timing') else []
        text += merge_note(args.merge, read)
        figure = plot(curves, args.seeds, os.path.join(output_dir, f'{args.record}.png'), clock,
                      corpus.title)
        print(text)
        print(f'written: {output_dir}/{args.record}.md, {figure}, {output_dir}/{args.record}.json')
        record = {'seeds': args.seeds, 'corpus': args.corpus,
                  'learning_rates': {a: lr for a, (lr, _) in runs.items()},
                  'settings': {a: st for a, (_, st) in runs.items() if st}, 'micro': args.micro,
                  'curves': {arm: {str(s): c for s, c in per.items()} for arm, per in curves.items()},
                  'reach_albef_base_final': {k: {a: {str(s): v for s, v in per.items()}
                                                 for a, per in r.items()} for k, r in reach.items()},
                  'compute_to_target': compute_intervals(reach),
                  'timing': timing, 'timing_epochs': args.timing, 'clock': clock,
                  'flops_per_sample': {arm: f for arm, f in flops.items()},
                  **({'merged_from': merged_from} if merged_from else {})}
        return emit_record(record, output_dir, args.record, text)


if __name__ == '__main__':
    run_main(main)
