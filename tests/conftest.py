"""Helpers and fixtures shared by the tests: typed tiny configs, tokenizers, the repo root as working dir."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess

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
    `values` laid over its keys: a dict value merges into a block (grit={"enabled": False}). Data paths
    are not checked to exist (nothing is read)."""
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


def free_port() -> int:
    """A TCP port no process listens on now (the OS picks it), for a launcher's --master_port: a fixed
    port can still be held by a run a test has just killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env(**extra: str) -> dict:
    """The environment of a script a test starts: one thread, the repository importable, output unbuffered
    (tests read it while the run goes on), and no WORLD_SIZE inherited from a launcher around pytest."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", **extra)
    env.pop("WORLD_SIZE", None)
    return env


def run_script(args: list[str], expect: int = 0, timeout: float = 400) -> subprocess.CompletedProcess:
    """Run a command in the repository root with script_env(); assert its exit code, showing its output's
    tail when it differs."""
    proc = subprocess.run(args, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
