"""tools.downstream on hand-made runs (no training): the table, and which pre-trainings --reuse keeps."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from tools import downstream


def _row(dev: float) -> dict:
    return {"loss_itm": 0.3, "ta_acc": 0.65, "nlvr_epoch": 15, "nlvr_dev": dev, "nlvr_test": dev - 0.02,
            "vqa_test": 0.74, "vqa_majority": 0.138}


def test_the_table_has_a_row_per_seed_and_each_arms_mean_and_std():
    text = downstream.markdown({"GRIT-VLP": {1: _row(0.66), 2: _row(0.70)},
                                "random batches": {1: _row(0.55)}})
    lines = text.splitlines()
    assert "| GRIT-VLP | 1 | 0.300 | 0.650 | 15 | 0.660 | 0.640 | 0.740 |" in lines
    mean = next(line for line in lines if line.startswith("| GRIT-VLP | mean ± std |"))
    assert mean.startswith("| GRIT-VLP | mean ± std | 0.300 ± 0.000 | 0.650 ± 0.000 | 15.0 | 0.680 ± 0.028 |")
    assert not any(line.startswith("| random batches | mean") for line in lines)  # one seed: no spread
    assert "majority answer scores 0.138" in text


def test_the_gap_to_random_batches_is_paired_by_seed_with_its_t_interval():
    from scipy import stats

    # the docs' 36-epoch NLVR2 test-P: GRIT-VLP 0.657 / 0.592 / 0.645, random batches 0.598 / 0.588 / 0.565
    def row(test):
        return {**_row(0.6), "nlvr_test": test}
    rows = {"GRIT-VLP": {1: row(0.657), 2: row(0.592), 3: row(0.645)},
            "random batches": {1: row(0.598), 2: row(0.588), 3: row(0.565), 4: row(0.5)}}
    gaps = downstream.downstream_gaps(rows)
    assert list(gaps) == ["GRIT-VLP"]  # the baseline has no gap to itself
    g = gaps["GRIT-VLP"]["nlvr_test"]
    assert g["seeds"] == [1, 2, 3]  # seed 4 only the baseline ran
    assert [round(v, 9) for v in g["per_seed"]] == [0.059, 0.004, 0.08]
    low, high = stats.t.interval(0.95, 2, loc=statistics.fmean(g["per_seed"]), scale=stats.sem(g["per_seed"]))
    assert abs(g["low"] - low) < 1e-12 and abs(g["high"] - high) < 1e-12
    assert (round(g["low"], 3), round(g["high"], 3), g["ahead"], g["behind"]) == (-0.05, 0.145, 3, 0)
    assert gaps["GRIT-VLP"]["nlvr_dev"]["per_seed"] == [0.0, 0.0, 0.0]
    text = downstream.markdown(rows)
    assert ("| GRIT-VLP | NLVR2 test-P | +0.048 [-0.050, +0.145] | 3 / 0 of 3 | +0.059, +0.004, +0.080 |"
            in text)
    assert downstream.downstream_gaps({"GRIT-VLP": rows["GRIT-VLP"]}) == {}  # no baseline, no gaps


def test_reuse_keeps_a_finished_pretraining_and_reruns_the_rest(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    epochs = 36
    done, todo = str(tmp_path / "done"), str(tmp_path / "todo")
    command = downstream.pretrain_command(os.path.join(done, "pretrain_long"), ["--seed", "1"],
                                          downstream.DOWNSTREAM_PRETRAIN_CONFIG, clear=False)

    def write_run(directory: str, n: int) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "log.txt"), "w") as f:
            f.writelines(json.dumps({"epoch": e}) + "\n" for e in range(n))

    write_run(os.path.join(done, "pretrain_long"), epochs)
    with open(os.path.join(done, "pretrain_long", "result.json"), "w") as f:
        json.dump({"command": command}, f)
    write_run(os.path.join(todo, "pretrain_long"), 5)  # cut short: run again from the start
    started = []

    def fake_runs(jobs, threads=None):
        assert threads == 1  # every run on one thread, the lone one too
        for cmd, _ in jobs:
            started.append(cmd)
            write_run(cmd[cmd.index("--output_dir") + 1], epochs)

    monkeypatch.setattr(downstream, "run_side_by_side", fake_runs)
    checkpoints = downstream.pretrain_for_downstream([done, todo], [1, 2], reuse=True, threads=1)
    assert [c[c.index("--output_dir") + 1] for c in started] == [os.path.join(todo, "pretrain_long")]
    assert checkpoints == [os.path.join(d, "pretrain_long", "checkpoint_35.pth") for d in (done, todo)]
    with open(os.path.join(todo, "pretrain_long", "result.json")) as f:
        assert json.load(f)["command"][-2:] == ["--seed", "2"]
    started.clear()
    downstream.pretrain_for_downstream([done], [1], reuse=False, threads=1)  # without --reuse: anew
    assert len(started) == 1


def test_only_arms_with_a_selected_rate_are_offered():
    parser = downstream.build_parser()
    assert parser.parse_args(["--seeds", "1"]).arms == ["GRIT-VLP", "random batches"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--seeds", "1", "--arms", "ALBEF_Base"])
