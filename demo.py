"""`make demo`: tiny GRIT-VLP pre-training on the built-in synthetic data (CPU, a few minutes), then
zero-shot retrieval with the pre-trained checkpoint, and a per-epoch table of losses and GRIT hardness.

    python demo.py [--output_dir output/demo] [--no-compare] [--downstream]

By default it also pre-trains once more with grit.enabled=false (random batches) and prints both runs'
grit_hardness side by side; --no-compare skips that run. --downstream also runs NLVR2 (text
assignment + fine-tune) and VQA from the checkpoint (about 6 minutes more) and prints their accuracies.
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


def fresh(output_dir: str) -> str:
    """Drop an earlier run's log.txt and latest.json in output_dir (a fresh run each time, not a resume)."""
    for name in ('log.txt', 'latest.json'):
        if os.path.exists(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
    return output_dir


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


def run_downstream(output_dir: str, checkpoint: str) -> dict:
    """NLVR2 stage 1 + 2 and VQA from the pre-training checkpoint; returns their accuracies."""
    ta_dir = fresh(os.path.join(output_dir, 'nlvr_pretrain'))
    run(['NLVR.py', '--config', 'configs/tiny/NLVR_pretrain.yaml', '--checkpoint', checkpoint,
         '--output_dir', ta_dir])
    ta = read_log(os.path.join(ta_dir, 'log.txt'))[-1]
    nlvr_dir = fresh(os.path.join(output_dir, 'nlvr'))
    run(['NLVR.py', '--config', 'configs/tiny/NLVR.yaml', '--output_dir', nlvr_dir,
         '--checkpoint', os.path.join(ta_dir, f'checkpoint_{ta["epoch"]:02d}.pth')])
    nlvr_log = read_log(os.path.join(nlvr_dir, 'log.txt'))
    best = nlvr_log[nlvr_log[-1]['best_epoch']]
    vqa_dir = fresh(os.path.join(output_dir, 'vqa'))
    run(['VQA.py', '--config', 'configs/tiny/VQA.yaml', '--checkpoint', checkpoint, '--output_dir', vqa_dir])
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
        f'{r["vqa_majority"]:.4f}); answers in {r["vqa_results"]}',
    ])


def majority_baseline(config_path: str = 'configs/tiny/VQA.yaml') -> float:
    """VQA accuracy on the config's test split of always giving its most frequent training answer."""
    from dataset import load_json_list
    from models.vqa import majority_answer_accuracy
    from utils import load_config

    config = load_config(config_path)
    gts = {e['question_id']: e['answer'] for e in load_json_list(config['test_file'])}
    return majority_answer_accuracy([e['answer'] for e in load_json_list(config['train_file'])], gts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--output_dir', default='output/demo')
    parser.add_argument('--no-compare', dest='compare', action='store_false',
                        help='skip the second pre-training with grit.enabled=false')
    # Opt-in: it would more than double the demo's time, and the tiny NLVR2 fine-tune beats chance only
    # by a small margin (README, "NLVR2 on the synthetic data").
    parser.add_argument('--downstream', action='store_true',
                        help='also run NLVR2 (text assignment + fine-tune) and VQA from the checkpoint')
    args = parser.parse_args()
    start = time.time()
    ensure_synthetic('data/synthetic')

    pre_dir = fresh(os.path.join(args.output_dir, 'pretrain'))
    run(['Pretrain.py', '--config', 'configs/tiny/Pretrain.yaml', '--output_dir', pre_dir])
    rows = read_log(os.path.join(pre_dir, 'log.txt'))
    checkpoint = os.path.join(pre_dir, f'checkpoint_{rows[-1]["epoch"]:02d}.pth')

    ret_dir = fresh(os.path.join(args.output_dir, 'retrieval_zeroshot'))
    retrieval = None
    if os.path.isfile('Retrieval.py'):
        run(['Retrieval.py', '--config', 'configs/tiny/Retrieval.yaml', '--checkpoint', checkpoint,
             '--evaluate', '--output_dir', ret_dir])
        retrieval = read_log(os.path.join(ret_dir, 'log.txt'))[-1]

    baseline = None
    if args.compare:
        base_dir = fresh(os.path.join(args.output_dir, 'pretrain_random_batches'))
        run(['Pretrain.py', '--config', 'configs/tiny/Pretrain.yaml', '--output_dir', base_dir,
             '--set', 'grit.enabled=false'])
        baseline = read_log(os.path.join(base_dir, 'log.txt'))

    downstream = run_downstream(args.output_dir, checkpoint) if args.downstream else None

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
    if downstream:
        print('\n' + downstream_summary(downstream))
    print(f'\ncheckpoint: {checkpoint}\nlog:        {os.path.join(pre_dir, "log.txt")}')
    if retrieval:
        print(f'retrieval:  {os.path.join(ret_dir, "log.txt")}')
    print(f'demo time:  {time.time() - start:.0f} s')


if __name__ == '__main__':
    main()
