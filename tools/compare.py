"""GRIT-VLP against random batches, per seed: tiny pre-training, zero-shot retrieval and the ITM probe.

    python -m tools.compare --seeds 1 2 3 [--output_dir output/compare] [--set key=value ...]

For each seed it pre-trains configs/tiny/Pretrain.yaml twice (GRIT batches, and grit.enabled=false),
evaluates both last checkpoints zero-shot with Retrieval.py --evaluate (configs/tiny/Retrieval.yaml) and
with tools.probe, and prints one row per seed and run (final loss_itm, grit_hardness, text/image/mean
R@1, probe overall and per kind), then a JSON object with every number. The two pre-trainings of a
seed run side by side, one thread each (run_side_by_side); about 4 minutes per seed on a 2-core CPU.
`make demo` runs one seed of this.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RUNS = {'GRIT-VLP': [], 'random batches': ['--set', 'grit.enabled=false']}
PRETRAIN_CONFIG = 'configs/tiny/Pretrain.yaml'
SUFFIX = {'GRIT-VLP': '', 'random batches': '_random_batches'}


def run(cmd: list[str]) -> None:
    """Run one of the task scripts with this interpreter; stop the demo if it fails."""
    print('$ ' + ' '.join(cmd), flush=True)
    subprocess.run([sys.executable, *cmd], check=True)


def run_side_by_side(jobs: list[tuple[list[str], str]]) -> None:
    """Run the (command, log file) jobs at once, the CPU cores split between them; stop if one fails.

    Independent runs are faster side by side than one after another on a small CPU: a tiny step
    gains little from a second intra-op thread (on 2 cores, about 320 samples/s for two one-thread
    runs against 175 for one two-thread run). Each job's output goes to its log file; a single job runs in the
    foreground (run), its output on the console.
    """
    if len(jobs) == 1:
        return run(jobs[0][0])
    threads = max(1, (os.cpu_count() or 1) // len(jobs))
    env = {**os.environ, 'OMP_NUM_THREADS': str(threads)}
    procs = []
    for cmd, log in jobs:
        print(f'$ {" ".join(cmd)}  > {log}', flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        with open(log, 'w', encoding='utf-8') as out:
            procs.append(subprocess.Popen([sys.executable, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                          env=env))
    failed = [(cmd, log, code) for (cmd, log), p in zip(jobs, procs) if (code := p.wait())]
    for cmd, log, code in failed:
        with open(log, encoding='utf-8') as f:
            tail = f.read()[-3000:]
        print(f'{" ".join(cmd)} failed (exit {code}); the end of {log}:\n{tail}', file=sys.stderr)
    if failed:
        raise subprocess.CalledProcessError(failed[0][2], failed[0][0])


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


def prepare_pretraining(overrides: list[str] = ()) -> None:
    """Generate, once and before the runs start side by side, what the tiny pre-training generates on
    first use: the synthetic data and, with `vision_init: synthetic`, its pre-trained ViT."""
    from dataset import prepare_data
    from models.vit import SYNTHETIC
    from models.vit_synthetic import ensure_synthetic_vit
    from training.config import load_config

    config = dict(load_config(PRETRAIN_CONFIG, list(overrides)))
    prepare_data(config)
    if config.get('vision_init') == SYNTHETIC:
        ensure_synthetic_vit(config)


def pretrain_command(output_dir: str, args: list[str], config: str = PRETRAIN_CONFIG) -> list[str]:
    """The command of a tiny pre-training into a fresh output_dir with extra command-line args."""
    return ['Pretrain.py', '--config', config, '--output_dir', fresh(output_dir), *args]


def overrides_for(task: str, overrides: list[str]) -> list[str]:
    """The KEY=VALUE overrides whose key `task`'s config accepts (training.schema), as --set arguments.

    The evaluations must build the model the pre-training built (e.g. `--set vision_stem=conv`), while
    pre-training-only keys (grit.*, max_epoch schedules) would be rejected by Retrieval.py's config.
    """
    from training import schema

    known = schema.keys(task)
    kept = [o for o in overrides if o.split('=', 1)[0] in known]
    return ['--set', *kept] if kept else []


def last_checkpoint(pre_dir: str) -> str:
    """The checkpoint of the last epoch that a pre-training run's log.txt records."""
    rows = read_log(os.path.join(pre_dir, 'log.txt'))
    return os.path.join(pre_dir, f'checkpoint_{rows[-1]["epoch"]:02d}.pth')


def evaluation_commands(checkpoint: str, out_dir: str, overrides: list[str] = ()) -> list[list[str]]:
    """Zero-shot Retrieval.py --evaluate into out_dir, then tools.probe into out_dir/probe.json (the
    pre-training's overrides that shape the model go to both)."""
    return [['Retrieval.py', '--config', 'configs/tiny/Retrieval.yaml', '--checkpoint', checkpoint,
             '--evaluate', '--output_dir', fresh(out_dir), *overrides_for('retrieval', list(overrides))],
            ['-m', 'tools.probe', '--config', PRETRAIN_CONFIG, '--checkpoint', checkpoint,
             '--output', os.path.join(out_dir, 'probe.json'), *overrides_for('pretrain', list(overrides))]]


