"""tools.compare and the demo's side-by-side report, on hand-made run records (no training)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

from tools.arms import ARMS
from tools.compare_summary import COLUMNS, report, select_lr, side_by_side, summary_row
from tools.runs import PRETRAIN_CONFIG, lr_overrides, read_evaluation, run_dir
from training.config_resolve import resolve_config


def _run(itm: float, txt: float, img: float, colour: float) -> tuple[list[dict], dict, dict]:
    rows = [{"epoch": e, "step": 4 * (e + 1), "hardness": 0.5 + 0.1 * e, "loss_itm": itm + 0.01 * (2 - e),
             "train_seconds": 10.0, "epoch_seconds": 10.0 + e, "sampler_seconds": 0.1 * e} for e in range(3)]
    retrieval = {"test_txt_r1": txt, "test_img_r1": img, "test_mean_r1": (txt + img) / 2,
                 "test_r_mean": 40.0, "test_itc_txt_r1": txt - 1, "test_itc_img_r1": img - 1,
                 "test_itc_mean_r1": (txt + img) / 2 - 1,
                 "val_mean_r1": txt + 10, "val_itc_mean_r1": txt + 9}
    kinds = {"colour": {"accuracy": colour, "pairs": 10}, "shape": {"accuracy": 0.5, "pairs": 10}}
    probe = {"overall": (colour + 0.5) / 2, "per_kind": kinds}
    return rows, retrieval, probe


def test_summary_row_takes_the_last_epoch_both_scorings_and_every_probe_kind():
    row = summary_row(*_run(0.4, 6.0, 4.0, 0.9))
    assert row["loss_itm"] == 0.4 and row["hardness"] == 0.7 and row["train_seconds"] == 30.0
    assert row["steps"] == 12  # the last epoch's step count: the run's training steps
    assert (row["txt_r1"], row["img_r1"], row["mean_r1"], row["r_mean"]) == (6.0, 4.0, 5.0, 40.0)
    assert (row["itc_txt_r1"], row["itc_img_r1"], row["itc_mean_r1"]) == (5.0, 3.0, 4.0)
    assert (row["val_mean_r1"], row["val_itc_mean_r1"]) == (16.0, 15.0)
    assert row["probe"] == 0.7 and row["probe_colour"] == 0.9 and row["probe_shape"] == 0.5
    assert abs(row["sampler_share"] - 0.3 / 33.0) < 1e-12  # the batching work over the run's wall clock
    rows, retrieval, probe = _run(0.4, 6.0, 4.0, 0.9)
    rows[1]["epoch_seconds"] = 500.0  # an epoch stretched by a pause: the run's length is 3 x the median
    assert abs(summary_row(rows, retrieval, probe)["sampler_share"] - 0.3 / 36.0) < 1e-12
    assert row["itm_epoch"] == 1  # 0.4 + 0.02: below chance (0.637) by 0.02 from the first epoch on
    slow = summary_row(*_run(0.61, 6.0, 4.0, 0.9))  # loss_itm 0.63, 0.62, 0.61: the third epoch left chance
    assert slow["itm_epoch"] == 3
    assert summary_row(*_run(0.63, 6.0, 4.0, 0.9))["itm_epoch"] == 4  # never: one past the 3 epochs


def test_side_by_side_shows_both_runs_per_epoch_recall_and_probe():
    text = side_by_side({"GRIT-VLP": _run(0.4, 6.0, 4.0, 0.9), "random batches": _run(0.6, 2.0, 3.0, 0.7)})
    lines = text.splitlines()
    assert "GRIT-VLP" in lines[1] and "random batches" in lines[1]
    assert any(line.split()[:3] == ["epoch", "2", "loss_itm"] and line.split()[3:] == ["0.4000", "0.6000"]
               for line in lines)
    mean = next(line for line in lines if line.strip().startswith("mean R@1"))
    assert mean.split()[2:] == ["5.00", "2.50"]
    itc = next(line for line in lines if line.strip().startswith("ITC-only mean R@1"))
    assert itc.split()[3:] == ["4.00", "1.50"]
    colour = next(line for line in lines if line.strip().startswith("colour"))
    assert colour.split()[1:] == ["0.9000", "0.7000"]


def test_read_evaluation_averages_text_and_image_recall_per_split_and_scoring(tmp_path):
    record = {f"{split}_{scoring}{kind}_r1": value for split, base in (("val", 50.0), ("test", 20.0))
              for scoring, shift in (("", 0.0), ("itc_", -5.0)) for kind, value in
              (("txt", base + shift), ("img", base + shift + 2))}
    (tmp_path / "log.txt").write_text(json.dumps(record) + "\n")
    (tmp_path / "probe.json").write_text(json.dumps({"overall": 0.5, "per_kind": {}}))
    retrieval, probe = read_evaluation(str(tmp_path))
    assert (retrieval["val_mean_r1"], retrieval["val_itc_mean_r1"]) == (51.0, 46.0)
    assert (retrieval["test_mean_r1"], retrieval["test_itc_mean_r1"]) == (21.0, 16.0)
    assert probe["overall"] == 0.5


def test_the_learning_rate_is_selected_on_val_never_on_test():
    # Stub runs where val and test disagree: lr 1e-3 is best on val (mean over seeds), 2e-4 on test.
    def row(val: float, test: float) -> dict:
        return {c: 0.5 for c in COLUMNS} | {"val_mean_r1": val, "mean_r1": test, "itc_mean_r1": test,
                                            "val_itc_mean_r1": val, "probe": 0.5}

    sweep = {"GRIT-VLP": {2e-4: {1: row(40.0, 70.0), 2: row(42.0, 72.0)},
                          1e-3: {1: row(45.0, 30.0), 2: row(44.0, 31.0)}},
             "random batches": {2e-4: {1: row(30.0, 10.0), 2: row(10.0, 12.0)},
                                1e-3: {1: row(21.0, 60.0), 2: row(20.0, 61.0)}}}
    text, record = report(sweep, [1, 2])
    # random batches: 2e-4 has the best single val seed (30) but not the best mean (20 against 20.5).
    assert record["selected_lr"] == {"GRIT-VLP": 1e-3, "random batches": 1e-3}
    assert record["summary"]["GRIT-VLP"]["mean_r1"]["mean"] == 30.5
    assert record["gaps"]["GRIT-VLP"]["mean_r1"]["per_seed"] == [-30.0, -30.0]
    assert select_lr({2e-4: [1.0, 3.0], 5e-4: [2.0, 2.5]}) == 5e-4
    assert select_lr({2e-4: [2.0], 5e-4: [2.0]}) == 2e-4  # the first of equal ones
    std = record["summary"]["random batches"]["val_mean_r1"]["std"]
    assert abs(std - statistics.stdev([21.0, 20.0])) < 1e-12  # the sample std, as the README reports
    assert "GRIT-VLP" in text and "<" in text


def test_each_arm_sweeps_the_rate_with_the_schedule_scaled(monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert lr_overrides(1e-3) == ["optimizer.lr=0.001", "schedular.lr=0.001", "schedular.min_lr=0.0001",
                                  "schedular.warmup_lr=0.0001"]
    assert run_dir("/o", "GRIT-VLP M/N=96", 2, 2.5e-4) == "/o/seed2/grit_vlp_m_n_96_lr0.00025"
    assert ARMS["random batches"] == ["batching.strategy=random"]
    # The tiny config is the paper's ratio M/N = 15; the earlier ratio is an arm of its own.
    tiny = resolve_config("pretrain", PRETRAIN_CONFIG, check_paths=False)
    assert tiny.batching.search_space / tiny.batch_size == 15
    assert tiny.batching.queue_size % tiny.batching.search_space == 0
    wide = resolve_config("pretrain", PRETRAIN_CONFIG, ARMS["GRIT-VLP M/N=96"], check_paths=False)
    assert wide.batching.search_space / wide.batch_size == 96


def test_evaluations_get_the_overrides_their_config_accepts():
    from tools.runs import overrides_for

    given = ['vision_stem=conv', 'batching.search_space=120', 'bert_config=/x/bert.json', 'max_epoch=20']
    assert overrides_for('retrieval', given) == ['--set', 'vision_stem=conv', 'bert_config=/x/bert.json',
                                                 'max_epoch=20']
    assert overrides_for('pretrain', given) == ['--set', *given]
    assert overrides_for('retrieval', ['grit.enabled=false', 'batching.strategy=random']) == []
    # The old spelling reaches the pre-training in the new one (new_spelling), not dropped.
    assert overrides_for('pretrain', ['grit.search_space=120', 'grit.enabled=false']) == [
        '--set', 'batching.search_space=120', 'batching.strategy=random']


def test_a_run_made_with_the_old_spelling_is_reused_for_the_new(tmp_path):
    import json

    from tools.runs import saved_result

    old = ['Pretrain', '--config', 'c.yaml', '--output_dir', '/else/where', '--set', 'grit.enabled=false',
           'grit.queue_size=64', 'optimizer.lr=0.001']
    saved = {'command': old, 'log': [], 'retrieval': {}, 'probe': {}}
    (tmp_path / 'result.json').write_text(json.dumps(saved))
    new = ['Pretrain', '--config', 'c.yaml', '--output_dir', str(tmp_path), '--set',
           'batching.strategy=random', 'batching.queue_size=64', 'optimizer.lr=0.001']
    assert saved_result(str(tmp_path), new)['command'] == old
    assert saved_result(str(tmp_path), [*new[:-1], 'optimizer.lr=0.002']) is None


def test_the_downstream_pretraining_is_the_tiny_one_for_longer(monkeypatch):
    # demo --downstream's checkpoint must come from the demo's GRIT-VLP run with a longer schedule only,
    # so that NLVR2 and VQA measure the same model and method (docs/synthetic-world.md, 'NLVR2 on the
    # synthetic data').
    from tools.downstream import DOWNSTREAM_PRETRAIN_CONFIG
    from tools.runs import PRETRAIN_CONFIG, pretrain_command
    from training.config_resolve import resolve_config

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tiny = resolve_config("pretrain", PRETRAIN_CONFIG, check_paths=False)
    long = resolve_config("pretrain", DOWNSTREAM_PRETRAIN_CONFIG, check_paths=False)
    assert long.max_epoch == long.schedular.epochs == 36
    assert tiny.max_epoch == tiny.schedular.epochs == 12
    schedule = dataclasses.replace(long.schedular, epochs=12)
    assert dataclasses.replace(long, max_epoch=12, schedular=schedule) == tiny
    assert long.batching.strategy == "grit"
    assert pretrain_command("out", ["--seed", "1"], DOWNSTREAM_PRETRAIN_CONFIG) == [
        "Pretrain", "--config", "configs/tiny/Pretrain_long.yaml", "--output_dir", "out", "--seed", "1"]


def test_demo_reads_the_trainers_log_keys():
    # The demo's table shows the optimiser steps' time under the name every script logs it.
    import demo

    assert "train_seconds" in demo.COLUMNS and "seconds" not in demo.COLUMNS
    rows = [{"epoch": 0, "loss_itc": 1.0, "loss_cons": 0.0, "loss_itm": 0.6, "loss_mlm": 3.0,
             "hardness": 0.4, "train_seconds": 12.5}]
    assert demo.table(rows, demo.COLUMNS).splitlines()[1].split() == [
        "0", "1.0000", "0.0000", "0.6000", "3.0000", "0.4000", "12.5000"]


def test_a_reused_run_is_read_back_and_keeps_its_log(tmp_path, monkeypatch):
    from tools import runs

    directory = str(tmp_path / "seed1" / "grit_vlp_lr0.0005")
    os.makedirs(os.path.join(directory, "pretrain"))
    log = os.path.join(directory, "pretrain", "log.txt")
    with open(log, "w") as f:
        f.write('{"epoch": 0}\n')
    args = ["--seed", "1"]
    command = runs.pretrain_command(os.path.join(directory, "pretrain"), args, clear=False)
    with open(os.path.join(directory, "result.json"), "w") as f:
        json.dump({"command": command, "log": [{"epoch": 0}], "retrieval": {"r": 1}, "probe": {"p": 2}}, f)

    def no_run(jobs):
        raise AssertionError(f"a reused run must not start: {jobs}")

    monkeypatch.setattr(runs, "run_side_by_side", no_run)
    out = runs.run_pairs({"GRIT-VLP": (directory, args, [])}, reuse=True)
    assert out == {"GRIT-VLP": ([{"epoch": 0}], {"r": 1}, {"p": 2})}
    assert os.path.isfile(log)  # tools.efficiency reads the epochs of a reused run from it

    # the same run in a copied folder (another output_dir) is still that run; another seed is not
    import shutil

    copy = str(tmp_path / "elsewhere" / "seed1" / "grit_vlp_lr0.0005")
    shutil.copytree(directory, copy)
    assert runs.run_pairs({"GRIT-VLP": (copy, args, [])}, reuse=True)["GRIT-VLP"][1] == {"r": 1}
    other = runs.pretrain_command(os.path.join(copy, "pretrain"), ["--seed", "2"], clear=False)
    assert runs.saved_result(copy, other) is None
    spelled = [c if c != "--output_dir" else "--output-dir" for c in command]  # any spelling of the folder
    joined = command[:3] + [f"--output_dir={command[4]}"] + command[5:]
    assert runs._placeless(spelled) == runs._placeless(joined) == runs._placeless(command)


def test_a_run_is_the_same_whatever_the_order_of_its_distinct_overrides(tmp_path):
    # 'GRIT-VLP long warm-up' puts its warm-up before the rate, `--arms GRIT-VLP --set
    # schedular.warmup_steps=363` after it: the same run, reused. A repeated key is order-sensitive (the
    # last one wins), so such commands are compared as given.
    from tools import runs

    arm_first = ["Pretrain", "--config", "c.yaml", "--output_dir", "a", "--seed", "1", "--set",
                 "schedular.warmup_steps=363", "optimizer.lr=0.0005"]
    set_last = ["Pretrain", "--config", "c.yaml", "--output_dir", "b", "--seed", "1", "--set",
                "optimizer.lr=0.0005", "schedular.warmup_steps=363"]
    (tmp_path / "result.json").write_text(json.dumps({"command": arm_first}))
    assert runs.saved_result(str(tmp_path), set_last)["command"] == arm_first
    assert runs.saved_result(str(tmp_path), [*set_last[:-1], "schedular.warmup_steps=726"]) is None
    assert runs.saved_result(str(tmp_path), [*set_last[:7], "--set", "optimizer.lr=0.0005"]) is None
    repeated = [*arm_first[:8], "optimizer.lr=0.001", "optimizer.lr=0.0005"]
    assert runs._placeless(repeated)[-2:] == ["optimizer.lr=0.001", "optimizer.lr=0.0005"]
    assert runs._placeless(repeated) != runs._placeless([*arm_first[:8], "optimizer.lr=0.0005",
                                                         "optimizer.lr=0.001"])
    # Two commands joined into one record (tools.efficiency's timing pairs): each --set group ends where
    # the next command's program begins, and each is put in key order on its own.
    joined = runs._placeless([*arm_first, *set_last])
    assert joined == runs._placeless([*set_last, *arm_first]) == [*runs._placeless(set_last)] * 2
    assert joined[7:10] == ["optimizer.lr=0.0005", "schedular.warmup_steps=363", "Pretrain"]


def _grid_sweep(seeds: list[int], **figures: float) -> dict:
    """Stub summary rows: GRIT-VLP, random batches, and B3 with two settings, of which (5e-4, p=2) is best
    on test and (2.5e-4, p=10) on val (val decides); `figures` replace the other columns' 0.5."""
    def row(val: float, test: float) -> dict:
        return {c: 0.5 for c in COLUMNS} | {"val_mean_r1": val, "mean_r1": test, "itc_mean_r1": test,
                                            "val_itc_mean_r1": val} | figures

    return {"GRIT-VLP": {5e-4: {s: row(50.0, 60.0 + s) for s in seeds}},
            "random batches": {2.5e-4: {s: row(40.0, 50.0) for s in seeds}},
            "B3": {(5e-4, "p=2,m=20"): {s: row(45.0, 90.0) for s in seeds},
                   (2.5e-4, "p=10,m=30"): {s: row(47.0, 55.0 + 2 * s) for s in seeds}}}


