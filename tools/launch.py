"""Starting the task scripts and tools from a tool (compare, ablate, demo.py): `python -m Pretrain ...` in a
child process, whatever the working directory the tool was started from.

A command is [module, *args], e.g. ['Retrieval', '--config', CONFIG, '--evaluate', ...] or
['tools.probe', ...]. A child runs `python -m module` with this interpreter, the repository root as its
working directory (the shipped configs name repository-relative paths, as ALBEF's do) and first on its
PYTHONPATH. Before that, the paths a user gives on the command line (PATH_FLAGS: --config,
--output_dir, --checkpoint, ...) are made absolute against the caller's working directory, so that they
mean what the user meant. `--set` values are config values: a relative path there is the repository
root's, as in a config file. The tools that launch do their own work in the repository root as well
(in_root), so that a config's relative paths mean the same in the tool and in its children.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence

__all__ = ["PATH_FLAGS", "ROOT", "absolute_paths", "child_env", "in_root", "launch", "python_command", "run",
           "run_side_by_side", "shown"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The flags of the scripts and tools whose value is a path (each also spelled with hyphens).
PATH_FLAGS = ("--config", "--output_dir", "--checkpoint", "--resume", "--probe_file", "--captions")
_PATH_FLAGS = {spelling for flag in PATH_FLAGS for spelling in (flag, flag.replace("_", "-"))}


def absolute_paths(args: Sequence[str], cwd: str | None = None) -> list[str]:
    """args with the value of every PATH_FLAGS flag (`--flag value` or `--flag=value`, either spelling)
    made absolute against cwd (default: the working directory); a bare `--resume` stays as it is."""
    base = os.getcwd() if cwd is None else cwd
    out, expect_path = [], False
    for arg in args:
        if expect_path and not arg.startswith("-"):
            arg = os.path.join(base, arg)
        elif "=" in arg and arg.split("=", 1)[0] in _PATH_FLAGS:
            flag, value = arg.split("=", 1)
            arg = f"{flag}={os.path.join(base, value)}"
        expect_path = arg in _PATH_FLAGS
        out.append(arg)
    return out


def child_env(threads: int | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with the repository root first on PYTHONPATH, and
    OMP_NUM_THREADS=threads when given."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [out.get("PYTHONPATH")])])
    if threads is not None:
        out["OMP_NUM_THREADS"] = str(threads)
    return out


def python_command(command: Sequence[str]) -> list[str]:
    """[module, *args] -> [this python, '-m', module, *args with absolute PATH_FLAGS values]."""
    module, *args = command
    return [sys.executable, "-m", module, *absolute_paths(args)]


def shown(command: Sequence[str]) -> str:
    """The command as a user would type it from the repository root: `python -m module args...`."""
    return shlex.join(["python", "-m", *command])


def launch(command: Sequence[str], *, stdout=None, threads: int | None = None) -> subprocess.Popen:
    """Start [module, *args] as a child in the repository root (python_command, child_env); stdout: where
    its output goes (None: the console; stderr goes along)."""
    return subprocess.Popen(python_command(command), cwd=ROOT, env=child_env(threads), stdout=stdout,
                            stderr=None if stdout is None else subprocess.STDOUT)


def run(command: Sequence[str], threads: int | None = None) -> None:
    """Run [module, *args] in the foreground, its output on the console (threads: its OMP_NUM_THREADS;
    None: the environment's); CalledProcessError if it fails."""
    print("$ " + shown(command), flush=True)
    code = launch(command, threads=threads).wait()
    if code:
        raise subprocess.CalledProcessError(code, python_command(command))


def run_side_by_side(jobs: Sequence[tuple[Sequence[str], str]], threads: int | None = None) -> None:
    """Run the (command, log file) jobs at once, the CPU cores split between them (threads: each job's
    OMP_NUM_THREADS instead, also for a single job); CalledProcessError if one fails (after all have
    ended, each failure's log tail printed).

    Independent runs are faster side by side than one after another on a small CPU: a tiny step
    gains little from a second intra-op thread (on 2 cores, about 320 samples/s for two one-thread
    runs against 175 for one two-thread run). Each job's output goes to its log file; a single job runs
    in the foreground (run), its output on the console.
    """
    if len(jobs) == 1:
        return run(jobs[0][0], threads)
    threads = threads or max(1, (os.cpu_count() or 1) // len(jobs))
    procs = []
    for command, log in jobs:
        print(f"$ {shown(command)}  > {log}", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        with open(log, "w", encoding="utf-8") as out:
            procs.append(launch(command, stdout=out, threads=threads))
    failed = [(command, log, code) for (command, log), p in zip(jobs, procs) if (code := p.wait())]
    for command, log, code in failed:
        with open(log, encoding="utf-8") as f:
            tail = f.read()[-3000:]
        print(f"{shown(command)} failed (exit {code}); the end of {log}:\n{tail}", file=sys.stderr)
    if failed:
        raise subprocess.CalledProcessError(failed[0][2], python_command(failed[0][0]))


@contextlib.contextmanager
def in_root() -> Iterator[None]:
    """The block runs with the repository root as working directory (where a config's relative paths
    point, as in the children), then the caller's is restored."""
    previous = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(previous)
