"""tools.report: per-epoch markdown tables and overlaid PNG plots from runs' log.txt files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import HANG_GUARD_S, run_here, small_pretrain_sets

from tools.report import (
    NO_MATPLOTLIB,
    ReportError,
    format_value,
    load_runs,
    main,
    markdown_report,
    plot_metrics,
    run_names,
)
from training.cli import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# What Pretrain.py appends to log.txt per epoch, in its order (training.trainer).
PRETRAIN_KEYS = ("epoch", "step", "lr", "hardness", "loss_cons", "loss_itc", "loss_itm", "loss_mlm",
                 "train_seconds", "samples_per_s", "epoch_seconds", "bad_samples", "skipped_steps",
                 "sampler_seconds")
PLOTTED = ["loss_cons", "loss_itc", "loss_itm", "loss_mlm", "hardness", "samples_per_s", "sampler_seconds",
           "epoch_seconds"]


def pretrain_record(epoch: int, scale: float) -> dict:
    """A realistic Pretrain.py log record (values shaped like a tiny run's)."""
    values = (epoch, 360 * (epoch + 1), 4.86875e-4 / (epoch + 1), 0.46 + 0.1 * epoch, 0.0,
              1.58 * scale / (epoch + 1), 0.64 * scale - 0.05 * epoch, 3.53 * scale - 0.1 * epoch, 13.559,
              212.41 + epoch, 13.56, 0, 0, 0.003)
    return dict(zip(PRETRAIN_KEYS, values))


def write_log(d, records, extra_lines=()) -> str:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "log.txt"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(d)


@pytest.fixture
def two_runs(tmp_path) -> tuple[str, str]:
    """A 3-epoch GRIT run and a 2-epoch random-batch run, laid out as the ablation driver does."""
    grit = write_log(tmp_path / "grit" / "seed1" / "pretrain", [pretrain_record(e, 1.0) for e in range(3)])
    rand = write_log(tmp_path / "random" / "seed1" / "pretrain", [pretrain_record(e, 1.2) for e in range(2)])
    return grit, rand


def table(report: str, run_name: str) -> list[dict[str, str]]:
    """The first markdown table under `## run_name`, as {column: cell} rows."""
    lines = report.splitlines()
    start = lines.index(f"## {run_name}")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    head, _, *body = rows
    return [dict(zip(head, row)) for row in body]


def pngs(d) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".png"))


def test_table_has_one_row_per_epoch_with_the_logged_values(two_runs, tmp_path):
    out = str(tmp_path / "report")
    path = main([*two_runs, "--output_dir", out, "--no_plots"])
    assert path == os.path.join(out, "report.md")
    with open(path, encoding="utf-8") as f:
        report = f.read()
    for d, scale, epochs in ((two_runs[0], 1.0, 3), (two_runs[1], 1.2, 2)):
        name = "/".join(d.split(os.sep)[-3:])  # grit/seed1/pretrain: basenames and seed folders clash
        assert f"**{name}**: `{d}`" in report
        rows = table(report, name)
        assert len(rows) == epochs
        for e, row in enumerate(rows):
            assert list(row) == list(PRETRAIN_KEYS)  # every numeric key, in the log's order
            assert row == {k: format_value(k, v) for k, v in pretrain_record(e, scale).items()}
    assert not pngs(out)


def test_format_value():
    assert format_value("epoch", 3) == "3"
    assert format_value("lr", 4.86875e-4) == "4.869e-04"
    assert format_value("loss_itm", 0.63981) == "0.6398"
    assert format_value("loss_cons", 0.0) == "0.0000"
    assert format_value("loss_cons", 2e-5) == "2.000e-05"  # not 0.0000
    assert format_value("loss_itm", float("nan")) == "nan"
    assert format_value("checkpoint", None) == ""