def test_new_arms_are_selected_with_their_grid_setting_on_val():
    """An arm with a hyper-parameter grid is selected as a (rate, setting) pair on val alone; the test rows
    at the selection get mean, sample std, median and range, and gaps to GRIT-VLP and to random batches
    paired by seed."""
    from tools.arms import setting_label

    seeds = [1, 2, 3]
    text, record = report(_grid_sweep(seeds), seeds)
    assert record["selected_lr"]["B3"] == [2.5e-4, "p=10,m=30"]
    b3 = record["summary"]["B3"]
    assert b3["setting"] == "p=10,m=30" and b3["lr"] == 2.5e-4
    assert (b3["mean_r1"]["median"], b3["mean_r1"]["min"], b3["mean_r1"]["max"]) == (59.0, 57.0, 61.0)
    assert record["gaps_to"]["GRIT-VLP"]["B3"]["mean_r1"]["per_seed"] == [-4.0, -3.0, -2.0]
    assert record["gaps"]["B3"]["mean_r1"]["per_seed"] == [7.0, 9.0, 11.0]  # to random batches
    assert setting_label((2.5e-4, "p=10,m=30")) == "0.00025 p=10,m=30" and setting_label(5e-4) == "0.0005"
    marked = [line for line in text.splitlines() if line.rstrip().endswith("<")]
    assert any(line.split()[0] == "B3" and "p=10,m=30" in line for line in marked), marked


