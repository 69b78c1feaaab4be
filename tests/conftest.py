"""Helpers and fixtures shared by the tests: typed tiny configs, tokenizers, the repo root as working dir."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

try:  # the property tests' profiles; the GPU machine's copy of the suite may run without hypothesis
    from hypothesis import settings
except ImportError:
    pass
else:
    # ci (the default): the same examples every run, no example database written, the falsifying
    # example printed with a blob that reproduces it. dev: fresh examples each run, and more of them.
    settings.register_profile("ci", derandomize=True, database=None, max_examples=40, deadline=None,
                              print_blob=True)
    settings.register_profile("dev", max_examples=400, deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _same_random_state():
    """Every test starts from the same random state, whatever ran before it in its process: pytest-xdist
    deals the files to its workers in another order on every run, so a test drawing from the global
    generators (torch, numpy, random) without its own seed would see other numbers each time."""
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def word_tokenizer(folder, words: list[str]):
    """A BertTokenizerFast over the special tokens and `words`, its vocab.txt written into folder."""
    from transformers import BertTokenizerFast

    path = os.path.join(str(folder), "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(SPECIAL_TOKENS + list(words)) + "\n")
    return BertTokenizerFast(vocab_file=path, do_lower_case=True)


TINY_CONFIGS = {"pretrain": "configs/tiny/Pretrain.yaml", "retrieval": "configs/tiny/Retrieval.yaml",
                "nlvr": "configs/tiny/NLVR.yaml", "vqa": "configs/tiny/VQA.yaml"}


def tiny_config(task: str, path: str | None = None, **values):
    """The typed config (training.config) of configs/tiny/<Task>.yaml, or of `path` (repo-relative), with
    `values` laid over its keys: a dict value merges into a block (batching={"strategy": "random"}). Data
    paths are not checked to exist (nothing is read)."""
    from training.config_files import load_config, to_plain
    from training.config_resolve import config_from_mapping

    path = path or TINY_CONFIGS[task]
    raw = to_plain(dict(load_config(os.path.join(ROOT, path))))
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return from_root(config_from_mapping(task, raw, source=path))


def from_root(config):
    """The typed config with its relative file and folder paths (the keys whose field metadata says
    'path', e.g. bert_config, vocab_file) resolved against the repository: a test that builds a model from
    a tiny config reads the same files from any working directory."""
    import dataclasses

    changes = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            changes[field.name] = from_root(value)
        elif field.metadata.get("path") and value:
            absolute = [p if not p or os.path.isabs(p) else os.path.join(ROOT, p)
                        for p in ([value] if isinstance(value, str) else value)]
            changes[field.name] = absolute[0] if isinstance(value, str) else type(value)(absolute)
    return dataclasses.replace(config, **changes)


def read_latest(output_dir) -> dict:
    """output_dir/latest.json: {'path': the newest checkpoint's file name, 'epoch', 'step'}."""
    with open(os.path.join(str(output_dir), "latest.json"), encoding="utf-8") as f:
        return json.load(f)


def assert_resumed_from(output_dir, latest: dict) -> None:
    """The last start recorded in output_dir/run_record.jsonl resumed from the checkpoint `latest` names
    (read_latest's dict, read before the resume) at its step: a resume from an older checkpoint, or a
    fresh start, fails here even when it ends with the same weights."""
    with open(os.path.join(str(output_dir), "run_record.jsonl"), encoding="utf-8") as f:
        starts = [json.loads(line) for line in f]
    assert len(starts) >= 2 and starts[0]["resumed_from"] is None, starts
    got = starts[-1]["resumed_from"]
    assert got is not None, "the resumed start began afresh"
    assert (os.path.basename(got["path"]), got["step"]) == (latest["path"], latest["step"]), (got, latest)


def run_here(script, argv: list[str]):
    """script.main(argv) in this process, as `python Script.py ...` from the repository runs it
    (as_a_script_runs): no interpreter start-up and imports (~6 s here) per run."""
    with as_a_script_runs():
        return script.main(argv)


def small_pretrain_sets(data: str, **values) -> list[str]:
    """--set KEY=VALUE strings that shrink configs/tiny/Pretrain.yaml for script tests: the synthetic set
    at `data`, 32 px, patch 16, one ViT block, batch 8, no synthetic ViT, no batch pictures (matplotlib
    took half of a tiny run: tests/test_reporting.py draws them); `values` add or replace keys."""
    sets = {"train_file": f"[{data}/pretrain.json]", "image_root": data, "vocab_file": f"{data}/vocab.txt",
            "synthetic_root": "null", "vision_init": "null", "image_res": 32, "patch_size": 16,
            "vision_depth": 1, "batch_size": 8, "batch_pictures": "false"}
    sets.update(values)
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.fixture(scope="module")
def in_repo():
    """Run the module from the repo root with one intra-op thread, the synthetic data generated.

    Configs and the synthetic data use repo-relative paths. One thread: on a busy 2-core machine two
    OpenMP threads per process make these tiny steps 10-30x slower, not faster.
    """
    from dataset import ensure_synthetic

    with as_a_script_runs():
        ensure_synthetic("data/synthetic")
        yield


@contextlib.contextmanager
def as_a_script_runs():
    """The repository as working directory and one intra-op thread, as the script tests run the scripts;
    the working directory, thread count and torch's deterministic flag (the scripts set it from their
    configs) restored afterwards."""
    cwd, threads = os.getcwd(), torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    os.chdir(ROOT)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
        os.chdir(cwd)


@pytest.fixture(scope="module")
def pretrain_checkpoint(tmp_path_factory, tokenizer) -> tuple[str, dict]:
    """A tiny ALBEF_Base (tiny Pretrain.yaml sizes, the module's tokenizer) saved as {'model': state_dict}."""
    from models.pretrain import ALBEF_Base

    torch.manual_seed(0)
    model = ALBEF_Base(tiny_config("pretrain", vision_init=None), tokenizer)
    path = str(tmp_path_factory.mktemp("pretrain") / "checkpoint.pth")
    state = model.state_dict()
    torch.save({"model": state}, path)
    return path, state


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: on a shared 2-core machine a second OpenMP thread only
    spin-waits on these tiny matrices (it made steps up to ~20x slower); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ timing
# The rule: no test's outcome depends on how fast one process runs relative to another (the suite runs on
# two busy cores, beside other work, in CI). In particular:
# - A run is killed or pre-empted at a step the test names, from inside the run: GRIT_VLP_FAULT
#   (training/faults.py, fault_env below). `kill` dies right after that step; `hold` waits after it until
#   the test's signal comes (preempt_when_held), so the step a run stops at is fixed whatever the load.
#   Never "sleep a moment, then signal", nor signal on a progress line the run may already have passed.
# - A test waits for an event (a line the run prints, a process's exit), never for a duration, and never
#   polls a file against a deadline.
# - A timeout is a hang guard only (HANG_GUARD_S), never what an assertion depends on.
# - A port a launcher binds is one nothing else can be handed meanwhile (free_port).
# - No assertion on wall-clock time: a "fast enough" check measures the process's own CPU time.

HANG_GUARD_S = 600
"""The longest any process a test starts (or waits for) may take before the test calls it hung: about ten
times the longest such run here (a torchrun pre-training, about a minute beside a full load)."""

_PORTS_LOW = 20000  # up to the kernel's first ephemeral port (32768 here); the SLURM tests derive theirs


def _ephemeral_low() -> int:
    """The first port the kernel hands out on its own (bind to 0, outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port for a launcher's --master_port (or MASTER_PORT) that nothing can take before the run binds
    it: from 20000 up to the kernel's ephemeral range (32768-60999 here), so no bind to port 0 and no outgoing
    connection (another test's gloo ring, a store client) is ever handed it; never the same one twice
    running in this machine's test processes (a counter under a file lock, shared by every pytest worker
    and suite); and free now. A port the OS picked (bind to 0, then closed) could be handed to any other
    process before the launcher, seconds of imports later, binds it."""
    span = max(_ephemeral_low() - _PORTS_LOW, 1000)
    path = os.path.join(tempfile.gettempdir(), "grit-vlp-test-ports")
    with open(path, "a+", encoding="ascii") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        text = f.read().strip()
        first = int(text) if text.isdigit() else 0
        for count in range(first, first + span):
            port = _PORTS_LOW + count % span
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue  # held by some other program: the next one
            break
        else:
            raise RuntimeError(f"no free port in {_PORTS_LOW}-{_PORTS_LOW + span - 1}")
        f.seek(0)
        f.truncate()
        f.write(str(count + 1))
    return port


def fault_env(step: int, action: str, rank: int = 0) -> dict[str, str]:
    """The environment variable that makes a run's rank `rank` kill itself (action 'kill') or hold until a
    signal ('hold') right after global step `step` (training/faults.py): for script_env(**...)."""
    from training.faults import ENV

    return {ENV: f"{step}:{action}:{rank}"}


def preempt_when_held(args: list[str], env: dict[str, str], signum: int = signal.SIGTERM
                      ) -> subprocess.CompletedProcess:
    """Start `args` in the repository root with script_env(**env) (a fault_env 'hold') in a process group
    of its own, read its output until it says it holds, send `signum` to the group, as a cluster signals
    every process of a job, and wait for its end -> its exit code and its whole output (stderr merged).
    The run cannot go on before the signal comes, so the step it stops at does not depend on when this
    process gets to read. The pipe is read unbuffered, a byte at a time, up to the line: nothing past it
    is taken from the pipe, so communicate() gets all the rest."""
    from training.faults import ENV

    holds = f"{ENV}: ".encode(), b" holds after step "
    proc = subprocess.Popen(args, cwd=ROOT, env=script_env(**env), start_new_session=True, bufsize=0,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    guard = threading.Timer(HANG_GUARD_S, os.killpg, (proc.pid, signal.SIGKILL))  # a hung run: EOF below
    guard.start()
    read = b""
    try:
        while True:
            line = proc.stdout.readline()
            read += line
            if not line:
                proc.wait(timeout=HANG_GUARD_S)
                raise AssertionError(f"the run ended (exit {proc.returncode}) without holding: "
                                     + read.decode(errors="replace")[-3000:])
            if line.startswith(holds[0]) and holds[1] in line:
                break
        os.killpg(proc.pid, signum)
        rest, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        guard.cancel()
    return subprocess.CompletedProcess(args, proc.returncode, (read + rest).decode(errors="replace"))


def script_env(**extra: str) -> dict:
    """The environment of a script a test starts: one thread, the repository importable, output unbuffered
    (tests read it while the run goes on), and no WORLD_SIZE inherited from a launcher around pytest."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", **extra)
    env.pop("WORLD_SIZE", None)
    return env


def run_script(args: list[str], expect: int = 0, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
    """Run a command in the repository root with script_env(**env); assert its exit code, showing its
    output's tail when it differs."""
    proc = subprocess.run(args, cwd=ROOT, env=script_env(**(env or {})), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
