"""tools.itm_stall: the per-epoch figures of a comparison's runs, read from tools.compare's folders."""

import json
import math
import os

import pytest

from grit_io import InputFileError
from tools import itm_stall
from tools.runs import run_dir


def _write_runs(root: str, arm: str, lr: float, seeds_to_start: dict[int, int], epochs: int = 4) -> None:
    """Runs of `epochs` epochs whose ITM leaves chance at the given 1-based epoch; epoch 1's hardness grows
    with that epoch."""
    for seed, start in seeds_to_start.items():
        rows = [{"epoch": e, "loss_itm": 0.637 if e + 1 < start else 0.55,
                 "hardness": 0.5 + 0.01 * start,
                 "itm_accuracy": 2 / 3, "itm_match_accuracy": 0.0 if e + 1 < start else 0.4,
                 "itm_false_negatives": 0.1 * seed, "batch_same_scene": 0.2}
                for e in range(epochs)]
        folder = run_dir(root, arm, seed, lr)
        os.makedirs(folder)
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump({"command": [], "log": rows, "retrieval": {}, "probe": {}}, f)


def test_tables_epochs_and_correlations(tmp_path, capsys):
    root = str(tmp_path / "compare")
    _write_runs(root, "GRIT-VLP", 5e-4, {1: 2, 2: 4, 3: 5})  # seed 3: never leaves chance in 4 epochs
    _write_runs(root, "random batches", 2.5e-4, {1: 2, 2: 2, 3: 2})
    report = str(tmp_path / "r")
    record = itm_stall.main(["--compare_dir", root, "--seeds", "1", "2", "3", "--output_dir", report,
                             "--lrs", "5e-4", "2.5e-4"])
    assert record["itm_epoch"] == {"GRIT-VLP": {1: 2, 2: 4, 3: 5}, "random batches": {1: 2, 2: 2, 3: 2}}
    rho = record["rank_correlation_epoch1"]
    assert rho["GRIT-VLP"]["hardness"] == pytest.approx(1.0)  # rises with the late start
    assert rho["GRIT-VLP"]["itm_false_negatives"] == pytest.approx(1.0)  # 0.1 x seed: the same order
    assert math.isnan(rho["GRIT-VLP"]["batch_same_scene"])  # constant: no correlation to give
    assert math.isnan(rho["random batches"]["hardness"])  # every seed leaves chance at once
    out = capsys.readouterr().out
    assert "### itm_match_accuracy" in out and "| GRIT-VLP | 3 | 5 | 0.000 | 0.000 | 0.000 | 0.000 |" in out
    assert all(os.path.isfile(os.path.join(report, f"itm_stall.{ext}")) for ext in ("md", "json"))
    # without --probe_limit no log has `probe`: no empty table or panel for it
    assert record["metrics"] == [m for m in itm_stall.METRICS if m != "probe"] and "### probe" not in out


def test_missing_run_is_named(tmp_path):
    with pytest.raises(InputFileError, match="seed 4"):
        itm_stall.main(["--compare_dir", str(tmp_path), "--seeds", "4", "--arms", "GRIT-VLP"])
    with pytest.raises(InputFileError, match="2 rates for 1 arms"):
        itm_stall.main(["--compare_dir", str(tmp_path), "--seeds", "4", "--arms", "GRIT-VLP",
                        "--lrs", "1", "2"])


def test_probe_on_every_epoch_checkpoint(in_repo, tmp_path):
    """--probe_limit: the compositional probe of each epoch's checkpoint joins each run's rows, the same
    probe pairs for every arm (here two runs of one random model: the same accuracy)."""
    import torch

    from models.pretrain import ALBEF_Base
    from models.tokenization import build_tokenizer
    from tools.runs import PRETRAIN_CONFIG
    from training.config_resolve import resolve_config

    config = resolve_config("pretrain", PRETRAIN_CONFIG, ["vision_init=null"], check_paths=False)
    torch.manual_seed(0)
    state = {"model": ALBEF_Base(config, build_tokenizer(config)).state_dict()}
    root = str(tmp_path / "compare")
    _write_runs(root, "GRIT-VLP", 5e-4, {1: 2})
    _write_runs(root, "random batches", 2.5e-4, {1: 2})
    for arm, lr in (("GRIT-VLP", 5e-4), ("random batches", 2.5e-4)):
        folder = os.path.join(run_dir(root, arm, 1, lr), "pretrain")
        os.makedirs(folder)
        for epoch in range(4):
            torch.save(state, os.path.join(folder, f"checkpoint_{epoch:02d}.pth"))
    both = ["--lrs", "5e-4", "2.5e-4"]
    record = itm_stall.main(["--compare_dir", root, "--seeds", "1", "--probe_limit", "2", *both])
    probes = [r["probe"] for runs in record["logs"].values() for r in runs[1]]
    assert len(probes) == 8 and len(set(probes)) == 1 and 0 <= probes[0] <= 1
    assert "probe" in record["metrics"]
    os.remove(os.path.join(run_dir(root, "GRIT-VLP", 1, 5e-4), "pretrain", "checkpoint_03.pth"))
    with pytest.raises(InputFileError, match="checkpoint_03.pth is missing"):
        itm_stall.main(["--compare_dir", root, "--seeds", "1", "--probe_limit", "2", *both])