def test_the_sigmoid_arms_are_paired_with_each_other():
    """GRIT-VLP + sigmoid's gap is also reported against random + sigmoid (issue 50: does grouping help
    the sigmoid loss?), paired by seed."""
    seeds = [1, 2]
    sweep = _grid_sweep(seeds)
    rows = sweep["GRIT-VLP"][5e-4]
    sweep["GRIT-VLP + sigmoid"] = {5e-4: {s: v | {"mean_r1": 30.0 + s} for s, v in rows.items()}}
    sweep["random + sigmoid"] = {5e-4: {s: v | {"mean_r1": 31.0} for s, v in rows.items()}}
    _, record = report(sweep, seeds)
    assert record["gaps_to"]["random + sigmoid"]["GRIT-VLP + sigmoid"]["mean_r1"]["per_seed"] == [0.0, 1.0]


def test_the_markdown_table_shows_each_arm_at_its_selection_with_spread_gap_and_cost(monkeypatch):
    from tools.compare_tables import markdown_table

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    seeds = [1, 2, 3]
    _, record = report(_grid_sweep(seeds, batch_same_scene=float("nan")), seeds)
    record["seeds"] = seeds
    lines = markdown_table(record, {"grit": 0.0041, "b3": 0.00833}).splitlines()
    b3 = next(line for line in lines if line.startswith("| B3 |")).split(" | ")
    assert b3[1] == "lr 0.00025, p=10,m=30"  # the selection on val, not the best test
    assert b3[2] == "59.00 ± 2.00<br>59.00 [57.00, 61.00]"  # mean ± sample std, median [min, max]
    assert "–" in b3  # a figure the runs did not have (nan) is a dash, not a number
    # to GRIT-VLP, paired by seed: mean, 95 % t interval (-3 ± t(0.975, 2)·1/√3), sign count, per seed
    assert b3[-2] == "-3.00 [-5.48, -0.52]<br>ahead on 0 of 3 seeds<br>(-4.0, -3.0, -2.0)"
    assert b3[-1] == "0.83 % |"
    rand = next(line for line in lines if line.startswith("| random batches |"))
    assert rand.endswith("| 0.00 % |")  # random batches group nothing
    assert "cost" not in markdown_table(record)  # no benchmark: no cost column
    _, one = report(_grid_sweep([1]), [1])
    one["seeds"] = [1]
    lines = markdown_table(one).splitlines()
    assert lines[0] == "one seed (1): its values"  # no spread claimed for one seed
    b3 = next(line for line in lines if line.startswith("| B3 |")).split(" | ")
    assert b3[2] == "57.00" and b3[-1] == "-4.00 |"  # its value and its gap, no "± nan"
    from tools.arms import setting_label
    from tools.compare_tables import sweep_table

    record["sweep"] = {arm: {setting_label(k): rows for k, rows in by.items()}
                       for arm, by in _grid_sweep(seeds).items()}
    sweep = sweep_table(record).splitlines()
    assert "| **B3** | **0.00025 p=10,m=30** | **47.00** | **59.00** |" in sweep  # selected on val: bold
    assert "| B3 | 0.0005 p=2,m=20 | 45.00 | 90.00 |" in sweep  # the best test, not selected


