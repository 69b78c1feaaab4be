"""A user's mistake on the command line ends in one `error:` line naming the file, key or flag, exit 2, with
nothing written to --output_dir (training.cli.run_main); one flag style with hyphenated aliases."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HANG_GUARD_S, ROOT, small_pretrain_sets

import NLVR
import Pretrain
import Retrieval
import VQA
from training.cli import run_main

TINY = {Pretrain: "configs/tiny/Pretrain.yaml", Retrieval: "configs/tiny/Retrieval.yaml",
        NLVR: "configs/tiny/NLVR.yaml", VQA: "configs/tiny/VQA.yaml"}


def mistake(capsys, script, argv: list[str]) -> str:
    """Run script.main(argv) as the command line does; assert exit 2 with stderr exactly one `error:` line
    (no usage block, warning or traceback before it), return it."""
    with pytest.raises(SystemExit) as stop:
        run_main(script.main, argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def out(tmp_path):
    """An --output_dir that must stay absent."""
    path = tmp_path / "out"
    yield str(path)
    assert not path.exists(), "something was written to --output_dir before the checks passed"


def pretrain_json(tmp_path, text: str) -> list[str]:
    """--set items that train on a pre-training json list holding `text`."""
    path = tmp_path / "pretrain.json"
    path.write_text(text)
    return ["--set", *small_pretrain_sets("data/synthetic", train_file=f"[{path}]")]


def test_a_bad_value_names_key_and_source(in_repo, capsys, out):
    line = mistake(capsys, Pretrain, ["--config", TINY[Pretrain], "--output_dir", out,
                                      "--set", "batch_size=0"])
    assert line == "error: config key 'batch_size' must be >= 1, got 0 from --set"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it(in_repo, capsys, out):
    line = mistake(capsys, Retrieval, ["--config", TINY[Retrieval], "--output_dir", out, "--device", "cuda"])
    assert line == "error: --device cuda: CUDA is not available on this machine (use --device cpu)"


@pytest.mark.parametrize("text, words", [
    ('[{"image": "a.png", "caption": "a cat"},', ["invalid JSON at line 1"]),
    ('[{"image": "images/train/0.png"}]', ["entry 0", "missing", "caption"]),
    ('[{"image": "images/train/0.png", "caption": 5}]', ["entry 0", "'caption' must be"]),
    ('{"image": "images/train/0.png", "caption": "a cat"}', ["expected a JSON list"]),
])
def test_a_malformed_pretraining_json_names_the_file(in_repo, capsys, out, tmp_path, text, words):
    line = mistake(capsys, Pretrain, ["--config", TINY[Pretrain], "--output_dir", out, "--device", "cpu",
                                      *pretrain_json(tmp_path, text)])
    assert str(tmp_path / "pretrain.json") in line
    for word in words:
        assert word in line


@pytest.mark.parametrize("content", ["text", "tensor"])
def test_a_checkpoint_that_is_no_checkpoint_names_the_file(in_repo, capsys, out, tmp_path, content):
    path = tmp_path / "weights.pth"
    if content == "text":
        path.write_text("not a checkpoint")
    else:
        torch.save(torch.zeros(3), path)
    line = mistake(capsys, Retrieval, ["--config", TINY[Retrieval], "--output_dir", out, "--device", "cpu",
                                       "--checkpoint", str(path), "--set", "vision_init=null"])
    assert str(path) in line


def test_output_dir_is_required_and_its_help_says_so(in_repo, capsys):
    for script in (Pretrain, Retrieval, NLVR, VQA):
        line = mistake(capsys, script, ["--config", TINY[script], "--device", "cpu"])
        assert "required" in line and "--output_dir" in line
        assert "required but with --print_config" in " ".join(script.PARSER.format_help().split())
        assert " --output_dir OUTPUT_DIR" in script.PARSER.format_usage()  # not [--output_dir ...]
        assert "[--output_dir" not in script.PARSER.format_usage()


def test_pretrain_evaluate_is_refused_with_what_to_run_instead(in_repo, capsys, out):
    line = mistake(capsys, Pretrain, ["--config", TINY[Pretrain], "--output_dir", out, "--evaluate"])
    assert "Retrieval.py" in line and "--evaluate" in line and "tools.probe" in line


@pytest.mark.parametrize("argv, words", [
    (["--config", "configs/tiny/Nowhere.yaml"], ["config file not found: configs/tiny/Nowhere.yaml"]),
    (["--config", TINY[Retrieval], "--set", "k_test"], ["must look like key=value"]),
    (["--config", TINY[Retrieval], "--seed", "abc"], ["--seed", "invalid int value"]),
    (["--config", TINY[Retrieval], "--epochs", "3"], ["unrecognized arguments: --epochs 3"]),
    (["--config", TINY[Retrieval], "--resume", "gone.pth"], ["--resume checkpoint not found: gone.pth"]),
    (["--config", TINY[Retrieval], "--set", "itm_negatives=soft"], ["'itm_negatives' must be one of"]),
])
def test_other_mistakes(in_repo, capsys, out, argv, words):
    line = mistake(capsys, Retrieval, [*argv, "--output_dir", out, "--device", "cpu"])
    for word in words:
        assert word in line


def test_flags_answer_to_their_hyphenated_spelling_too(in_repo):
    args = Retrieval.PARSER.parse_args(["--config", "c.yaml", "--output-dir", "o", "--trust-checkpoint",
                                        "--print-config", "--local-rank", "0"])
    assert (args.output_dir, args.trust_checkpoint, args.print_config) == ("o", True, True)
    assert args.local_rank == 0
    usage = Retrieval.PARSER.format_usage()
    assert usage.startswith("usage: python Retrieval.py") and "--output_dir" in usage


def test_a_script_process_exits_2_with_one_line_and_writes_nothing(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("WORLD_SIZE", None)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "Pretrain", "--config", os.path.join(ROOT, TINY[Pretrain]),
                           "--output_dir", str(out), "--set", "lamda_cons=0.1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: unknown config key 'lamda_cons' (did you mean 'lambda_cons'?) in --set"]
    assert not out.exists()


def test_a_bad_vqa_answer_list_names_the_file(in_repo, capsys, out, tmp_path):
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"not": "a list"}))
    line = mistake(capsys, VQA, ["--config", TINY[VQA], "--output_dir", out, "--device", "cpu",
                                 "--set", f"answer_list={answers}", "vision_init=null"])
    assert str(answers) in line


def test_a_corrupt_resume_checkpoint_names_the_file_and_writes_nothing(in_repo, capsys, out, tmp_path):
    broken = tmp_path / "checkpoint_03.pth"
    broken.write_bytes(b"PK\x03\x04 cut short")
    line = mistake(capsys, Retrieval, ["--config", TINY[Retrieval], "--output_dir", out, "--device", "cpu",
                                       "--resume", str(broken)])
    assert str(broken) in line


def test_the_readme_flag_list_names_every_flag_the_scripts_define():
    """README's flag block (the indented `--flag` lines under "Flags, the same for all four scripts") lists
    exactly the flags the scripts' parsers define (help and hidden ones aside), --bench for Retrieval only."""
    import argparse
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text[text.index("Flags, the same for all four scripts"):]
    block = block[:block.index("\n\n", block.index("    --"))]
    listed = set(re.findall(r"^    (--[a-z_]+)", block, re.MULTILINE))

    def flags(script) -> set[str]:
        return {action.option_strings[0] for action in script.PARSER._actions
                if action.help != argparse.SUPPRESS and action.option_strings[0] != "-h"}

    for script in TINY:
        extra = {"--bench"} if script is Retrieval else set()
        assert flags(script) == listed - ({"--bench"} - extra), script.__name__
