"""tools.compare and the demo's side-by-side report, on hand-made run records (no training)."""

from __future__ import annotations

import dataclasses
import os

from tools.compare import side_by_side, summary_row


def _run(itm: float, txt: float, img: float, colour: float) -> tuple[list[dict], dict, dict]:
    rows = [{"epoch": e, "grit_hardness": 0.5 + 0.1 * e, "loss_itm": itm + 0.01 * (2 - e)} for e in range(3)]
    retrieval = {"test_txt_r1": txt, "test_img_r1": img, "test_mean_r1": (txt + img) / 2, "test_r_mean": 40.0}
    kinds = {"colour": {"accuracy": colour, "pairs": 10}, "shape": {"accuracy": 0.5, "pairs": 10}}
    probe = {"overall": (colour + 0.5) / 2, "per_kind": kinds}
    return rows, retrieval, probe


def test_summary_row_takes_the_last_epoch_and_every_probe_kind():
    row = summary_row(*_run(0.4, 6.0, 4.0, 0.9))
    assert row["loss_itm"] == 0.4 and row["grit_hardness"] == 0.7
    assert (row["txt_r1"], row["img_r1"], row["mean_r1"], row["r_mean"]) == (6.0, 4.0, 5.0, 40.0)
    assert row["probe"] == 0.7 and row["probe_colour"] == 0.9 and row["probe_shape"] == 0.5


def test_side_by_side_shows_both_runs_per_epoch_recall_and_probe():
    text = side_by_side({"GRIT-VLP": _run(0.4, 6.0, 4.0, 0.9), "random batches": _run(0.6, 2.0, 3.0, 0.7)})
    lines = text.splitlines()
    assert "GRIT-VLP" in lines[1] and "random batches" in lines[1]
    assert any(line.split()[:3] == ["epoch", "2", "loss_itm"] and line.split()[3:] == ["0.4000", "0.6000"]
               for line in lines)
    mean = next(line for line in lines if line.strip().startswith("mean R@1"))
    assert mean.split()[2:] == ["5.00", "2.50"]
    colour = next(line for line in lines if line.strip().startswith("colour"))
    assert colour.split()[1:] == ["0.9000", "0.7000"]


def test_evaluations_get_the_overrides_their_config_accepts():
    from tools.compare import overrides_for

    given = ['vision_stem=conv', 'grit.search_space=120', 'bert_config=/x/bert.json', 'max_epoch=20']
    assert overrides_for('retrieval', given) == ['--set', 'vision_stem=conv', 'bert_config=/x/bert.json',
                                                 'max_epoch=20']
    assert overrides_for('pretrain', given) == ['--set', *given]
    assert overrides_for('retrieval', ['grit.enabled=false']) == []


def test_the_downstream_pretraining_is_the_tiny_one_for_longer(monkeypatch):
    # demo --downstream's checkpoint must come from the demo's GRIT-VLP run with a longer schedule only,
    # so that NLVR2 and VQA measure the same model and method (docs/synthetic-world.md, 'NLVR2 on the
    # synthetic data').
    import demo
    from tools.compare import PRETRAIN_CONFIG, pretrain_command
    from training.config_resolve import resolve_config

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tiny = resolve_config("pretrain", PRETRAIN_CONFIG, check_paths=False)
    long = resolve_config("pretrain", demo.DOWNSTREAM_PRETRAIN_CONFIG, check_paths=False)
    assert long.max_epoch == long.schedular.epochs == 36
    assert tiny.max_epoch == tiny.schedular.epochs == 12
    schedule = dataclasses.replace(long.schedular, epochs=12)
    assert dataclasses.replace(long, max_epoch=12, schedular=schedule) == tiny
    assert long.grit.enabled
    assert pretrain_command("out", ["--seed", "1"], demo.DOWNSTREAM_PRETRAIN_CONFIG) == [
        "Pretrain", "--config", "configs/tiny/Pretrain_long.yaml", "--output_dir", "out", "--seed", "1"]


def test_demo_reads_the_trainers_log_keys():
    # The demo's table shows the optimiser steps' time under the name every script logs it.
    import demo

    assert "train_seconds" in demo.COLUMNS and "seconds" not in demo.COLUMNS
    rows = [{"epoch": 0, "loss_itc": 1.0, "loss_cons": 0.0, "loss_itm": 0.6, "loss_mlm": 3.0,
             "grit_hardness": 0.4, "train_seconds": 12.5}]
    assert demo.table(rows, demo.COLUMNS).splitlines()[1].split() == [
        "0", "1.0000", "0.0000", "0.6000", "3.0000", "0.4000", "12.5000"]