def test_costs_come_from_the_strategy_benchmark_and_a_bad_file_is_named(tmp_path):
    import pytest

    from grit_io import InputFileError
    from tools.compare_tables import read_costs

    good = tmp_path / "bench.json"
    good.write_text(json.dumps({"strategies": [{"strategy": "b3", "share_of_step": 0.0083}]}))
    assert read_costs(str(good)) == {"b3": 0.0083}
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(InputFileError, match="other.json"):
        read_costs(str(bad))
    with pytest.raises(InputFileError, match="missing.json"):
        read_costs(str(tmp_path / "missing.json"))


def test_the_selected_runs_are_the_sweeps_own_folders_and_commands(tmp_path, monkeypatch, capsys):
    """--selected (the final rows on more seeds, a hidden seed) runs each arm exactly as its sweep ran the
    selection, in the same folder, so --reuse keeps the sweep's seeds; a grid arm without its selected
    setting is refused."""
    import pytest

    from tools import arms, compare

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(compare, "prepare_pretraining", lambda overrides=(), config=None: None)
    asked = []

    def fake_pairs(runs, reuse=False, corpus=None):  # the results in the reverse order, as reuse may give
        asked.append(runs)
        return {key: _run(0.4, 6.0, 4.0, 0.9) for key in reversed(list(runs))}

    monkeypatch.setattr(compare, "run_pairs", fake_pairs)
    out = str(tmp_path / "cmp")
    record = compare.main(["--seeds", "2", "1", "--lrs", "5e-4", "2.5e-4", "--arms", "B3", "--output_dir",
                           out, "--epochs", "12"])
    # the record's sweep by rate, then grid order, its seeds ascending, whatever order the runs came back in
    assert list(record["sweep"]["B3"]) == [
        "0.00025 p=2,m=20", "0.00025 p=10,m=30", "0.0005 p=2,m=20", "0.0005 p=10,m=30"]
    assert all(list(rows) == [1, 2] for rows in record["sweep"]["B3"].values())
    monkeypatch.setitem(arms.SELECTED_LR, "B3", 5e-4)
    monkeypatch.delitem(arms.SELECTED_SETTING, "B3", raising=False)
    with pytest.raises(SystemExit):  # the rate alone is not B3's selection
        compare.main(["--seeds", "1", "--selected", "--arms", "B3", "--output_dir", out, "--epochs", "12"])
    monkeypatch.setitem(arms.SELECTED_SETTING, "B3", "p=2,m=20")
    compare.main(["--seeds", "1", "--selected", "--arms", "B3", "--output_dir", out, "--epochs", "12"])
    sweep, selected = asked[0], asked[-1]
    assert len(sweep) == 8 and list(selected) == [("B3", 5e-4, "p=2,m=20", 1)]
    assert selected[("B3", 5e-4, "p=2,m=20", 1)] == sweep[("B3", 5e-4, "p=2,m=20", 1)]
    assert os.path.isfile(os.path.join(out, "compare.md"))
    # --set max_epoch=24: the 24-epoch sweep's selection (SELECTED_LR_24), never the 12-epoch one
    monkeypatch.setitem(arms.SELECTED_LR_24, "B3", 2.5e-4)
    longer = ["max_epoch=24", "schedular.epochs=24"]
    compare.main(["--seeds", "1", "--selected", "--arms", "B3", "--output_dir", str(tmp_path / "e24"),
                  "--set", *longer])
    assert list(asked[-1]) == [("B3", 2.5e-4, "p=2,m=20", 1)]
    assert asked[-1][("B3", 2.5e-4, "p=2,m=20", 1)][1][-2:] == longer
    # 24 epochs are the comparison's default (issue 49): the runs, folders and record --set spelled
    spelled, spelled_record = asked[-1], json.load(open(tmp_path / "e24" / "compare.json"))
    for default in ([], ["--epochs", "24"]):
        compare.main(["--seeds", "1", "--selected", "--arms", "B3", "--output_dir", str(tmp_path / "e24"),
                      *default])
        assert asked[-1] == spelled
        assert json.load(open(tmp_path / "e24" / "compare.json")) == spelled_record
    assert spelled_record["epochs"] == 24 and spelled_record["overrides"] == longer
    # a run's folder does not name its schedule: the default folders do, so that the two never overwrite
    monkeypatch.chdir(tmp_path)
    for epochs, folder in (([], "compare_e24"), (["--epochs", "12"], "compare")):
        compare.main(["--seeds", "1", "--selected", "--arms", "B3", *epochs])
        (run, _, _), = asked[-1].values()
        assert run.startswith(os.path.join(str(tmp_path), "output", folder, "seed1"))
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with pytest.raises(SystemExit):  # one schedule, not two
        compare.main(["--seeds", "1", "--selected", "--arms", "B3", "--output_dir", str(tmp_path / "e24"),
                      "--epochs", "24", "--set", *longer])
    assert "both set the schedule" in capsys.readouterr().err
    # a schedule cut short of its cosine (or stretched) was never swept: refused, not given max_epoch's rate
    n = len(asked)
    for cut in (["max_epoch=24"], ["schedular.epochs=24"]):
        with pytest.raises(SystemExit):
            compare.main(["--seeds", "1", "--selected", "--arms", "B3", "--output_dir", str(tmp_path / "e24"),
                          "--set", *cut])
        assert "the selections were swept with the two equal" in capsys.readouterr().err
    assert len(asked) == n
    monkeypatch.delitem(arms.SELECTED_LR_24, "B3")
    with pytest.raises(SystemExit):
        compare.main(["--seeds", "1", "--selected", "--arms", "B3", "--output_dir", str(tmp_path / "e24"),
                      "--set", *longer])
    # --corpus real: the real corpora's own selection, not the synthetic one
    monkeypatch.setitem(arms.SELECTED_LR_REAL, "B3", 1e-3)
    compare.main(["--corpus", "real", "--seeds", "1", "--selected", "--arms", "B3", "--output_dir",
                  str(tmp_path / "real")])
    assert list(asked[-1]) == [("B3", 1e-3, "p=2,m=20", 1)]
    # --selected_settings sweeps the rates at the selected setting: it needs no selected rate yet
    monkeypatch.delitem(arms.SELECTED_LR_REAL, "B3")
    compare.main(["--corpus", "real", "--seeds", "1", "--lrs", "2.5e-4", "5e-4", "--selected_settings",
                  "--arms", "B3", "--output_dir", str(tmp_path / "real_sweep")])
    assert sorted(asked[-1]) == [("B3", 2.5e-4, "p=2,m=20", 1), ("B3", 5e-4, "p=2,m=20", 1)]
    monkeypatch.delitem(arms.SELECTED_SETTING, "B3")
    with pytest.raises(SystemExit):  # but a grid arm's setting must have been selected
        compare.main(["--seeds", "1", "--lrs", "2.5e-4", "--selected_settings", "--arms", "B3",
                      "--output_dir", str(tmp_path / "no_setting")])


