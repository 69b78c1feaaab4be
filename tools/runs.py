"""The tiny runs the comparison tools make (tools.compare, tools.efficiency, tools.downstream, tools.ablate,
the demo): their commands, folders, reuse and results.

A run is a tiny pre-training (a corpus's pre-training config, configs/tiny/Pretrain.yaml for the synthetic
world, with --set overrides) in <output_dir>/seed<S>/<arm>_lr<lr>[_<setting>]/pretrain/, evaluated zero-shot
into .../zeroshot/ with `python -m Retrieval --evaluate` (the corpus's retrieval config: val and test, ITM
re-ranked and by the ITC cosine alone; each further test split of the corpus into .../zeroshot/<name>/)
and, on the synthetic world, tools.probe, its record in .../result.json. run_pairs runs them two side
by side, one thread each (tools.launch.run_side_by_side), and with reuse keeps a run whose result.json
records the same pre-training command (the code is not compared: reuse within one checkout; the folder
is not compared either, so a run folder copied elsewhere is still that run).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from grit_io import InputFileError, read_json
from tools.launch import run_side_by_side
from training.config_files import split_override
from training.config_resolve import known_keys, new_spelling, resolve_config
from training.logger import current_names

__all__ = ["COMPARISON_EPOCHS", "CORPORA", "PRETRAIN_CONFIG", "RETRIEVAL_CONFIG", "Corpus", "check_schedule",
           "comparison_epochs", "evaluation_commands", "fresh", "last_checkpoint",
           "lr_overrides", "overrides_for", "prepare_pretraining", "pretrain_command", "read_evaluation",
           "read_log", "read_retrieval", "reading_schedule", "run_dir", "run_pairs", "saved_result", "slug"]

# Repository-relative, as the shipped configs' own paths: the tools and their children work in the root.
PRETRAIN_CONFIG = 'configs/tiny/Pretrain.yaml'
RETRIEVAL_CONFIG = 'configs/tiny/Retrieval.yaml'


@dataclass(frozen=True)
class Corpus:
    """What a comparison pre-trains on and how its runs are evaluated, zero-shot: the pre-training config,
    the retrieval config of val (what selects) and test, further test splits (name, a retrieval config
    whose test_file is that split), whether the synthetic world's compositional ITM probe applies, the
    comparison's schedule in epochs (tools.compare --epochs' default; None: the config's own), and what
    the corpus is called in a figure's title."""

    pretrain: str
    retrieval: str
    tests: tuple[tuple[str, str], ...] = ()
    probe: bool = True
    epochs: int | None = None
    title: str = 'the synthetic world'


# The synthetic comparison trains 24 epochs, twice the tiny config's 12 (issue 49): at 12 the seed std of the
# GRIT-VLP-vs-B3 gap was 2.8 points, at 24 it is 0.78 on ten seeds (docs/batch-construction.md). The config
# stays at 12, the paper-like short budget the demo, tools.efficiency and tools.ablate train.
COMPARISON_EPOCHS = 24

CORPORA = {'synthetic': Corpus(PRETRAIN_CONFIG, RETRIEVAL_CONFIG, epochs=COMPARISON_EPOCHS),
           # tools.make_real's corpora: held-out concepts (val, test) and the held-out artist
           'real': Corpus('configs/real/Pretrain.yaml', 'configs/real/Retrieval.yaml',
                          (('artist', 'configs/real/Retrieval_artist.yaml'),), probe=False,
                          title='the real corpora (tools.make_real)')}


