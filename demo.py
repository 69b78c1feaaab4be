"""`make demo`: tiny GRIT-VLP pre-training on the built-in synthetic data (the paper's M/N = 15) and, side
by side, the same run with random batches (CPU, under 5 minutes), each at the learning rate tools.compare
selected for it on val (tools.arms.SELECTED_LR), then, for both, zero-shot retrieval (ITM re-ranked and
ITC only) and the compositional ITM probe, printed side by side with their per-epoch hardness and ITM
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
from tools.arms import ARMS, SELECTED_LR
from tools.compare_summary import side_by_side
from tools.downstream import (
    DOWNSTREAM_PRETRAIN_CONFIG,
    downstream_summary,
    pretrain_for_downstream,
    run_downstream,
)
from tools.launch import in_root
from tools.runs import last_checkpoint, lr_overrides, prepare_pretraining, run_pairs, slug
from training.cli import Parser, run_main

COLUMNS = ('epoch', *ALBEF_Base.paper_losses, 'hardness', 'train_seconds')


def table(rows: list[dict], columns: tuple[str, ...]) -> str:
    """A plain-text table of the given columns."""
    head = '  '.join(f'{c:>13}' for c in columns)
    body = ['  '.join(f'{r.get(c, float("nan")):>13.4f}' if c != 'epoch' else f'{r[c]:>13d}'
                      for c in columns) for r in rows]
    return '\n'.join([head, *body])


def build_parser() -> Parser:
    """The demo's command line."""
    parser = Parser(prog='python demo.py', description=' '.join(__doc__.split('\n\n')[0].split()))
    parser.add_argument('--output_dir', default='output/demo',
                        help='folder of the runs: grit_vlp/{pretrain,zeroshot}/, random_batches/..., '
                             '(default: output/demo)')
    parser.add_argument('--seed', type=int, default=None,
                        help="the tiny config's seed for both runs (default: the config's)")
    parser.add_argument('--no_compare', dest='compare', action='store_false',
                        help='skip the second pre-training with batching.strategy=random')
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
    print('\nlearning rates (selected on val, tools.arms.SELECTED_LR): '
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
          f'and a GRIT batch {os.path.relpath(os.path.join(pictures, f"epoch_{last:02d}_grouped.png"))} '
          '(each image\'s hardest in-batch negative caption in red)')
    print(f'demo time:  {time.time() - start:.0f} s')


if __name__ == '__main__':
    run_main(main)