def test_seeds_run_in_parallel_into_one_folder_keep_each_its_own_record(tmp_path, monkeypatch):
    """While one comparison writes <output_dir>/compare.json, a second one into the same folder is refused
    before it runs anything (it would overwrite the first's record on finishing); with its own --record it
    runs, shares the folder's runs and writes <record>.json and <record>.md beside the first's."""
    import pytest

    from grit_io import InputFileError
    from tools import compare
    from tools.cli import record_claim

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(compare, "prepare_pretraining", lambda overrides=(), config=None: None)
    asked = []

    def fake_pairs(runs, reuse=False, corpus=None):
        asked.append(runs)
        return {key: _run(0.4, 6.0, 4.0, 0.9) for key in runs}

    monkeypatch.setattr(compare, "run_pairs", fake_pairs)
    out = str(tmp_path / "cmp")
    argv = ["--seeds", "3", "--lrs", "5e-4", "--arms", "GRIT-VLP", "--output_dir", out, "--epochs", "12"]
    with record_claim(out, "compare", "tools.compare"):  # the seed-2 comparison, still running
        with pytest.raises(InputFileError, match="compare.json: python -m tools.compare"):
            compare.main(argv)
        assert asked == []
        record = compare.main([*argv, "--record", "compare_seed3"])
    assert list(asked[0]) == [("GRIT-VLP", 5e-4, None, 3)]
    assert asked[0][("GRIT-VLP", 5e-4, None, 3)][0] == run_dir(out, "GRIT-VLP", 3, 5e-4, None)
    folder = tmp_path / "cmp"
    assert json.loads((folder / "compare_seed3.json").read_text())["seeds"] == record["seeds"] == [3]
    # a mistake found before any run (here a missing --merge file) claims nothing: no folder is made
    fresh = tmp_path / "mistake"
    with pytest.raises((InputFileError, FileNotFoundError), match="missing.json"):
        compare.main([*argv[:-4], "--output_dir", str(fresh), "--epochs", "12", "--merge",
                      str(tmp_path / "missing.json")])
    assert not fresh.exists()
    assert (folder / "compare_seed3.md").is_file() and not (folder / "compare.json").exists()


