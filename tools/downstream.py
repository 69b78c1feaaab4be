"""The downstream chain per arm and seed: a 36-epoch pre-training (configs/tiny/Pretrain_long.yaml), then
NLVR2 (text assignment, fine-tune, the best dev epoch) and VQA from its checkpoint, for GRIT-VLP and
random batches, each at its learning rate (and grid setting) selected on val (tools.arms.SELECTED_LR,
SELECTED_SETTING).

    python -m tools.downstream --seeds 1 2 3 [--arms GRIT-VLP "random batches"] \
        [--output_dir output/downstream] [--reuse]

Runs land in <output_dir>/seed<S>/<arm>_lr<lr>/{pretrain_long,nlvr_pretrain,nlvr,vqa}/. The pre-trainings
run two side by side, then the chains, a stage of two chains at a time, every run on one thread (a lone
one too: a CPU's floats depend on the thread count, and the docs' numbers are one-thread runs). --reuse
keeps a pre-training whose log has every epoch and whose result.json records the same command. Prints a
markdown table (per seed: final loss_itm of the pre-training, text-assignment accuracy, NLVR2's best dev
epoch with its dev and test-P accuracy, VQA accuracy and the majority answer's), each arm's gap to random
batches paired by seed (NLVR2 dev, test-P, VQA: mean, 95 % t interval, seeds ahead / behind) and the JSON
record (also <output_dir>/downstream.json, downstream.md). `python demo.py --downstream` runs one chain; `make
test-slow` asserts GRIT-VLP's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tools.arms import SELECTED_LR, arm_overrides, selection
from tools.cli import emit_record, tool_parser
from tools.launch import in_root, run_side_by_side
from tools.runs import (
    fresh,
    last_checkpoint,
    prepare_pretraining,
    pretrain_command,
    read_log,
    run_dir,
    saved_result,
)
from tools.stats import mean_std, paired_interval
from training.cli import Parser, run_main
from training.config_resolve import resolve_config

__all__ = ["DOWNSTREAM_PRETRAIN_CONFIG", "build_parser", "downstream_gaps", "downstream_summary", "main",
           "majority_baseline", "markdown", "pretrain_for_downstream", "run_chains", "run_downstream"]

# The tiny config for 36 epochs, not 12: NLVR2 needs a stronger ITM (docs/synthetic-world.md, 'NLVR2 on the
# synthetic data').
DOWNSTREAM_PRETRAIN_CONFIG = 'configs/tiny/Pretrain_long.yaml'


def pretrain_for_downstream(output_dirs: list[str], seeds: list[int | None],
                            sets: Sequence[Sequence[str]] | None = None, reuse: bool = False,
                            threads: int | None = None) -> list[str]:
    """Pre-train with DOWNSTREAM_PRETRAIN_CONFIG into each output_dir/pretrain_long with its seed and
    --set overrides (default: none, GRIT-VLP), two side by side (threads: each run's threads, a lone run's
    too; None: the cores split); returns their last checkpoints. reuse: keep a run whose result.json
    records the same command and whose log has every epoch. Call it in the repository root (as the tools
    do): the config's relative paths are read there."""
    epochs = resolve_config('pretrain', DOWNSTREAM_PRETRAIN_CONFIG, check_paths=False).max_epoch
    dirs = [os.path.join(d, 'pretrain_long') for d in output_dirs]
    commands = []
    for d, seed, extra in zip(dirs, seeds, sets or [()] * len(dirs)):
        args = (['--seed', str(seed)] if seed is not None else []) + (['--set', *extra] if extra else [])
        commands.append(pretrain_command(d, args, DOWNSTREAM_PRETRAIN_CONFIG, clear=False))
    todo = [(c, d) for c, d in zip(commands, dirs) if not (reuse and saved_result(d, c) and os.path.isfile(
        os.path.join(d, 'log.txt')) and len(read_log(os.path.join(d, 'log.txt'))) == epochs)]
    for start in range(0, len(todo), 2):
        pair = todo[start:start + 2]
        for _, d in pair:
            fresh(d)
        run_side_by_side([(c, os.path.join(d, 'stdout.txt')) for c, d in pair], threads)
        for c, d in pair:
            with open(os.path.join(d, 'result.json'), 'w', encoding='utf-8') as f:
                json.dump({'command': c}, f)
    return [last_checkpoint(d) for d in dirs]


