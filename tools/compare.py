"""GRIT-VLP against random batches, per seed: tiny pre-training, zero-shot retrieval and the ITM probe.

    python -m tools.compare --seeds 1 2 3 [--output_dir output/compare] [--set key=value ...]

For each seed it pre-trains configs/tiny/Pretrain.yaml twice (GRIT batches, and grit.enabled=false),
evaluates both last checkpoints zero-shot with `python -m Retrieval --evaluate` (configs/tiny/Retrieval.yaml)
and with tools.probe, and prints one row per seed and run (final loss_itm, grit_hardness, text/image/mean
R@1, probe overall and per kind), then a JSON object with every number (also written to
<output_dir>/compare.json). The two pre-trainings of a seed run side by side, one thread each
(tools.launch.run_side_by_side); about 4 minutes per seed on a 2-core CPU. `make demo` runs one seed of
this. The scripts run as children in the repository root (tools.launch), so the tool works from any
working directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from files import read_json
from tools.cli import emit_record, tool_parser
from tools.launch import in_root, run_side_by_side
from training.cli import Parser, run_main
from training.config_resolve import known_keys, resolve_config

__all__ = ["PRETRAIN_CONFIG", "RETRIEVAL_CONFIG", "RUNS", "build_parser", "compare_seed",
           "evaluation_commands", "fresh", "last_checkpoint", "main", "overrides_for", "prepare_pretraining",
           "pretrain_command", "read_evaluation", "read_log", "side_by_side", "summary_row"]

RUNS = {'GRIT-VLP': [], 'random batches': ['--set', 'grit.enabled=false']}
# Repository-relative, as the shipped configs' own paths: the tools and their children work in the root.
PRETRAIN_CONFIG = 'configs/tiny/Pretrain.yaml'
RETRIEVAL_CONFIG = 'configs/tiny/Retrieval.yaml'
SUFFIX = {'GRIT-VLP': '', 'random batches': '_random_batches'}


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


def prepare_pretraining(overrides: Sequence[str] = ()) -> None:
    """Generate, once and before the runs start side by side, what the tiny pre-training generates on
    first use: the synthetic data and, with `vision_init: synthetic`, its pre-trained ViT."""
    from training.inputs import prepare_inputs

    # Its data is what is being made here: the paths need not exist yet.
    prepare_inputs(resolve_config('pretrain', PRETRAIN_CONFIG, list(overrides), check_paths=False))


def pretrain_command(output_dir: str, args: Sequence[str], config: str = PRETRAIN_CONFIG) -> list[str]:
    """The command (tools.launch) of a tiny pre-training into a fresh output_dir with extra arguments."""
    return ['Pretrain', '--config', config, '--output_dir', fresh(output_dir), *args]


def overrides_for(task: str, overrides: Sequence[str]) -> list[str]:
    """The KEY=VALUE overrides whose key `task`'s config accepts (training.config), as --set arguments.

    The evaluations must build the model the pre-training built (e.g. `--set vision_stem=conv`), while
    pre-training-only keys (grit.*) would be rejected by the retrieval config.
    """
    known = known_keys(task)
    kept = [o for o in overrides if o.split('=', 1)[0] in known]
    return ['--set', *kept] if kept else []


def last_checkpoint(pre_dir: str) -> str:
    """The checkpoint of the last epoch that a pre-training run's log.txt records."""
    rows = read_log(os.path.join(pre_dir, 'log.txt'))
    return os.path.join(pre_dir, f'checkpoint_{rows[-1]["epoch"]:02d}.pth')


def evaluation_commands(checkpoint: str, out_dir: str, overrides: Sequence[str] = ()) -> list[list[str]]:
    """Zero-shot `Retrieval --evaluate` into out_dir, then tools.probe into out_dir/probe.json (the
    pre-training's overrides that shape the model go to both)."""
    return [['Retrieval', '--config', RETRIEVAL_CONFIG, '--checkpoint', checkpoint, '--evaluate',
             '--output_dir', fresh(out_dir), *overrides_for('retrieval', overrides)],
            ['tools.probe', '--config', PRETRAIN_CONFIG, '--checkpoint', checkpoint, '--output_dir', out_dir,
             *overrides_for('pretrain', overrides)]]


def read_evaluation(out_dir: str) -> tuple[dict, dict]:
    """The retrieval record (with test_mean_r1 added) and the probe result written into out_dir."""
    retrieval = read_log(os.path.join(out_dir, 'log.txt'))[-1]
    retrieval['test_mean_r1'] = (retrieval['test_txt_r1'] + retrieval['test_img_r1']) / 2
    return retrieval, read_json(os.path.join(out_dir, 'probe.json'), 'probe result')


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


def compare_seed(output_dir: str, seed: int | None, overrides: Sequence[str],
                 names: tuple[str, ...] = tuple(RUNS)) -> dict[str, tuple]:
    """The named pre-trainings of one seed, then their evaluations: {run name: (log rows, retrieval, probe)}.

    Outputs: output_dir/pretrain (GRIT), pretrain_random_batches, zeroshot, zeroshot_random_batches,
    each with the run's console output in stdout.txt. The runs of one stage go side by side. Call it in
    the repository root (main does, tools.launch.in_root): the configs' relative paths are read there.
    """
    overrides = list(overrides)
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


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser('tools.compare', __doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, nargs='+', required=True, help='one comparison per seed')
    p.add_argument('--output_dir', default='output/compare',
                   help='folder of the runs (<output_dir>/seed<S>/...) and of compare.json, the printed '
                        'record (default: output/compare)')
    p.add_argument('--set', dest='overrides', nargs='*', action='extend', default=[], metavar='KEY=VALUE',
                   help='config overrides for both pre-trainings of every seed (the evaluations get those '
                        'their config takes)')
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Compare GRIT-VLP and random batches per seed; returns {seed: {run name: summary_row}}."""
    args = build_parser().parse_args(argv)
    output_dir = os.path.abspath(args.output_dir)  # the user's path, from where the user is
    result = {}
    with in_root():
        prepare_pretraining(args.overrides)
        for seed in args.seeds:
            runs = compare_seed(os.path.join(output_dir, f'seed{seed}'), seed, args.overrides)
            result[seed] = {name: summary_row(*r) for name, r in runs.items()}
    columns = ['loss_itm', 'grit_hardness', 'txt_r1', 'img_r1', 'mean_r1', 'r_mean', 'probe']
    kinds = [k for k in next(iter(result[args.seeds[0]].values())) if k.startswith('probe_')]
    columns += kinds
    print(f'{"seed":>5} {"batches":>15}' + ''.join(f'{c:>15}' for c in columns))
    for seed, runs in result.items():
        for name, row in runs.items():
            print(f'{seed:>5} {name:>15}' + ''.join(f'{row[c]:>15.4f}' for c in columns))
    emit_record({'seeds': result, 'overrides': args.overrides}, output_dir, 'compare')
    return result


if __name__ == '__main__':
    run_main(main)