def test_merged_rows_are_read_not_run_and_a_foreign_record_is_named(tmp_path, monkeypatch):
    """--merge: the rows an earlier compare.json holds are taken from it (null back to nan) and only the rest
    is run; the record says which came from where; a record made with other --set overrides, or holding
    other figures for a row another file holds, is refused naming the file."""
    import pytest

    from grit_io import InputFileError
    from tools import compare, records

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(compare, "prepare_pretraining", lambda overrides=(), config=None: None)
    asked = []

    def fake_pairs(runs, reuse=False, corpus=None):
        asked.append(sorted(runs))
        return {key: _run(0.4, 6.0 + key[3], 4.0, 0.9) for key in runs}

    monkeypatch.setattr(compare, "run_pairs", fake_pairs)
    first = str(tmp_path / "first")
    arms = ["--arms", "GRIT-VLP", "random batches", "--epochs", "12"]
    compare.main(["--seeds", "1", "--selected", *arms, "--output_dir", first])
    earlier = os.path.join(first, "compare.json")
    with open(earlier) as f:
        saved = json.load(f)
    assert saved["sweep"]["random batches"]["0.00025"]["1"]["batch_groups"] is None  # nan written as null
    out = str(tmp_path / "both")
    record = compare.main(["--seeds", "1", "2", "--selected", *arms, "--output_dir", out, "--merge", earlier])
    assert [key[3] for key in asked[-1]] == [2, 2]  # seed 1 of both arms was read, not run
    row = record["sweep"]["GRIT-VLP"]["0.0005"]
    written = saved["sweep"]["GRIT-VLP"]["0.0005"]["1"]
    assert {k: v for k, v in row[1].items() if v == v} == {k: v for k, v in written.items() if v is not None}
    assert math.isnan(row[1]["batch_groups"]) and row[2]["txt_r1"] == 8.0
    assert record["summary"]["GRIT-VLP"]["txt_r1"]["mean"] == 7.5
    assert record["merged_from"] == {"files": [earlier], "rows": {"GRIT-VLP": {"0.0005": [1]},
                                                                  "random batches": {"0.00025": [1]}}}
    assert "not run: GRIT-VLP 0.0005 seeds 1; random batches 0.00025 seeds 1" in open(
        os.path.join(out, "compare.md")).read()
    with pytest.raises(InputFileError, match="compare.json: made with --set"):
        compare.main(["--seeds", "1", "--selected", "--arms", "GRIT-VLP", "--output_dir", out,
                      "--merge", earlier, "--epochs", "12", "--set", "schedular.warmup_steps=40"])
    with pytest.raises(InputFileError, match=r"compare.json: made with --set \[\], this comparison with "
                                             r"--set \['max_epoch=24', 'schedular.epochs=24'\]"):
        compare.main(["--seeds", "1", "--selected", "--arms", "GRIT-VLP", "--output_dir", out,
                      "--merge", earlier])  # a 12-epoch record in the default, 24-epoch comparison
    saved["sweep"]["GRIT-VLP"]["0.0005"]["1"]["txt_r1"] = 1.0
    other = tmp_path / "other.json"
    other.write_text(json.dumps(saved))
    assert records.merged_rows([earlier, earlier], [])  # the same rows twice (nulls included) agree
    with pytest.raises(InputFileError, match="other.json: GRIT-VLP 0.0005 seed 1 differs"):
        records.merged_rows([earlier, str(other)], [])
    not_compare = tmp_path / "eff.json"
    not_compare.write_text(json.dumps({"curves": {}}))
    with pytest.raises(InputFileError, match="eff.json: not a tools.compare record"):
        records.merged_rows([str(not_compare)], [])