def test_corpus_real_reads_the_runs_at_the_real_selections(tmp_path, monkeypatch):
    """Without --lrs, --corpus real reads each arm's run at the real corpora's selection (SELECTED_LR_REAL),
    the synthetic world at tools.compare's default schedule's (SELECTED_LR_24) or --epochs 12's (SELECTED_LR);
    the probe, which only the synthetic world has, is refused there."""
    from tools import arms

    monkeypatch.setitem(arms.SELECTED_LR_REAL, "GRIT-VLP", 2.5e-4)
    monkeypatch.setitem(arms.SELECTED_LR, "GRIT-VLP", 5e-4)
    monkeypatch.setitem(arms.SELECTED_LR_24, "GRIT-VLP", 1e-3)
    root = str(tmp_path / "compare")
    _write_runs(root, "GRIT-VLP", 2.5e-4, {1: 3}, epochs=6)  # the real corpora's config trains 6
    record = itm_stall.main(["--compare_dir", root, "--seeds", "1", "--arms", "GRIT-VLP", "--corpus", "real"])
    assert record["itm_epoch"] == {"GRIT-VLP": {1: 3}}
    with pytest.raises(InputFileError, match=r"lr 0\.001.*seed 1"):  # the synthetic 24-epoch selection's
        itm_stall.main(["--compare_dir", root, "--seeds", "1", "--arms", "GRIT-VLP"])
    with pytest.raises(InputFileError, match=r"lr 0\.0005.*seed 1"):  # the synthetic 12-epoch selection's
        itm_stall.main(["--compare_dir", root, "--seeds", "1", "--arms", "GRIT-VLP", "--epochs", "12"])
    with pytest.raises(InputFileError, match="the real corpus has no compositional probe"):
        itm_stall.main(["--compare_dir", root, "--seeds", "1", "--arms", "GRIT-VLP", "--corpus", "real",
                        "--probe_limit", "5"])


def test_runs_of_another_schedule_are_refused_not_read(tmp_path, monkeypatch):
    """Read at a schedule's selections, a run that trained another schedule is refused, naming the file and
    the --epochs that reads it, even where the two schedules select the same rate (the same folder); --lrs
    alone names the runs and reads them as they are."""
    from tools import arms

    monkeypatch.setitem(arms.SELECTED_LR_24, "GRIT-VLP", 2.5e-4)
    monkeypatch.setitem(arms.SELECTED_LR, "GRIT-VLP", 2.5e-4)
    root = str(tmp_path / "compare")
    _write_runs(root, "GRIT-VLP", 2.5e-4, {1: 3}, epochs=12)  # 12 epochs at the 24-epoch selection's rate
    refused = r"result.json: the run trained 12 epochs, not the 24 .*--epochs 12"
    with pytest.raises(InputFileError, match=refused):
        itm_stall.main(["--compare_dir", root, "--seeds", "1", "--arms", "GRIT-VLP"])
    with pytest.raises(InputFileError, match="not the 24"):
        itm_stall.main(["--compare_dir", root, "--seeds", "1", "--arms", "GRIT-VLP", "--epochs", "24"])
    assert itm_stall.main(["--compare_dir", root, "--seeds", "1", "--arms", "GRIT-VLP", "--epochs", "12"])[
        "itm_epoch"] == {"GRIT-VLP": {1: 3}}
    assert itm_stall.main(["--compare_dir", root, "--seeds", "1", "--arms", "GRIT-VLP", "--lrs", "2.5e-4"])[
        "itm_epoch"] == {"GRIT-VLP": {1: 3}}
