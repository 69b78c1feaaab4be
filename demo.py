"""`make demo`: tiny GRIT-VLP pre-training on the built-in synthetic data (CPU, a few minutes), then
zero-shot retrieval with the pre-trained checkpoint, and a per-epoch table of losses and GRIT hardness.

    python demo.py [--output_dir output/demo] [--no-compare]

By default it also pre-trains once more with grit.enabled=false (random batches) and prints both runs'
grit_hardness side by side; --no-compare skips that run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from dataset import ensure_synthetic

COLUMNS = ('epoch', 'loss_itc', 'loss_cons', 'loss_itm', 'loss_mlm', 'grit_hardness', 'seconds')


def run(cmd: list[str]) -> None:
    """Run one of the task scripts with this interpreter; stop the demo if it fails."""
    print('$ ' + ' '.join(cmd), flush=True)
    subprocess.run([sys.executable, *cmd], check=True)


def read_log(path: str) -> list[dict]:
    """The JSON lines of a log.txt."""
    with open(path, encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]


def table(rows: list[dict], columns: tuple[str, ...]) -> str:
    """A plain-text table of the given columns."""
    head = '  '.join(f'{c:>13}' for c in columns)
    body = ['  '.join(f'{r.get(c, float("nan")):>13.4f}' if c != 'epoch' else f'{r[c]:>13d}'
                      for c in columns) for r in rows]
    return '\n'.join([head, *body])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--output_dir', default='output/demo')
    parser.add_argument('--no-compare', dest='compare', action='store_false',
                        help='skip the second pre-training with grit.enabled=false')
    args = parser.parse_args()
    start = time.time()
    ensure_synthetic('data/synthetic')

    pre_dir = os.path.join(args.output_dir, 'pretrain')
    for name in ('log.txt', 'latest.json'):  # a fresh run each time, not a resume
        if os.path.exists(os.path.join(pre_dir, name)):
            os.remove(os.path.join(pre_dir, name))
    run(['Pretrain.py', '--config', 'configs/tiny/Pretrain.yaml', '--output_dir', pre_dir])
    rows = read_log(os.path.join(pre_dir, 'log.txt'))
    checkpoint = os.path.join(pre_dir, f'checkpoint_{rows[-1]["epoch"]:02d}.pth')

    ret_dir = os.path.join(args.output_dir, 'retrieval_zeroshot')
    retrieval = None
    if os.path.isfile('Retrieval.py'):
        if os.path.exists(os.path.join(ret_dir, 'log.txt')):
            os.remove(os.path.join(ret_dir, 'log.txt'))
        run(['Retrieval.py', '--config', 'configs/tiny/Retrieval.yaml', '--checkpoint', checkpoint,
             '--evaluate', '--output_dir', ret_dir])
        retrieval = read_log(os.path.join(ret_dir, 'log.txt'))[-1]

    baseline = None
    if args.compare:
        base_dir = os.path.join(args.output_dir, 'pretrain_random_batches')
        if os.path.exists(os.path.join(base_dir, 'log.txt')):
            os.remove(os.path.join(base_dir, 'log.txt'))
        run(['Pretrain.py', '--config', 'configs/tiny/Pretrain.yaml', '--output_dir', base_dir,
             '--set', 'grit.enabled=false'])
        baseline = read_log(os.path.join(base_dir, 'log.txt'))

    print('\n=== GRIT-VLP tiny pre-training (synthetic data, CPU) ===')
    print(table(rows, COLUMNS))
    if baseline:
        print('\ngrit_hardness = mean ITC similarity of the hardest in-batch ITM negative')
        print(f'{"epoch":>5}  {"GRIT batches":>13}  {"random batches":>14}')
        for g, b in zip(rows, baseline):
            print(f'{g["epoch"]:>5}  {g["grit_hardness"]:>13.4f}  {b["grit_hardness"]:>14.4f}')
    if retrieval:
        keys = [k for k in retrieval if k.startswith('test_')]
        print('\nzero-shot retrieval on the synthetic test split: '
              + '  '.join(f'{k[5:]} {retrieval[k]:.2f}' for k in keys))
    print(f'\ncheckpoint: {checkpoint}\nlog:        {os.path.join(pre_dir, "log.txt")}')
    if retrieval:
        print(f'retrieval:  {os.path.join(ret_dir, "log.txt")}')
    print(f'demo time:  {time.time() - start:.0f} s')


if __name__ == '__main__':
    main()
