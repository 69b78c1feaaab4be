"""`make demo`: tiny GRIT-VLP pre-training on the built-in synthetic data (the paper's M/N = 15) and, side
by side, the same run with random batches (CPU, under 5 minutes), each at the learning rate tools.compare
selected for it on val (tools.compare.SELECTED_LR), then, for both, zero-shot retrieval (ITM re-ranked and
ITC only) and the compositional ITM probe, printed side by side with their per-epoch grit_hardness and ITM
loss. One seed of the README's comparison (`python -m tools.compare`, 3 seeds, the rates swept).

    python demo.py [--output_dir output/demo] [--seed S] [--no_compare] [--downstream]

--no_compare skips the random-batch run. --downstream also pre-trains GRIT-VLP for longer
(configs/tiny/Pretrain_long.yaml, same seed) and runs NLVR2 (text assignment + fine-tune) and VQA from
that checkpoint (about 15 minutes more), then prints their accuracies. The scripts run as children in the
repository root (tools.launch), so the demo works from any working directory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from models.pretrain import ALBEF_Base
from tools.compare import (
    ARMS,
    SELECTED_LR,
    fresh,
    last_checkpoint,
    lr_overrides,
    prepare_pretraining,
    pretrain_command,
    read_log,
    run_pairs,
    side_by_side,
    slug,
)
from tools.launch import in_root, run, run_side_by_side
from training.cli import Parser, run_main

COLUMNS = ('epoch', *ALBEF_Base.loss_names, 'grit_hardness', 'train_seconds')
# The downstream chain's pre-training: the tiny config for 36 epochs, not the demo's 12, as NLVR2 needs a
# stronger ITM (docs/synthetic-world.md, 'NLVR2 on the synthetic data').
DOWNSTREAM_PRETRAIN_CONFIG = 'configs/tiny/Pretrain_long.yaml'


def table(rows: list[dict], columns: tuple[str, ...]) -> str:
    """A plain-text table of the given columns."""
    head = '  '.join(f'{c:>13}' for c in columns)
    body = ['  '.join(f'{r.get(c, float("nan")):>13.4f}' if c != 'epoch' else f'{r[c]:>13d}'
                      for c in columns) for r in rows]
    return '\n'.join([head, *body])


def pretrain_for_downstream(output_dirs: list[str], seeds: list[int | None]) -> list[str]:
    """GRIT pre-training with DOWNSTREAM_PRETRAIN_CONFIG into each output_dir/pretrain_long with its
    seed (the runs side by side); returns their last checkpoints. Call it in the repository root (as main
    does): the config's relative paths are read there."""
    dirs = [os.path.join(d, 'pretrain_long') for d in output_dirs]
    seed_args = [['--seed', str(seed)] if seed is not None else [] for seed in seeds]
    jobs = [(pretrain_command(d, args, DOWNSTREAM_PRETRAIN_CONFIG), os.path.join(d, 'stdout.txt'))
            for d, args in zip(dirs, seed_args)]
    run_side_by_side(jobs)
    return [last_checkpoint(d) for d in dirs]


def run_downstream(output_dir: str, checkpoint: str) -> dict:
    """NLVR2 stage 1 + 2 and VQA from the pre-training checkpoint; returns their accuracies. Call it in
    the repository root (as main does): the configs' relative paths are read there."""
    ta_dir = fresh(os.path.join(output_dir, 'nlvr_pretrain'))
    run(['NLVR', '--config', 'configs/tiny/NLVR_pretrain.yaml', '--checkpoint', checkpoint,
         '--output_dir', ta_dir])
    ta = read_log(os.path.join(ta_dir, 'log.txt'))[-1]
    nlvr_dir = fresh(os.path.join(output_dir, 'nlvr'))
    run(['NLVR', '--config', 'configs/tiny/NLVR.yaml', '--output_dir', nlvr_dir,
         '--checkpoint', os.path.join(ta_dir, f'checkpoint_{ta["epoch"]:02d}.pth')])
    nlvr_log = read_log(os.path.join(nlvr_dir, 'log.txt'))
    best = nlvr_log[nlvr_log[-1]['best_epoch']]
    vqa_dir = fresh(os.path.join(output_dir, 'vqa'))
    run(['VQA', '--config', 'configs/tiny/VQA.yaml', '--checkpoint', checkpoint, '--output_dir', vqa_dir])
    vqa = read_log(os.path.join(vqa_dir, 'log.txt'))[-1]
    return {'ta_acc': ta['train_ta_acc'], 'nlvr_epoch': best['epoch'], 'nlvr_dev': best['val_acc'],
            'nlvr_test': best['test_acc'], 'vqa_test': vqa['test_acc'],
            'vqa_majority': majority_baseline(), 'vqa_results': os.path.join(vqa_dir, 'vqa_result.json')}


