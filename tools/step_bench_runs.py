"""tools.step_bench's runs: each variant in a fresh Python (its own peak memory, no state carried between
variants), and --baseline's alternation with another checkout of this repository (B A B A ...), best step
time of each side and the speedups."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Sequence

from tools.launch import ROOT, child_env, python_command

__all__ = ["alternate", "spawn_variant"]


def spawn_variant(argv: Sequence[str], variant: str, checkout: str | None = None) -> dict:
    """Run this tool with --one_variant in a fresh Python; its last stdout line is the variant's JSON
    (variant '': --model_flops, ALBEF's step counted only).

    The child keeps this process's working directory (it must read the config as this process does)
    and finds the repository on its PYTHONPATH (tools.launch). checkout: another checkout of this
    repository (--baseline) whose tools.step_bench runs instead, in its root, on its own copy of a config
    that lies inside this repository."""
    flag = ['--one_variant', variant] if variant else ['--model_flops']
    command, env, cwd = python_command(['tools.step_bench', *argv, *flag]), child_env(), None
    if checkout is not None:
        checkout = os.path.abspath(checkout)
        command = command[:1] + [checkout + arg[len(ROOT):] if arg.startswith(ROOT + os.sep) else arg
                                 for arg in command[1:]]  # this interpreter, the checkout's files
        env['PYTHONPATH'] = os.pathsep.join([checkout, env['PYTHONPATH']])
        cwd = checkout
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    tail = (proc.stderr.strip() or proc.stdout.strip())[-800:]
    return {'error': f'subprocess exited with {proc.returncode}: {tail}'}


def alternate(child_argv: list[str], names: list[str], checkout: str, rounds: int,
              opposite: str | None = None) -> tuple[dict[str, dict], dict]:
    """--baseline: each variant `rounds` times in the other checkout and in this one, in turn (B A B A ...),
    each run a fresh subprocess -> (this checkout's best run per variant, the baseline's record: its best
    runs, every run's step seconds on both sides, and speedup = baseline's best step time / this one's).
    opposite: the variant the baseline runs against every one here (None: the same one)."""
    runs: dict[str, dict[str, list[dict]]] = {v: {'baseline': [], 'this': []} for v in names}
    for _ in range(rounds):
        for v in names:
            runs[v]['baseline'].append(spawn_variant(child_argv, opposite or v, checkout))
            runs[v]['this'].append(spawn_variant(child_argv, v))

    def best(records: list[dict]) -> dict:
        timed = [r for r in records if 'step_seconds' in r]
        return min(timed, key=lambda r: r['step_seconds']) if timed else records[-1]

    def seconds(records: list[dict]) -> list[float | None]:
        return [r.get('step_seconds') for r in records]

    mine = {v: {**best(r['this']), 'step_seconds_runs': seconds(r['this'])} for v, r in runs.items()}
    theirs = {v: {**best(r['baseline']), 'step_seconds_runs': seconds(r['baseline'])}
              for v, r in runs.items()}
    commit = subprocess.run(['git', '-C', checkout, 'rev-parse', 'HEAD'], capture_output=True, text=True)
    speedup = {v: theirs[v]['step_seconds'] / mine[v]['step_seconds'] for v in names
               if 'step_seconds' in theirs[v] and 'step_seconds' in mine[v]}
    # Each round's ratio too: on a machine whose speed drifts, the rounds' median is the steadier figure.
    pairs = {v: [b / a for b, a in zip(theirs[v]['step_seconds_runs'], mine[v]['step_seconds_runs'])
                 if a and b] for v in names}
    return mine, {'checkout': os.path.abspath(checkout), 'commit': commit.stdout.strip() or None,
                  'opposite': {v: opposite or v for v in names},
                  'rounds': rounds, 'order': 'baseline, this, per variant, each round',
                  'variants': theirs, 'speedup': speedup, 'speedup_per_round': pairs,
                  'speedup_median': {v: statistics.median(p) for v, p in pairs.items() if p}}