def test_the_real_corpus_runs_its_own_configs_and_its_records_do_not_mix_with_synthetic_ones(tmp_path,
                                                                                             monkeypatch):
    """--corpus real pre-trains configs/real/Pretrain.yaml (the rate scaled onto its schedule) and evaluates
    with the real corpus's retrieval configs; --selected_settings sweeps a grid arm's rates at its selected
    setting only (as many runs as an arm without a grid); a synthetic record is refused as --merge input."""
    import pytest

    from grit_io import InputFileError
    from tools import compare, runs

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    prepared, asked = [], []
    monkeypatch.setattr(compare, "prepare_pretraining",
                        lambda overrides=(), config=None: prepared.append(config))

    def fake_pairs(todo, reuse=False, corpus=None):
        asked.append((todo, corpus))
        out = {}
        for key in todo:
            rows, retrieval, _ = _run(0.4, 6.0, 4.0, 0.9)
            retrieval.update({"artist_txt_r1": 3.0, "artist_img_r1": 5.0, "artist_mean_r1": 4.0,
                              "artist_itc_txt_r1": 2.0, "artist_itc_img_r1": 4.0, "artist_itc_mean_r1": 3.0})
            out[key] = (rows, retrieval, {})
        return out

    monkeypatch.setattr(compare, "run_pairs", fake_pairs)
    out = str(tmp_path / "real")
    record = compare.main(["--corpus", "real", "--seeds", "1", "--lrs", "2.5e-4", "1e-3",
                           "--selected_settings", "--arms", "GRIT-VLP", "B3", "--output_dir", out])
    todo, corpus = asked[-1]
    assert prepared == ["configs/real/Pretrain.yaml"] and corpus is runs.CORPORA["real"]
    assert sorted((arm, lr, setting) for arm, lr, setting, _ in todo) == [
        ("B3", 2.5e-4, "p=2,m=20"), ("B3", 1e-3, "p=2,m=20"), ("GRIT-VLP", 2.5e-4, None),
        ("GRIT-VLP", 1e-3, None)]
    args = todo[("GRIT-VLP", 1e-3, None, 1)][1]
    assert all(a in args for a in lr_overrides(1e-3, "configs/real/Pretrain.yaml"))
    assert record["corpus"] == "real" and math.isnan(record["summary"]["B3"]["probe"]["mean"])
    assert record["summary"]["B3"]["artist_mean_r1"]["mean"] == 4.0  # the held-out artist's own columns
    assert "artist test mean R@1, re-ranked" in open(os.path.join(out, "compare.md")).read()
    synthetic = str(tmp_path / "synthetic")
    compare.main(["--seeds", "1", "--selected", "--arms", "GRIT-VLP", "--output_dir", synthetic])
    with pytest.raises(InputFileError, match="made on the synthetic corpus"):
        compare.main(["--corpus", "real", "--seeds", "1", "--selected", "--arms", "GRIT-VLP",
                      "--output_dir", out, "--merge", os.path.join(synthetic, "compare.json")])
    with pytest.raises(SystemExit):  # both would hold the settings: one of them
        compare.main(["--seeds", "1", "--selected", "--selected_settings", "--output_dir", out])