def test_plots_overlay_the_runs_and_are_linked(two_runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    grit, rand = two_runs
    # Any other loss key is plotted too; lr and step are not.
    write_log(rand, [dict(pretrain_record(e, 1.2), loss_extra=0.1 * e) for e in range(2)])
    path = main([grit, rand, "--names", "GRIT-VLP", "random batches"])
    assert path == os.path.join(grit, "report.md")  # --output_dir defaults to the first run directory
    expected = PLOTTED[:4] + ["loss_extra"] + PLOTTED[4:]
    assert pngs(grit) == sorted(f"{m}.png" for m in expected)
    with open(path, encoding="utf-8") as f:
        report = f.read()
    for metric in expected:
        with open(os.path.join(grit, f"{metric}.png"), "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert f"![{metric}]({metric}.png)" in report
    assert len(table(report, "GRIT-VLP")) == 3 and len(table(report, "random batches")) == 2
    assert "wrote" in capsys.readouterr().out


def test_without_matplotlib_the_table_is_still_written(two_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = str(tmp_path / "report")
    main([*two_runs, "--output-dir", out])  # the hyphenated alias of --output_dir
    printed = capsys.readouterr().out
    assert NO_MATPLOTLIB in printed and "pip install matplotlib" in printed
    assert not pngs(out)
    with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
        report = f.read()
    assert ".png" not in report and "pip install matplotlib" in report
    assert len(table(report, "grit/seed1/pretrain")) == 3


def test_run_names():
    assert run_names(["out/a", "out/b/"]) == ["a", "b"]
    assert run_names(["x/s1/pretrain", "x/s2/pretrain", "x/s1/zeroshot"]) == \
        ["s1/pretrain", "s2/pretrain", "zeroshot"]
    # The same directory twice: lengthened to its full path, then numbered.
    full = os.path.abspath("out/a").strip(os.sep).replace(os.sep, "/")
    assert run_names(["out/a", "out/a"]) == [full, f"{full} (2)"]


def test_evaluate_records_and_rerun_epochs(tmp_path):
    """Retrieval --evaluate records (no epoch) get their own table; a re-run epoch keeps its last record."""
    fine = {"epoch": 0, "step": 10, "lr": 1e-5, "loss_itc": 2.0, "loss_itm": 0.7, "train_seconds": 1.5,
            "samples_per_s": 80.0, "val_r_mean": 40.0, "best_epoch": 0}
    evaluate = {"mode": "evaluate", "checkpoint": "pre/checkpoint_02.pth", "test_txt_r1": 2.3,
                "test_r_mean": 9.47, "eval_seconds": 11.853}
    d = write_log(tmp_path / "retrieval", [evaluate, fine, dict(fine, loss_itm=0.6), dict(fine, epoch=1)])
    (run,) = load_runs([d])
    assert [r["epoch"] for r in run.epochs] == [0, 1] and run.epochs[0]["loss_itm"] == 0.6
    assert run.superseded == 1 and run.evaluations == [evaluate]
    assert plot_metrics([run]) == ["loss_itc", "loss_itm", "samples_per_s"]
    report = markdown_report([run])
    rows = table(report, "retrieval")
    assert [r["loss_itm"] for r in rows] == ["0.6000", "0.7000"] and "mode" not in rows[0]
    evaluations = table(report.replace("Evaluate records (no epoch):", "## evaluations"), "evaluations")
    assert evaluations == [{"checkpoint": "pre/checkpoint_02.pth", "test_txt_r1": "2.3000",
                            "test_r_mean": "9.4700", "eval_seconds": "11.8530"}]
    assert "1 earlier records of a re-run epoch left out" in report


def test_finetune_losses_are_plotted(tmp_path):
    """NLVR and VQA log their losses as train_loss_*."""
    d = write_log(tmp_path / "vqa", [{"epoch": 0, "step": 5, "lr": 1e-4, "train_loss_vqa": 3.2,
                                      "train_seconds": 2.0, "samples_per_s": 40.0, "val_acc": 0.3}])
    assert plot_metrics(load_runs([d])) == ["train_loss_vqa", "samples_per_s"]


@pytest.mark.parametrize("case", ["missing_dir", "missing_log", "bad_json", "not_object", "bad_epoch",
                                  "empty"])
def test_bad_input_names_the_file_and_line(tmp_path, case, capsys):
    good = write_log(tmp_path / "good", [pretrain_record(0, 1.0)])
    bad = str(tmp_path / "bad")
    log = os.path.join(bad, "log.txt")
    lines = [json.dumps(pretrain_record(e, 1.0)) for e in range(2)]
    expect: tuple[type[Exception], str]
    if case == "missing_dir":
        expect = FileNotFoundError, f"run directory not found: {bad}"
    elif case == "missing_log":
        os.makedirs(bad)
        expect = FileNotFoundError, f"{log} not found"
    elif case == "bad_json":
        write_log(bad, [], lines + ['{"epoch": 2, "loss_itm": '])
        expect = ReportError, f"{log}, line 3: not valid JSON"
    elif case == "not_object":
        write_log(bad, [], [lines[0], "", "[1, 2]"])
        expect = ReportError, f"{log}, line 3: expected a JSON object, got list"
    elif case == "bad_epoch":
        write_log(bad, [], [lines[0], json.dumps(dict(pretrain_record(1, 1.0), epoch=1.5))])
        expect = ReportError, f"{log}, line 2: 'epoch' must be an integer"
    else:
        write_log(bad, [], ["", "  "])
        expect = ReportError, f"{log}: no records"
    error, message = expect
    with pytest.raises(error) as info:
        load_runs([good, bad])
    assert message in str(info.value)
    with pytest.raises(SystemExit) as info:
        run_main(main, [good, bad, "--output_dir", str(tmp_path / "report")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "report")  # nothing written for bad input


def test_names_must_match_the_runs(two_runs):
    with pytest.raises(ReportError, match="1 names for 2 run directories"):
        main([*two_runs, "--names", "only-one"])
    with pytest.raises(ReportError, match="run names must differ"):
        main([*two_runs, "--names", "same", "same"])


def test_command_line_error_is_one_line(tmp_path):
    """python -m tools.report, from another working directory: a bad run directory ends in one stderr
    line, no traceback; so does a flag mistake, naming the command as typed."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "tools.report", "nope"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: run directory not found: nope"
    proc = subprocess.run([sys.executable, "-m", "tools.report", "--bogus", "x"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: ") and "(see python -m tools.report --help)" in proc.stderr


def test_real_pretrain_runs(tmp_path):
    """Two 2-epoch Pretrain.py runs on 48 synthetic images (about 5 s each), GRIT and random batches."""
    import Pretrain
    from dataset.synthetic import ensure_synthetic

    data = ensure_synthetic(str(tmp_path / "synthetic"), n=48, seed=3)
    # As tests/test_pretrain.py shrinks the tiny config, smaller still.
    sets = small_pretrain_sets(data, **{"batching.queue_size": 16, "batching.search_space": 8, "max_epoch": 2,
                                        "schedular.epochs": 2, "schedular.warmup_steps": 2,
                                        "print_freq": 1000})
    dirs = []
    for name, extra in (("grit", []), ("random", ["batching.strategy=random"])):
        out = str(tmp_path / name)
        run_here(Pretrain, ["--config", "configs/tiny/Pretrain.yaml", "--output_dir", out, "--device", "cpu",
                            "--set", *sets, *extra])
        dirs.append(out)

    report_dir = str(tmp_path / "report")
    with open(main([*dirs, "--output_dir", report_dir]), encoding="utf-8") as f:
        report = f.read()
    for d, name in zip(dirs, ("grit", "random")):
        with open(os.path.join(d, "log.txt"), encoding="utf-8") as f:
            logged = [json.loads(line) for line in f]
        rows = table(report, name)
        assert [r["epoch"] for r in rows] == ["0", "1"]
        assert set(PRETRAIN_KEYS) <= set(rows[0])
        # a key that only some epochs log (batch_groups: grouped epochs) is an empty cell in the others
        assert rows == [{k: format_value(k, record[k]) if k in record else "" for k in rows[0]}
                        for record in logged]
        assert set(rows[0]) == {k for record in logged for k in record}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not pngs(report_dir)
    else:
        assert pngs(report_dir) == sorted(f"{m}.png" for m in PLOTTED)