def read_evaluation(out_dir: str) -> tuple[dict, dict]:
    """The retrieval record (with test_mean_r1 added) and the probe result written into out_dir."""
    retrieval = read_log(os.path.join(out_dir, 'log.txt'))[-1]
    retrieval['test_mean_r1'] = (retrieval['test_txt_r1'] + retrieval['test_img_r1']) / 2
    with open(os.path.join(out_dir, 'probe.json'), encoding='utf-8') as f:
        return retrieval, json.load(f)


def side_by_side(runs: dict[str, tuple[list[dict], dict, dict]]) -> str:
    """GRIT-VLP and random batches side by side: hardness and ITM loss per epoch, zero-shot R@1, probe."""
    names = list(runs)
    head = f'{"":>22}' + ''.join(f'{n:>16}' for n in names)
    lines = ['grit_hardness = mean ITC similarity of the hardest in-batch ITM negative (epoch 0 is random'
             ' in both)', head]
    for e, _ in enumerate(runs[names[0]][0]):
        for key in ('grit_hardness', 'loss_itm'):
            lines.append(f'{f"epoch {e} {key}":>22}' + ''.join(f'{runs[n][0][e][key]:>16.4f}' for n in names))
    lines += ['', 'zero-shot retrieval, synthetic test split (1,000 images; chance R@1 0.1 %)', head]
    for key, label in (('test_txt_r1', 'text R@1'), ('test_img_r1', 'image R@1'),
                       ('test_mean_r1', 'mean R@1'), ('test_r_mean', 'r_mean')):
        lines.append(f'{label:>22}' + ''.join(f'{runs[n][1][key]:>16.2f}' for n in names))
    lines += ['', 'compositional ITM probe: true caption vs one thing changed (chance 0.5)', head]
    kinds = list(runs[names[0]][2]['per_kind'])
    for kind in kinds:
        accuracies = (runs[n][2]['per_kind'][kind]['accuracy'] for n in names)
        lines.append(f'{kind:>22}' + ''.join(f'{a:>16.4f}' for a in accuracies))
    lines.append(f'{"overall":>22}' + ''.join(f'{runs[n][2]["overall"]:>16.4f}' for n in names))
    return '\n'.join(lines)


def compare_seed(output_dir: str, seed: int | None, overrides: list[str],
                 names: tuple[str, ...] = tuple(RUNS)) -> dict[str, tuple]:
    """The named pre-trainings of one seed, then their evaluations: {run name: (log rows, retrieval, probe)}.

    Outputs: output_dir/pretrain (GRIT), pretrain_random_batches, zeroshot, zeroshot_random_batches,
    each with the run's console output in stdout.txt. The runs of one stage go side by side.
    """
    seed_args = ['--seed', str(seed)] if seed is not None else []
    dirs, jobs = {}, []
    for name, extra in RUNS.items():
        if name not in names:
            continue
        set_args = extra[1:] + overrides
        dirs[name] = os.path.join(output_dir, 'pretrain' + SUFFIX[name])
        jobs.append((pretrain_command(dirs[name], seed_args + (['--set', *set_args] if set_args else [])),
                     os.path.join(dirs[name], 'stdout.txt')))
    run_side_by_side(jobs)
    evals = {name: os.path.join(output_dir, 'zeroshot' + SUFFIX[name]) for name in dirs}
    commands = {name: evaluation_commands(last_checkpoint(dirs[name]), evals[name], overrides)
                for name in dirs}
    for stage in range(2):  # retrieval of every run side by side, then the probes
        run_side_by_side([(commands[name][stage], os.path.join(evals[name], f'stdout_{stage}.txt'))
                          for name in dirs])
    return {name: (read_log(os.path.join(dirs[name], 'log.txt')), *read_evaluation(evals[name]))
            for name in dirs}


def summary_row(rows: list[dict], retrieval: dict, probe_result: dict) -> dict:
    """The numbers of one run that the per-seed table shows."""
    return {'loss_itm': rows[-1]['loss_itm'], 'grit_hardness': rows[-1]['grit_hardness'],
            'txt_r1': retrieval['test_txt_r1'], 'img_r1': retrieval['test_img_r1'],
            'mean_r1': retrieval['test_mean_r1'], 'r_mean': retrieval['test_r_mean'],
            'probe': probe_result['overall'],
            **{f'probe_{k}': v['accuracy'] for k, v in probe_result['per_kind'].items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--seeds', type=int, nargs='+', required=True)
    parser.add_argument('--output_dir', default='output/compare')
    parser.add_argument('--set', dest='overrides', nargs='*', default=[], metavar='KEY=VALUE',
                        help='config overrides for both pre-trainings of every seed')
    args = parser.parse_args(argv)
    prepare_pretraining(args.overrides)
    result = {}
    for seed in args.seeds:
        runs = compare_seed(os.path.join(args.output_dir, f'seed{seed}'), seed, args.overrides)
        result[seed] = {name: summary_row(*r) for name, r in runs.items()}
    columns = ['loss_itm', 'grit_hardness', 'txt_r1', 'img_r1', 'mean_r1', 'r_mean', 'probe']
    kinds = [k for k in next(iter(result[args.seeds[0]].values())) if k.startswith('probe_')]
    columns += kinds
    print(f'{"seed":>5} {"batches":>15}' + ''.join(f'{c:>14}' for c in columns))
    for seed, runs in result.items():
        for name, row in runs.items():
            print(f'{seed:>5} {name:>15}' + ''.join(f'{row[c]:>14.4f}' for c in columns))
    print(json.dumps({'seeds': result, 'overrides': args.overrides}))
    return result


if __name__ == '__main__':
    main()