def run_chains(chains: Sequence[tuple[str, str]], threads: int | None = None) -> list[dict]:
    """NLVR2 text assignment and fine-tune and VQA from each (output_dir, pre-training checkpoint); two
    chains at a time, each stage side by side (threads: each run's threads, a lone chain's too; None: the
    cores split, a lone chain on all of them). Returns each chain's accuracies. Call it in the repository
    root."""
    results = []
    majority = majority_baseline()
    for start in range(0, len(chains), 2):
        pair = chains[start:start + 2]
        ta_dirs = [fresh(os.path.join(d, 'nlvr_pretrain')) for d, _ in pair]
        run_side_by_side([(['NLVR', '--config', 'configs/tiny/NLVR_pretrain.yaml', '--checkpoint', c,
                            '--output_dir', t], os.path.join(t, 'stdout.txt'))
                          for (_, c), t in zip(pair, ta_dirs)], threads)
        ta = [read_log(os.path.join(t, 'log.txt'))[-1] for t in ta_dirs]
        nlvr_dirs = [fresh(os.path.join(d, 'nlvr')) for d, _ in pair]
        run_side_by_side([(['NLVR', '--config', 'configs/tiny/NLVR.yaml', '--output_dir', n, '--checkpoint',
                            os.path.join(t, f'checkpoint_{r["epoch"]:02d}.pth')],
                           os.path.join(n, 'stdout.txt'))
                          for t, r, n in zip(ta_dirs, ta, nlvr_dirs)], threads)
        vqa_dirs = [fresh(os.path.join(d, 'vqa')) for d, _ in pair]
        run_side_by_side([(['VQA', '--config', 'configs/tiny/VQA.yaml', '--checkpoint', c,
                            '--output_dir', v], os.path.join(v, 'stdout.txt'))
                          for (_, c), v in zip(pair, vqa_dirs)], threads)
        for r, n, v in zip(ta, nlvr_dirs, vqa_dirs):
            nlvr_log = read_log(os.path.join(n, 'log.txt'))
            best = nlvr_log[nlvr_log[-1]['best_epoch']]
            vqa = read_log(os.path.join(v, 'log.txt'))[-1]
            results.append({'ta_acc': r['train_ta_acc'], 'nlvr_epoch': best['epoch'],
                            'nlvr_dev': best['val_acc'], 'nlvr_test': best['test_acc'],
                            'vqa_test': vqa['test_acc'], 'vqa_majority': majority,
                            'vqa_results': os.path.join(v, 'vqa_result.json')})
    return results


def run_downstream(output_dir: str, checkpoint: str) -> dict:
    """One chain (run_chains) in the foreground: NLVR2 stage 1 + 2 and VQA; returns their accuracies."""
    return run_chains([(output_dir, checkpoint)])[0]


def downstream_summary(r: dict) -> str:
    """The lines the demo prints for a chain's accuracies."""
    return '\n'.join([
        f'NLVR2 text assignment: train accuracy {r["ta_acc"]:.4f} (chance 0.3333)',
        f'NLVR2 fine-tune, best dev epoch {r["nlvr_epoch"]}: dev {r["nlvr_dev"]:.4f}  '
        f'test-P {r["nlvr_test"]:.4f} (chance 0.5)',
        f'VQA: test accuracy {r["vqa_test"]:.4f} (always the most frequent training answer: '
        f'{r["vqa_majority"]:.4f}); answers in {os.path.relpath(r["vqa_results"])}',
    ])


def majority_baseline(config_path: str = 'configs/tiny/VQA.yaml') -> float:
    """VQA accuracy on the config's test split of always giving its most frequent training answer."""
    from dataset import load_json_list
    from models.vqa import majority_answer_accuracy

    config = resolve_config('vqa', config_path, check_paths=False)
    gts = {e['question_id']: e['answer'] for e in load_json_list(config.test_file)}
    return majority_answer_accuracy([e['answer'] for e in load_json_list(config.train_file)], gts)


FIGURES = (('loss_itm', 'final loss_itm'), ('ta_acc', 'TA acc'), ('nlvr_epoch', 'best epoch'),
           ('nlvr_dev', 'NLVR2 dev'), ('nlvr_test', 'NLVR2 test-P'), ('vqa_test', 'VQA'))


GAP_FIGURES = ('nlvr_dev', 'nlvr_test', 'vqa_test')  # the accuracies an arm is compared by
GAP_BASELINE = 'random batches'


def downstream_gaps(rows: dict[str, dict[int, dict]], baseline: str = GAP_BASELINE) -> dict[str, dict]:
    """Each other arm's gap to `baseline` per figure of GAP_FIGURES, paired on the seeds both ran:
    {arm: {figure: {'per_seed', **tools.stats.paired_interval}}}; {} without the baseline."""
    if baseline not in rows:
        return {}
    out = {}
    for arm, per_seed in rows.items():
        seeds = sorted(set(per_seed) & set(rows[baseline]))
        if arm == baseline or not seeds:
            continue
        out[arm] = {}
        for k in GAP_FIGURES:
            gaps = [per_seed[s][k] - rows[baseline][s][k] for s in seeds]
            out[arm][k] = {'seeds': seeds, 'per_seed': gaps, **paired_interval(gaps)}
    return out


