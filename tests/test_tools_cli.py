"""The tools' one command line and launcher: `python -m tools.X` usage, --output_dir (and --output-dir),
the record tail, and scripts and tools launched as children from another working directory."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
from conftest import HANG_GUARD_S, ROOT

from grit_io import InputFileError
from tools.cli import emit_record, record_claim
from tools.launch import absolute_paths, child_env, launch, python_command

pytestmark = pytest.mark.usefixtures("in_repo")  # tests/conftest.py: repo root, one thread, synthetic data

# Every command in tools/ of this area, with the least argv its parser accepts besides --output_dir.
TOOLS = {
    "tools.probe": ["--config", "c.yaml", "--checkpoint", "k.pth"],
    "tools.uov": ["--config", "c.yaml", "--checkpoint", "k.pth"],
    "tools.warmstart": ["--config", "c.yaml", "--checkpoint", "k.pth"],
    "tools.report": ["run"],
    "tools.compare": ["--seeds", "1"],
    "tools.ablate": ["--table", "5"],
    "tools.step_bench": ["--config", "c.yaml"],
    "tools.loader_bench": [],
    "tools.grit_bench": [],
    "tools.make_synthetic": [],
    "tools.itm_stall": ["--compare_dir", "runs", "--seeds", "1"],
}


def parser_of(module: str):
    return importlib.import_module(module).build_parser()


@pytest.mark.parametrize("module", TOOLS)
def test_usage_names_the_command_as_typed_and_every_option_has_help(module):
    parser = parser_of(module)
    assert parser.format_usage().startswith(f"usage: python -m {module} ")
    for action in parser._actions:
        if action.option_strings and action.help != "==SUPPRESS==":
            assert action.help, (module, action.option_strings)
            # ALBEF's underscore flags, each also spelled with hyphens.
            long = [o for o in action.option_strings if o.startswith("--")]
            assert all("-" not in o[2:] for o in long[:1]), (module, long)
            assert {o.replace("_", "-") for o in long} <= set(action.option_strings), (module, long)


@pytest.mark.parametrize("module", TOOLS)
def test_output_dir_and_its_hyphenated_alias(module):
    parser = parser_of(module)
    for flag in ("--output_dir", "--output-dir"):
        assert parser.parse_args([*TOOLS[module], flag, "out"]).output_dir == "out"


def test_demo_takes_the_same_flags():
    import demo

    parser = demo.build_parser()
    assert parser.format_usage().startswith("usage: python demo.py ")
    args = parser.parse_args(["--output-dir", "out", "--no-compare"])
    assert args.output_dir == "out" and not args.compare
    assert not parser.parse_args(["--no_compare"]).compare


def test_a_flag_mistake_is_one_line_naming_the_command(tmp_path):
    """From another working directory, with the repository on PYTHONPATH, as any user's shell has it."""
    proc = subprocess.run([sys.executable, "-m", "tools.ablate", "--table", "9"], cwd=tmp_path,
                          env=child_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: argument --table")
    assert proc.stderr.rstrip().endswith("(see python -m tools.ablate --help)")


def test_emit_record_prints_one_line_and_writes_it(tmp_path, capsys):
    record = {"a": 1, "b": [0.5, None]}
    assert emit_record(record, str(tmp_path / "new"), "tool") == record
    assert json.loads(capsys.readouterr().out) == record
    assert json.loads((tmp_path / "new" / "tool.json").read_text()) == record
    emit_record(record, None, "tool")  # no folder: printed only
    assert capsys.readouterr().out.count("\n") == 1


def test_emit_record_writes_strict_json_with_null_for_a_missing_figure(tmp_path, capsys):
    """A figure some runs lack (nan), or the std of one seed, is null: not the bare NaN strict readers
    refuse."""
    emit_record({"std": float("nan"), "rows": [{"x": float("inf")}, (1.5,)]}, str(tmp_path), "tool")
    expected = {"std": None, "rows": [{"x": None}, [1.5]]}
    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))

    assert strict(capsys.readouterr().out) == expected
    assert strict((tmp_path / "tool.json").read_text()) == expected