def fresh(output_dir: str) -> str:
    """Drop an earlier run's log.txt and latest.json in output_dir (a fresh run each time, not a resume)."""
    for name in ('log.txt', 'latest.json'):
        if os.path.exists(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
    return output_dir


def comparison_epochs(corpus: str) -> int:
    """The epochs tools.compare trains by default on `corpus` (CORPORA): its Corpus.epochs, else its
    pre-training config's own. Call it in the repository root (the config's relative path)."""
    own = CORPORA[corpus].epochs
    return own if own is not None else resolve_config('pretrain', CORPORA[corpus].pretrain, [],
                                                      check_paths=False).max_epoch


def reading_schedule(epochs: int | None, lrs: Sequence[float] | None, corpus: str = 'synthetic'
                     ) -> tuple[int, int | None]:
    """For a tool that reads tools.compare's runs: (the schedule whose selections it reads: `epochs`
    (--epochs), else tools.compare's default on `corpus`; the epochs every run read must have trained, for
    check_schedule: the same, or None where --lrs names the runs and --epochs is not given). ValueError for
    epochs below 1. Call it in the repository root (comparison_epochs)."""
    if epochs is not None and epochs < 1:
        raise ValueError(f'--epochs {epochs}: at least 1')
    chosen = epochs if epochs is not None else comparison_epochs(corpus)
    return chosen, (None if lrs and epochs is None else chosen)


def check_schedule(directory: str, epochs: int | None) -> None:
    """InputFileError naming directory/result.json when that run trained other than `epochs` epochs (None: no
    check): a reader that takes an arm's run at the selection of one schedule must not read another's, whose
    folder is the same when the rates agree."""
    path = os.path.join(directory, 'result.json')
    if epochs is None or not os.path.isfile(path):
        return
    trained = len(read_json(path, 'run result').get('log') or [])
    if trained != epochs:
        raise InputFileError(f'{path}: the run trained {trained} epochs, not the {epochs} whose selections '
                             f'are read (--epochs {trained} reads that schedule\'s, --lrs names the rates)')


def read_log(path: str) -> list[dict]:
    """The JSON lines of a log.txt; InputFileError naming the file and line of one that is not JSON."""
    rows = []
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(current_names(json.loads(line)))
                except json.JSONDecodeError as e:
                    raise InputFileError(f'{path}, line {n}: not a JSON record ({e.msg})') from None
    return rows


def prepare_pretraining(overrides: Sequence[str] = (), config: str = PRETRAIN_CONFIG) -> None:
    """Generate, once and before the runs start side by side, what the tiny pre-training generates on
    first use: the synthetic data and, with `vision_init: synthetic`, its pre-trained ViT; then check that
    the config's data files exist (a real corpus is built by its converter, tools.make_real)."""
    from training.inputs import prepare_inputs

    # Its data is what is being made here: the paths need not exist yet.
    prepare_inputs(resolve_config('pretrain', config, list(overrides), check_paths=False))
    resolve_config('pretrain', config, list(overrides))  # ConfigError naming a missing file


def pretrain_command(output_dir: str, args: Sequence[str], config: str = PRETRAIN_CONFIG,
                     clear: bool = True) -> list[str]:
    """The command (tools.launch) of a tiny pre-training into output_dir with extra arguments; clear: drop
    an earlier run's log there first (fresh), so that the command starts a new run."""
    return ['Pretrain', '--config', config, '--output_dir', fresh(output_dir) if clear else output_dir, *args]


def lr_overrides(lr: float, config: str = PRETRAIN_CONFIG) -> list[str]:
    """KEY=VALUE overrides setting the peak learning rate to lr, the schedule's floor (min_lr) and warm-up
    start (warmup_lr) scaled with it (the tiny config: lr/10 both)."""
    schedule = resolve_config('pretrain', config, check_paths=False).schedular
    scale = lr / schedule.lr
    return [f'optimizer.lr={lr!r}', f'schedular.lr={lr!r}', f'schedular.min_lr={schedule.min_lr * scale!r}',
            f'schedular.warmup_lr={schedule.warmup_lr * scale!r}']


def overrides_for(task: str, overrides: Sequence[str]) -> list[str]:
    """The KEY=VALUE overrides whose key `task`'s config accepts (training.config), as --set arguments.

    The evaluations must build the model the pre-training built (e.g. `--set vision_stem=conv`), while
    pre-training-only keys (grit.*) would be rejected by the retrieval config.
    """
    known = known_keys(task)
    kept = [new_spelling(o) for o in overrides]
    kept = [o for o in kept if o.split('=', 1)[0] in known]
    return ['--set', *kept] if kept else []


def last_checkpoint(pre_dir: str) -> str:
    """The checkpoint of the last epoch that a pre-training run's log.txt records."""
    rows = read_log(os.path.join(pre_dir, 'log.txt'))
    return os.path.join(pre_dir, f'checkpoint_{rows[-1]["epoch"]:02d}.pth')


def evaluation_commands(checkpoint: str, out_dir: str, overrides: Sequence[str] = (),
                        eval_overrides: Sequence[str] = (), corpus: Corpus = CORPORA['synthetic']
                        ) -> list[list[str]]:
    """Zero-shot `Retrieval --evaluate` into out_dir, each further test split of the corpus into
    out_dir/<name>, then (where it applies) tools.probe into out_dir/probe.json; the pre-training's
    overrides that shape the model go to all, eval_overrides to the retrievals only."""
    sets = overrides_for('retrieval', [*overrides, *eval_overrides])
    commands = [['Retrieval', '--config', corpus.retrieval, '--checkpoint', checkpoint, '--evaluate',
                 '--output_dir', fresh(out_dir), *sets]]
    for name, config in corpus.tests:
        commands.append(['Retrieval', '--config', config, '--checkpoint', checkpoint, '--evaluate',
                         '--output_dir', fresh(os.path.join(out_dir, name)), *sets])
    if corpus.probe:
        commands.append(['tools.probe', '--config', corpus.pretrain, '--checkpoint', checkpoint,
                         '--output_dir', out_dir, *overrides_for('pretrain', overrides)])
    return commands


def _add_mean_r1(retrieval: dict, splits: Sequence[str]) -> dict:
    """{split}_{,itc_}mean_r1: text and image R@1 averaged, for each split."""
    for split in splits:
        for scoring in ('', 'itc_'):
            prefix = f'{split}_{scoring}'
            retrieval[f'{prefix}mean_r1'] = (retrieval[f'{prefix}txt_r1'] + retrieval[f'{prefix}img_r1']) / 2
    return retrieval


def read_retrieval(out_dir: str) -> dict:
    """The last retrieval record in out_dir/log.txt, with {val,test}_{,itc_}mean_r1 added (text and image
    R@1 averaged)."""
    return _add_mean_r1(read_log(os.path.join(out_dir, 'log.txt'))[-1], ('val', 'test'))


def read_evaluation(out_dir: str, corpus: Corpus = CORPORA['synthetic']) -> tuple[dict, dict]:
    """The retrieval record (read_retrieval), with each further test split's figures under its name
    ('artist_txt_r1', ...), and the probe result ({} where the probe does not apply) written into out_dir."""
    retrieval = read_retrieval(out_dir)
    for name, _ in corpus.tests:
        more = read_log(os.path.join(out_dir, name, 'log.txt'))[-1]
        retrieval.update({f'{name}_{k[len("test_"):]}': v for k, v in more.items() if k.startswith('test_')})
    _add_mean_r1(retrieval, [name for name, _ in corpus.tests])
    probe = read_json(os.path.join(out_dir, 'probe.json'), 'probe result') if corpus.probe else {}
    return retrieval, probe


def slug(arm: str) -> str:
    """An arm's name as a folder name: 'GRIT-VLP M/N=96' -> 'grit_vlp_m_n_96'."""
    return re.sub(r'[^a-z0-9]+', '_', arm.lower()).strip('_')


def run_dir(output_dir: str, arm: str, seed: int, lr: float | None, setting: str | None = None) -> str:
    """The folder of one run: output_dir/seed<S>/<slug(arm)>[_lr<lr>][_<slug(setting)>] (pretrain/,
    zeroshot/ inside)."""
    return os.path.join(output_dir, f'seed{seed}', slug(arm) + (f'_lr{lr:g}' if lr is not None else '')
                        + (f'_{slug(setting)}' if setting else ''))


def _placeless(command: Sequence[str]) -> list[str]:
    """A command without its output folder (--output_dir X, --output-dir X or either with =X): where a
    run's folder is, not what the run was; --set items in the batching block's spelling (new_spelling), so
    that a run made with `grit.enabled=false` is the run `batching.strategy=random` asks for, and in key
    order when no key repeats: the config applies distinct keys alike in any order, so an arm's own key
    (`GRIT-VLP long warm-up`) and the same key given by --set are one run."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg in ('--output_dir', '--output-dir'):
            out.append('--output_dir')
            skip = True
        elif arg.startswith(('--output_dir=', '--output-dir=')):
            out.append('--output_dir')
        else:
            out.append(new_spelling(arg))
    # Every --set group: its items run up to the first argument that is not key=value (the next option,
    # or the next command's program where a record joins two commands, as tools.efficiency's pairs do).
    for start in [k + 1 for k, arg in enumerate(out) if arg == '--set']:
        end = next((k for k in range(start, len(out)) if out[k].startswith('-') or '=' not in out[k]),
                   len(out))
        items = out[start:end]
        if len({split_override(item)[0] for item in items}) == len(items):
            out[start:end] = sorted(items)
    return out


def saved_result(directory: str, command: list[str]) -> dict | None:
    """directory/result.json when it records `command` (a finished run to reuse), else None. The folder the
    command wrote into is not compared: a run folder moved or copied elsewhere is still that run."""
    path = os.path.join(directory, 'result.json')
    if os.path.isfile(path):
        saved = read_json(path, 'run result')
        if _placeless(saved.get('command') or []) == _placeless(command):
            return saved
    return None


def run_pairs(runs: dict[Hashable, tuple[str, list[str], list[str]]], reuse: bool = False,
              eval_overrides: Sequence[str] = (), probe_args: Sequence[str] = (),
              corpus: Corpus = CORPORA['synthetic']) -> dict[Hashable, tuple[list[dict], dict, dict]]:
    """Pre-train and evaluate runs {name: (folder, pre-training arguments, the evaluations' overrides)}, two
    side by side;
    returns {name: (log rows, retrieval record, probe result)}; each folder gets result.json.
    eval_overrides (KEY=VALUE) go to the zero-shot retrieval only (e.g. another test_file), probe_args to
    tools.probe (e.g. --limit 40).

    reuse: a run whose result.json records the same pre-training command is read, not run again. Call it
    in the repository root (main does, tools.launch.in_root): the configs' relative paths are read there.
    """
    out: dict[str, tuple[list[dict], dict, dict]] = {}
    todo = []
    for name, (directory, args, overrides) in runs.items():
        # Built without clearing: a reused run keeps its log.txt (tools.efficiency reads its epochs).
        command = pretrain_command(os.path.join(directory, 'pretrain'), args, corpus.pretrain, clear=False)
        saved = saved_result(directory, command) if reuse else None
        if saved:
            out[name] = ([current_names(r) for r in saved['log']], saved['retrieval'], saved['probe'])
        else:
            fresh(os.path.join(directory, 'pretrain'))
            todo.append((name, directory, command, overrides))
    for start in range(0, len(todo), 2):
        pair = todo[start:start + 2]
        run_side_by_side([(command, os.path.join(d, 'pretrain', 'stdout.txt')) for _, d, command, _ in pair])
        commands = [evaluation_commands(last_checkpoint(os.path.join(d, 'pretrain')),
                                        os.path.join(d, 'zeroshot'), sets, eval_overrides, corpus)
                    for _, d, _, sets in pair]
        for c in commands:
            if corpus.probe:
                c[-1] += list(probe_args)
        for stage in range(len(commands[0])):  # each evaluation of both runs side by side
            run_side_by_side([(c[stage], os.path.join(d, 'zeroshot', f'stdout_{stage}.txt'))
                              for c, (_, d, _, _) in zip(commands, pair)])
        for name, directory, command, _ in pair:
            log = read_log(os.path.join(directory, 'pretrain', 'log.txt'))
            retrieval, probe = read_evaluation(os.path.join(directory, 'zeroshot'), corpus)
            with open(os.path.join(directory, 'result.json'), 'w', encoding='utf-8') as f:
                json.dump({'command': command, 'log': log, 'retrieval': retrieval, 'probe': probe}, f)
            out[name] = (log, retrieval, probe)
    return out
