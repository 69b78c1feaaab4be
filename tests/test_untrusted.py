"""Untrusted files (issue 14): weights-only loads, --trust_checkpoint, partial files on --resume."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from functools import partial

import pytest
import torch
from conftest import tiny_config
from torch import nn

from grit import load_index_array
from grit_io import UntrustedCheckpointError, set_trust_checkpoint
from models.bert_weights import read_bert_weights
from models.loading import load_weights
from models.vit import build_vision_encoder
from Retrieval import main as retrieval_main
from tools.probe import main as probe_main
from training.checkpoints import (
    checkpoint_path,
    find_latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from training.cli import run_main

VIT = tiny_config("pretrain", image_res=16, patch_size=8, vision_width=32, vision_depth=1, vision_heads=2,
                  vision_init=None)


@pytest.fixture(autouse=True)
def untrusted():
    """Every test starts untrusted, and none leaves the process-wide switch on for later modules."""
    previous = set_trust_checkpoint(False)
    yield
    set_trust_checkpoint(previous)


def pickled(path, **entries) -> str:
    """A file as ALBEF and some authors save them: the entries next to a pickled argparse.Namespace."""
    torch.save({**entries, "args": argparse.Namespace(lr=1)}, path)
    return str(path)


def vit_state() -> dict:
    torch.manual_seed(0)
    return build_vision_encoder(VIT).state_dict()


# Every loader of the repository: name -> (the file's entries besides 'args', load it).
LOADERS = {
    "load_checkpoint": (lambda: {"model": {"w": torch.ones(2)}}, load_checkpoint),
    "load_weights": (lambda: {"model": {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}},
                     lambda path: load_weights(nn.Linear(3, 2), path)),
    "vision_init": (lambda: {"model": vit_state()},
                    lambda path: build_vision_encoder(dataclasses.replace(VIT, vision_init=path))),
    "text_encoder": (lambda: {"model": {"bert.embeddings.word_embeddings.weight": torch.ones(4, 2)}},
                     read_bert_weights),
    "load_index_array": (lambda: {"sampler": {"indices": torch.arange(8)}},  # a training checkpoint
                         partial(load_index_array, dataset_len=8)),
}


@pytest.mark.parametrize("name", LOADERS)
def test_pickled_objects_are_refused_naming_the_file_and_the_flag(tmp_path, name):
    make, load = LOADERS[name]
    path = pickled(tmp_path / f"{name}.pth", **make())
    with pytest.raises(UntrustedCheckpointError) as err:
        load(path)
    message = str(err.value)
    assert path in message and "--trust_checkpoint" in message
    assert "argparse.Namespace" in message and "arbitrary code" in message


@pytest.mark.parametrize("name", LOADERS)
def test_trust_checkpoint_loads_them_with_a_warning(tmp_path, capsys, name):
    make, load = LOADERS[name]
    path = pickled(tmp_path / f"{name}.pth", **make())
    set_trust_checkpoint(True)
    load(path)
    assert "warning: --trust_checkpoint" in capsys.readouterr().err


def test_trusted_vision_init_gets_the_weights(tmp_path):
    state = vit_state()
    set_trust_checkpoint(True)
    path = pickled(tmp_path / "vit.pth", model=state)
    model = build_vision_encoder(dataclasses.replace(VIT, vision_init=path))
    assert torch.equal(model.state_dict()["blocks.0.mlp.fc2.weight"], state["blocks.0.mlp.fc2.weight"])


def test_truncated_or_corrupt_files_are_not_called_untrusted(tmp_path):
    torch.save({"model": {"w": torch.ones(64)}}, tmp_path / "whole.pth")
    blob = (tmp_path / "whole.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(blob[: len(blob) // 2])
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    set_trust_checkpoint(True)  # trust does not make a broken file loadable
    for name in ("cut.pth", "junk.pth"):
        with pytest.raises(ValueError, match=f"{name}.*truncated") as err:
            load_checkpoint(tmp_path / name)
        assert not isinstance(err.value, UntrustedCheckpointError)


def retrieval_argv(tmp_path, checkpoint: str) -> list[str]:
    """Retrieval.py --evaluate on the tiny config with 2 val/test images: evaluation takes a second."""
    with open("data/synthetic/retrieval_test.json", encoding="utf-8") as f:
        subset = json.load(f)[:2]
    split = tmp_path / "two_images.json"
    split.write_text(json.dumps(subset), encoding="utf-8")
    return ["--config", "configs/tiny/Retrieval.yaml", "--evaluate", "--checkpoint", checkpoint,
            "--device", "cpu", "--output_dir", str(tmp_path / "out"),
            "--set", f"val_file={split}", f"test_file={split}", "k_test=2", "save_rankings=false"]


@pytest.mark.usefixtures("one_thread", "in_repo")  # tests/conftest.py: the config names repo paths
def test_retrieval_script_refuses_then_trusts(tmp_path, capsys):
    path = pickled(tmp_path / "albef.pth", model={"temp": torch.tensor(0.07)})
    argv = retrieval_argv(tmp_path, path)
    with pytest.raises(UntrustedCheckpointError, match="albef.pth.*--trust_checkpoint"):
        retrieval_main(argv)
    record = retrieval_main([*argv, "--trust-checkpoint"])  # the hyphenated alias
    assert record["mode"] == "evaluate" and record["checkpoint"] == path and "test_r_mean" in record
    assert f"loaded {path}" in capsys.readouterr().out
    with pytest.raises(UntrustedCheckpointError):  # the next run without the flag is untrusted again
        retrieval_main(argv)


# ---------------------------------------------------------------- --resume skips partial files


def saved(tmp_path, epoch: int, mtime: float) -> str:
    path = save_checkpoint(checkpoint_path(tmp_path, epoch=epoch), model={"w": torch.ones(2)}, epoch=epoch,
                           step=epoch)
    os.utime(path, (mtime, mtime))
    return path


def test_resume_ignores_a_leftover_temp_file(tmp_path):
    good = saved(tmp_path, 2, 1e9)
    leftover = tmp_path / "checkpoint_03.pth.tmp1234"
    leftover.write_bytes(b"half a checkpoint")
    os.utime(leftover, (2e9, 2e9))
    assert find_latest_checkpoint(tmp_path) == good
    os.remove(tmp_path / "latest.json")  # file times alone: the temp file is still no candidate
    assert resolve_resume("latest", str(tmp_path)) == good


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbled latest.json"])
def test_resume_falls_back_past_what_latest_json_names(tmp_path, capsys, damage):
    older = saved(tmp_path, 0, 1e9)
    newer = saved(tmp_path, 1, 2e9)  # latest.json names it
    if damage == "missing":
        os.remove(newer)
    elif damage == "truncated":
        with open(newer, "r+b") as f:
            f.truncate(os.path.getsize(newer) // 2)
    else:
        (tmp_path / "latest.json").write_text('{"path": "../../etc/passwd"}', encoding="utf-8")
    expected = newer if damage == "garbled latest.json" else older
    assert resolve_resume("latest", str(tmp_path)) == expected
    out = capsys.readouterr().out
    assert (f"skipping {newer}: {damage}" in out) if damage != "garbled latest.json" else "latest.json" in out
    assert load_checkpoint(expected)["epoch"] == (1 if expected == newer else 0)


def test_resume_with_every_checkpoint_truncated_starts_fresh(tmp_path):
    path = saved(tmp_path, 0, 1e9)
    with open(path, "r+b") as f:
        f.truncate(10)
    assert find_latest_checkpoint(tmp_path) is None


@pytest.mark.usefixtures("one_thread", "in_repo")
def test_checkpoint_tool_refuses_in_one_line_then_trusts(tmp_path, capsys):
    path = pickled(tmp_path / "albef.pth", model={"temp": torch.tensor(0.07)})
    argv = ["--config", "configs/tiny/Pretrain.yaml", "--checkpoint", path, "--device", "cpu", "--limit", "1"]
    with pytest.raises(SystemExit) as exit_info:
        run_main(probe_main, argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1  # one line, no traceback
    assert err.startswith(f"error: checkpoint '{path}'") and "--trust_checkpoint" in err
    assert probe_main([*argv, "--trust-checkpoint"])["checkpoint"] == path