def markdown(rows: dict[str, dict[int, dict]]) -> str:
    """{arm: {seed: figures}} as a markdown table, a row per arm and seed, then each arm's mean ± std."""
    lines = ['| arm | seed | ' + ' | '.join(h for _, h in FIGURES) + ' |',
             '|---|---|' + '---|' * len(FIGURES)]
    for arm, per_seed in rows.items():
        for seed, r in per_seed.items():
            lines.append(f'| {arm} | {seed} | ' + ' | '.join(
                str(r[k]) if k == 'nlvr_epoch' else f'{r[k]:.3f}' for k, _ in FIGURES) + ' |')
        if len(per_seed) > 1:
            cells = []
            for k, _ in FIGURES:
                m, sd = mean_std([r[k] for r in per_seed.values()])
                cells.append(f'{m:.1f}' if k == 'nlvr_epoch' else f'{m:.3f} ± {sd:.3f}')
            lines.append(f'| {arm} | mean ± std | ' + ' | '.join(cells) + ' |')
    majority = next(iter(next(iter(rows.values())).values()))['vqa_majority']
    text = '\n'.join(lines) + f'\n\nVQA\'s majority answer scores {majority:.3f}; NLVR2 chance is 0.5.\n'
    gaps = downstream_gaps(rows)
    if gaps:
        labels = dict(FIGURES)
        text += (f'\nGap to {GAP_BASELINE}, paired by seed: mean [95 % t interval], seeds ahead / behind\n\n'
                 '| arm | figure | mean [95 % t] | ahead / behind | per seed |\n|---|---|---|---|---|\n')
        for arm, per_figure in gaps.items():
            for k, g in per_figure.items():
                interval = f'{g["mean"]:+.3f} [{g["low"]:+.3f}, {g["high"]:+.3f}]'
                text += (f'| {arm} | {labels[k]} | {interval} | {g["ahead"]} / {g["behind"]} of {g["n"]} | '
                         + ', '.join(f'{v:+.3f}' for v in g['per_seed']) + ' |\n')
    return text


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser('tools.downstream', __doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, nargs='+', required=True, help='pre-training seeds (each arm)')
    p.add_argument('--arms', nargs='+', choices=list(SELECTED_LR), default=['GRIT-VLP', 'random batches'],
                   help='arms with a selected learning rate (default: GRIT-VLP and random batches)')
    p.add_argument('--output_dir', default='output/downstream',
                   help='folder of the runs and of downstream.{json,md} (default: output/downstream)')
    p.add_argument('--reuse', action='store_true',
                   help='keep the finished pre-trainings whose result.json records the same command')
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Pre-train each arm and seed for 36 epochs, run the chains, print and write the table."""
    args = build_parser().parse_args(argv)
    output_dir = os.path.abspath(args.output_dir)
    keys = [(arm, seed) for arm in args.arms for seed in args.seeds]
    chosen = {arm: selection(arm) for arm in args.arms}
    dirs = [run_dir(output_dir, arm, seed, *chosen[arm]) for arm, seed in keys]
    with in_root():
        prepare_pretraining()
        sets = [arm_overrides(arm, *chosen[arm], DOWNSTREAM_PRETRAIN_CONFIG) for arm, _ in keys]
        # Every run on one thread, a lone one too: the numbers of the docs' table (and make test-slow's).
        checkpoints = pretrain_for_downstream(dirs, [s for _, s in keys], sets, reuse=args.reuse, threads=1)
        results = run_chains(list(zip(dirs, checkpoints)), threads=1)
    rows: dict[str, dict[int, dict]] = {}
    for (arm, seed), d, r in zip(keys, dirs, results):
        pre = read_log(os.path.join(d, 'pretrain_long', 'log.txt'))[-1]
        rows.setdefault(arm, {})[seed] = {**r, 'loss_itm': pre['loss_itm'], 'lr': chosen[arm][0],
                                          'setting': chosen[arm][1]}
    text = markdown(rows)
    print(text)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, 'downstream.md'), 'w', encoding='utf-8') as f:
        f.write(text)
    record = {'seeds': args.seeds, 'config': DOWNSTREAM_PRETRAIN_CONFIG,
              'rows': {arm: {str(s): r for s, r in per.items()} for arm, per in rows.items()},
              'gaps': downstream_gaps(rows)}
    return emit_record(record, output_dir, 'downstream')


if __name__ == '__main__':
    run_main(main)