def test_online_arms_get_their_reference_trained_first_and_reported(tmp_path, monkeypatch):
    """JEST and RHO-LOSS: tools.compare trains the reference model (tools.arms.REFERENCE: random batches
    at its selected rate, seed 1000) in <output_dir>/reference/ before the arms, names its last checkpoint
    in their batching.<strategy>.reference, and reports it in the record; other arms get no reference."""
    from tools import arms, compare

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(compare, "prepare_pretraining", lambda overrides=(), config=None: None)
    monkeypatch.setattr(compare, "last_checkpoint",
                        lambda directory: os.path.join(directory, "checkpoint_11.pth"))
    asked = []

    def fake_pairs(runs, reuse=False, corpus=None):
        asked.append({key: (d, list(a)) for key, (d, a, _) in runs.items()})
        return {key: _run(0.4, 6.0, 4.0, 0.9) for key in runs}

    monkeypatch.setattr(compare, "run_pairs", fake_pairs)
    out = str(tmp_path / "cmp")
    record = compare.main(["--seeds", "1", "--lrs", "5e-4", "--arms", "JEST", "random batches", "RHO-LOSS",
                           "--output_dir", out, "--epochs", "12"])
    reference, arms_run = asked
    directory, args = reference["reference"]
    assert directory == os.path.join(out, "reference") and args[:2] == ["--seed", "1000"]
    assert args[3:] == arms.arm_overrides("random batches", arms.SELECTED_LR["random batches"], None)
    checkpoint = os.path.join(out, "reference", "pretrain", "checkpoint_11.pth")
    assert arms_run[("JEST", 5e-4, None, 1)][1][-1] == f"batching.jest.reference={checkpoint}"
    assert arms_run[("RHO-LOSS", 5e-4, None, 1)][1][-1] == f"batching.rho.reference={checkpoint}"
    assert not any("reference" in a for a in arms_run[("random batches", 5e-4, None, 1)][1])
    assert record["reference"]["checkpoint"] == checkpoint and record["reference"]["seed"] == 1000
    import pytest
    # a schedule would replace their equal-compute epochs: refused, the comparison's default 24 included
    for schedule in (["--set", "max_epoch=24"], ["--set", "scheduler.epochs=24"], [], ["--epochs", "24"]):
        with pytest.raises(SystemExit):
            compare.main(["--seeds", "1", "--lrs", "5e-4", "--arms", "JEST", "--output_dir", out, *schedule])
    assert len(asked) == 2  # refused before anything ran


def test_the_default_schedule_names_itself_where_it_refuses_and_merges(tmp_path, monkeypatch, capsys):
    """The comparison's default 24 epochs: a refusal of the online arms names where the schedule came from;
    a 24-epoch record made with --set spelling the schedule and another item in another order merges; a record
    of another schedule is refused with the --epochs that would take it; the real corpus's default folder is
    its own."""
    import pytest

    from grit_io import InputFileError
    from tools import compare

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(compare, "prepare_pretraining", lambda overrides=(), config=None: None)
    asked = []

    def fake_pairs(runs, reuse=False, corpus=None):
        asked.append(runs)
        return {key: _run(0.4, 6.0 + key[3], 4.0, 0.9) for key in runs}

    monkeypatch.setattr(compare, "run_pairs", fake_pairs)
    for flags, source in (([], "the default --epochs 24"), (["--epochs", "24"], "--epochs 24"),
                          (["--set", "max_epoch=24"], "--set max_epoch=24")):
        with pytest.raises(SystemExit):
            compare.main(["--seeds", "1", "--lrs", "5e-4", "--arms", "JEST", "--output_dir", str(tmp_path),
                          *flags])
        assert f"error: {source}: JEST run at equal compute" in capsys.readouterr().err
    # a record spelt --set max_epoch=24 schedular.epochs=24 amp=bf16 before the default, read in another order
    spelled = str(tmp_path / "spelled")
    compare.main(["--seeds", "1", "--selected", "--arms", "GRIT-VLP", "--output_dir", spelled, "--set",
                  "amp=bf16", "max_epoch=24", "schedular.epochs=24"])
    n = len(asked)
    earlier = os.path.join(spelled, "compare.json")
    record = compare.main(["--seeds", "1", "--selected", "--arms", "GRIT-VLP", "--output_dir",
                           str(tmp_path / "b"), "--set", "amp=bf16", "--merge", earlier])
    assert len(asked) == n and record["merged_from"]["rows"] == {"GRIT-VLP": {"0.00025": [1]}}
    with pytest.raises(InputFileError, match=r"come from the default --epochs 24; --epochs 12 for a record"):
        compare.main(["--seeds", "1", "--selected", "--arms", "GRIT-VLP", "--output_dir", str(tmp_path / "c"),
                      "--merge", os.path.join(spelled, "compare.json")])
    monkeypatch.chdir(tmp_path)
    from tools import arms

    monkeypatch.setitem(arms.SELECTED_LR_REAL, "GRIT-VLP", 2.5e-4)
    compare.main(["--corpus", "real", "--seeds", "1", "--selected", "--arms", "GRIT-VLP"])
    (run, _, _), = asked[-1].values()
    assert run.startswith(os.path.join(str(tmp_path), "output", "compare_real", "seed1"))