def downstream_summary(r: dict) -> str:
    """The lines the demo prints for run_downstream's accuracies."""
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
    from training.config_resolve import resolve_config

    config = resolve_config('vqa', config_path, check_paths=False)
    gts = {e['question_id']: e['answer'] for e in load_json_list(config.test_file)}
    return majority_answer_accuracy([e['answer'] for e in load_json_list(config.train_file)], gts)


def build_parser() -> Parser:
    """The demo's command line."""
    parser = Parser(prog='python demo.py', description=' '.join(__doc__.split('\n\n')[0].split()))
    parser.add_argument('--output_dir', default='output/demo',
                        help='folder of the runs: grit_vlp/{pretrain,zeroshot}/, random_batches/..., '
                             '(default: output/demo)')
    parser.add_argument('--seed', type=int, default=None,
                        help="the tiny config's seed for both runs (default: the config's)")
    parser.add_argument('--no_compare', dest='compare', action='store_false',
                        help='skip the second pre-training with grit.enabled=false')
    # Opt-in: it would quadruple the demo's time (docs/synthetic-world.md, 'NLVR2 on the synthetic data').
    parser.add_argument('--downstream', action='store_true',
                        help=f'also pre-train GRIT-VLP with {DOWNSTREAM_PRETRAIN_CONFIG} and run NLVR2 '
                             '(text assignment + fine-tune) and VQA from that checkpoint')
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Run the demo and print its tables."""
    args = build_parser().parse_args(argv)
    start = time.time()
    output_dir = os.path.abspath(args.output_dir)  # the user's path, from where the user is
    with in_root():
        prepare_pretraining()
        names = ('GRIT-VLP', 'random batches') if args.compare else ('GRIT-VLP',)
        seed_args = ['--seed', str(args.seed)] if args.seed is not None else []
        spec = {}
        for name in names:
            sets = ARMS[name] + lr_overrides(SELECTED_LR[name])
            spec[name] = (os.path.join(output_dir, slug(name)), [*seed_args, '--set', *sets], [])
        runs = run_pairs(spec)
        grit_dir = os.path.join(output_dir, slug('GRIT-VLP'))
        checkpoint = last_checkpoint(os.path.join(grit_dir, 'pretrain'))

        downstream = None
        if args.downstream:
            long_checkpoint = pretrain_for_downstream([output_dir], [args.seed])[0]
            downstream = run_downstream(output_dir, long_checkpoint)

    print('\n=== GRIT-VLP tiny pre-training (synthetic data, CPU) ===')
    print(table(runs['GRIT-VLP'][0], COLUMNS))
    print('\nlearning rates (selected on val, tools.compare.SELECTED_LR): '
          + ', '.join(f'{name} {SELECTED_LR[name]:g}' for name in runs))
    print(side_by_side(runs))
    if downstream:
        print(f'\n=== downstream, from the {DOWNSTREAM_PRETRAIN_CONFIG} checkpoint: '
              f'{os.path.relpath(long_checkpoint)} ===')
        print(downstream_summary(downstream))
    pictures = os.path.join(grit_dir, 'pretrain', 'batches')
    last = runs['GRIT-VLP'][0][-1]['epoch']
    print(f'\ncheckpoint: {os.path.relpath(checkpoint)}\nlogs:       {args.output_dir}/*/pretrain/log.txt, '
          f'{args.output_dir}/*/zeroshot/log.txt, probe.json')
    print(f'batches:    a random batch {os.path.relpath(os.path.join(pictures, "epoch_00_random.png"))} '
          f'and a GRIT batch {os.path.relpath(os.path.join(pictures, f"epoch_{last:02d}_grit.png"))} '
          '(each image\'s hardest in-batch negative caption in red)')
    print(f'demo time:  {time.time() - start:.0f} s')


if __name__ == '__main__':
    run_main(main)