def test_a_record_claimed_by_one_invocation_is_refused_to_a_second_naming_the_holder(tmp_path):
    """Two invocations writing one record into one folder (seeds run in parallel) would overwrite each
    other's on finishing: the second is refused at its start, naming the first; another record name in the
    same folder goes ahead, and the record is free again once the first is done."""
    out = str(tmp_path / "runs")
    with record_claim(out, "compare", "tools.compare"):
        holder = rf"compare\.json: python -m tools\.compare \(pid {os.getpid()}\)"
        with pytest.raises(InputFileError, match=holder + r".*--record compare_2"):
            with record_claim(out, "compare", "tools.compare"):
                pass
        with record_claim(out, "compare_2", "tools.compare"):  # its own record: both go ahead
            pass
    with record_claim(out, "compare", "tools.compare"):  # released on leaving, also after an error
        pass
    with pytest.raises(RuntimeError):
        with record_claim(out, "compare", "tools.compare"):
            raise RuntimeError
    with record_claim(out, "compare", "tools.compare"):
        pass


def test_a_record_name_with_a_folder_is_one_line_naming_the_flag(capsys):
    """--record names a file in --output_dir: a path would write the record elsewhere."""
    from tools import compare

    with pytest.raises(SystemExit):
        compare.main(["--seeds", "1", "--record", "../elsewhere"])
    err = capsys.readouterr().err
    assert "--record" in err and "a file name without a folder" in err and err.count("\n") <= 2


def test_a_folder_without_file_locks_runs_unchecked(tmp_path, monkeypatch):
    """Where the file system refuses locks (ENOLCK on some NFS mounts) the tool runs, unchecked, instead of
    being refused as if another held the record."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    ran = []
    with record_claim(str(tmp_path), "compare", "tools.compare"):
        ran.append(1)
    assert ran == [1]


def test_absolute_paths_turns_every_user_path_absolute(tmp_path):
    args = ["--config", "c.yaml", "--output-dir=out", "--checkpoint", "/abs/k.pth", "--resume", "--set",
            "image_root=data/x", "--probe_file", "p.json", "--seed", "3"]
    assert absolute_paths(args, str(tmp_path)) == [
        "--config", str(tmp_path / "c.yaml"), f"--output-dir={tmp_path / 'out'}",
        "--checkpoint", "/abs/k.pth",
        "--resume", "--set", "image_root=data/x",  # a bare --resume stays; --set values are the config's
        "--probe_file", str(tmp_path / "p.json"), "--seed", "3"]
    assert python_command(["Pretrain", "--seed", "1"])[:3] == [sys.executable, "-m", "Pretrain"]


def test_a_script_launched_from_another_directory(tmp_path, monkeypatch):
    """tools.launch from a folder outside the repository: a relative --config is the caller's, and the
    script runs as `python -m Retrieval` with the repository on its path."""
    (tmp_path / "mine.yaml").write_text(f"base: '{ROOT}/configs/tiny/Retrieval.yaml'\nseed: 7\n")
    monkeypatch.chdir(tmp_path)
    with open("stdout.txt", "w") as out:
        code = launch(["Retrieval", "--config", "mine.yaml", "--print_config"], stdout=out,
                      threads=1).wait(timeout=HANG_GUARD_S)
    printed = (tmp_path / "stdout.txt").read_text()
    assert code == 0, printed[-2000:]
    assert printed.startswith("# RetrievalConfig") and "\nseed: 7 " in printed


@pytest.fixture(scope="module")
def tokenizer(in_repo):
    from conftest import tiny_config

    from models.tokenization import build_tokenizer

    return build_tokenizer(tiny_config("pretrain"))


def test_a_tool_launched_from_another_directory(tmp_path, monkeypatch, pretrain_checkpoint):
    """tools.probe launched from another folder with paths relative to it: the checkpoint is read and the
    record written where the caller meant, while the config's repository-relative paths (the synthetic
    data, its vocabulary, the probe file) are read in the repository root, where the child runs."""
    checkpoint, _ = pretrain_checkpoint
    os.symlink(checkpoint, tmp_path / "mine.pth")
    monkeypatch.chdir(tmp_path)
    with open("stdout.txt", "w") as out:
        code = launch(["tools.probe", "--config", os.path.join(ROOT, "configs/tiny/Pretrain.yaml"),
                       "--checkpoint", "mine.pth", "--output_dir", "probe", "--limit", "2",
                       "--device", "cpu"],
                      stdout=out, threads=1).wait(timeout=HANG_GUARD_S)
    printed = (tmp_path / "stdout.txt").read_text()
    assert code == 0, printed[-2000:]
    record = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert record == json.loads(printed.strip().splitlines()[-1])
    assert record["checkpoint"] == str(tmp_path / "mine.pth") and record["images"] == 2
    assert record["probe_file"] == "data/synthetic/probe_test.json"
    assert not os.path.exists(tmp_path / "data")  # nothing generated in the caller's folder
