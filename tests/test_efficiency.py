"""tools.efficiency: the reach table on hand-made curves, and the whole command on the micro preset."""

from __future__ import annotations

import json
import os

import pytest

from tools import efficiency


def _curve(scores: list[float], seconds_per_epoch: float) -> list[dict]:
    return [{"epoch": i + 1, "seconds": seconds_per_epoch * (i + 1), "time_epochs": 1.25 * (i + 1),
             "mean_r1": s, "itc_mean_r1": s / 2} for i, s in enumerate(scores)]


def test_grit_reaches_albef_bases_final_recall_at_the_first_epoch_at_or_above_it():
    curves = {"ALBEF_Base": {1: _curve([10, 20, 30], 10.0), 2: _curve([12, 22, 40], 10.0)},
              "GRIT-VLP": {1: _curve([15, 30, 35], 8.0), 2: _curve([20, 30, 39], 8.0)}}
    text, reach = efficiency.curves_table(curves, [1, 2])
    grit = reach["mean_r1"]["GRIT-VLP"]
    assert grit[1] == {"target": 30, "target_epoch": 3, "target_seconds": 30.0, "epoch": 2, "seconds": 16.0,
                       "time_epochs": 2.5, "seconds_ratio": 16.0 / 30.0}
    assert "| 1 | mean_r1 | 30.00 (epoch 3) | 30 | 2 (2.50) | 16 |" in text
    assert grit[2]["epoch"] is None  # 39 < 40: never reached, said so
    assert reach["itc_mean_r1"]["GRIT-VLP"][1]["epoch"] == 2  # against ALBEF_Base's ITC-only final
    assert "not reached" in text
    assert "| 2 | 21.00 ± 1.41 | 20 | 30.00 ± 0.00 | 16 |" in text  # mean ± sample std, mean seconds
    assert efficiency.epochs_to_reach(_curve([1, 5, 5], 1.0), 5)["epoch"] == 2


def test_every_other_arm_is_measured_against_albef_base_at_its_selection(monkeypatch):
    """A strategy arm gets its own reach columns, against the same seed's ALBEF_Base; it runs at its rate
    and grid setting selected on val, and an arm without a selection is refused with a message."""
    curves = {"ALBEF_Base": {1: _curve([10, 20, 30], 10.0)}, "GRIT-VLP": {1: _curve([15, 30, 35], 8.0)},
              "B3": {1: _curve([31, 32, 33], 9.0)}}
    text, reach = efficiency.curves_table(curves, [1])
    assert reach["mean_r1"]["B3"][1]["epoch"] == 1 and reach["mean_r1"]["GRIT-VLP"][1]["epoch"] == 2
    assert "B3 epoch" in text and "ALBEF_Base epoch" not in text
    from tools import arms

    monkeypatch.setitem(arms.SELECTED_LR, "B3", 5e-4)
    monkeypatch.setitem(arms.SELECTED_SETTING, "B3", "p=2,m=20")
    assert efficiency.arm_run("B3") == (5e-4, "p=2,m=20")
    assert efficiency.arm_run("ALBEF_Base") == (arms.SELECTED_LR["random batches"], None)
    monkeypatch.delitem(arms.SELECTED_SETTING, "B3")
    # its rate alone is not B3's selection
    with pytest.raises(ValueError, match="'B3' has a grid but no selected setting yet"):
        efficiency.arm_run("B3")
    monkeypatch.delitem(arms.SELECTED_LR, "B3")
    with pytest.raises(ValueError, match="'B3' has no selected rate yet"):
        efficiency.arm_run("B3")


def test_time_in_epochs_adds_the_strategys_work_over_the_runs_median_step_time(tmp_path):
    """A point's time_epochs: its epochs plus the strategy's own seconds so far over the median step time of
    the run's epochs (epoch_seconds less sampler_seconds), so that an epoch stretched by a busy machine moves
    the seconds but not the time in epochs."""
    zero = tmp_path / "zeroshot_e01"
    zero.mkdir()
    scores = {f"{split}_{scoring}{d}_r1": 50.0 for split in ("val", "test") for scoring in ("", "itc_")
              for d in ("txt", "img")}
    (zero / "log.txt").write_text(json.dumps(scores) + "\n")
    log = [{"epoch": 0, "epoch_seconds": 10.0, "sampler_seconds": 0.5},
           {"epoch": 1, "epoch_seconds": 100.0, "sampler_seconds": 1.0},  # a paused epoch
           {"epoch": 2, "epoch_seconds": 11.0, "sampler_seconds": 1.0}]
    p = efficiency.point(str(tmp_path), 1, log)
    assert p["epoch"] == 2 and p["seconds"] == pytest.approx(110.0)
    assert p["time_epochs"] == pytest.approx(2 + 1.5 / 10.0)  # median of 9.5, 99, 10
    assert p["mean_r1"] == p["itc_mean_r1"] == 50.0


def test_a_points_flops_are_each_epochs_steps_times_its_steps_count(tmp_path):
    zero = tmp_path / "zeroshot"
    zero.mkdir()
    scores = {f"{split}_{scoring}{d}_r1": 50.0 for split in ("val", "test") for scoring in ("", "itc_")
              for d in ("txt", "img")}
    (zero / "log.txt").write_text(json.dumps(scores) + "\n")
    log = [{"epoch": e, "step": step, "epoch_seconds": 10.0} for e, step in enumerate((90, 181, 270))]
    p = efficiency.point(str(tmp_path), 2, log, [2.0, 2.0, 5.0], batch_size=8)
    assert p["flops"] == (90 * 2.0 + 91 * 2.0 + 89 * 5.0) * 8
    assert "flops" not in efficiency.point(str(tmp_path), 2, log)  # as an older record's points


def test_each_epoch_is_counted_at_its_own_step(in_repo):
    """image_token_drop with one unmasked epoch: the masked step's count until the last epoch, then the full
    step's, which is the count of the same config without the switch."""
    from conftest import tiny_config

    from tools.step_measure import step_flops_per_sample

    config = tiny_config("pretrain", image_token_drop=0.5, unmasked_epochs=1, max_epoch=3)
    flops = efficiency.epoch_flops(config)
    full = step_flops_per_sample(tiny_config("pretrain", max_epoch=3))
    assert flops[2] == full and flops[0] == flops[1] < full
    assert efficiency.epoch_flops(tiny_config("pretrain", max_epoch=3)) == [full] * 3


def test_compute_to_target_is_a_ratio_to_albef_bases_whole_run():
    from tools.efficiency_tables import compute_table, reach_entry

    base = {"epoch": 12, "seconds": 100.0, "flops": 400.0, "mean_r1": 40.0}
    hit = {"epoch": 3, "seconds": 30.0, "flops": 100.0, "mean_r1": 41.0}
    entry = reach_entry(hit, base, "mean_r1", "seconds")
    assert entry["flops_ratio"] == 0.25 and entry["seconds_ratio"] == 0.3 and entry["target_flops"] == 400.0
    missed = reach_entry(None, base, "mean_r1", "seconds")
    assert missed["flops_ratio"] is None and missed["seconds_ratio"] is None and missed["epoch"] is None
    older = reach_entry({k: v for k, v in hit.items() if k != "flops"}, base, "mean_r1", "seconds")
    assert "flops_ratio" not in older  # a merged older record's point has no FLOPs
    second = reach_entry({**hit, "flops": 200.0, "seconds": 50.0}, base, "mean_r1", "seconds")
    text = compute_table({"mean_r1": {"GRIT-VLP": {1: entry, 2: second, 3: missed}}}, "seconds")
    # a seed that never reached: not below 1, and no interval (its ratio is unknown, above 1 at least)
    assert ("| mean_r1 | GRIT-VLP | 0.375 ± 0.177 | 0.400 ± 0.141 | 2 of 3 | 0.375 over the 2 reached, 2 of "
            "3 below 1 | 0.400 over the 2 reached, 2 of 3 below 1 |") in text


def test_compute_to_target_interval_against_hand_values_and_scipy():
    """Every seed reached: the mean ratio's 95 % t interval (hand-computed, and scipy's one-sample t) and the
    seeds below 1; one seed short of the target: its mean over the others, no bounds."""
    import math

    from scipy import stats

    from tools.efficiency_tables import compute_intervals, reach_interval

    ratios = [0.5, 0.75, 1.25]
    per_seed = {s: {"epoch": 6, "flops_ratio": r, "seconds_ratio": r} for s, r in enumerate(ratios, 1)}
    iv = reach_interval(per_seed, "flops_ratio")
    std = math.sqrt(((0.5 - 5 / 6) ** 2 + (0.75 - 5 / 6) ** 2 + (1.25 - 5 / 6) ** 2) / 2)
    half = 4.302653 * std / math.sqrt(3)  # t(0.975, 2 degrees of freedom)
    assert iv["mean"] == pytest.approx(5 / 6) and iv["high"] == pytest.approx(5 / 6 + half, abs=1e-6)
    ci = stats.ttest_1samp(ratios, 1.0).confidence_interval(0.95)
    assert (iv["low"], iv["high"]) == pytest.approx((ci.low, ci.high))
    assert (iv["below"], iv["reached"], iv["n"]) == (2, 3, 3)
    per_seed[4] = {"epoch": None, "flops_ratio": None, "seconds_ratio": None}
    short = compute_intervals({"mean_r1": {"GRIT-VLP": per_seed}})["mean_r1"]["GRIT-VLP"]["seconds_ratio"]
    assert short["mean"] == pytest.approx(5 / 6) and math.isnan(short["low"]) and math.isnan(short["high"])
    assert (short["below"], short["reached"], short["n"]) == (2, 3, 4)


def test_a_dropping_arm_has_its_masked_and_unmasked_epochs_timed_apart():
    """image_token_drop with unmasked epochs: the masked epochs' ratio (after the first) and the unmasked
    ones', each summed over a point's own epochs."""
    base_log = [{"epoch_seconds": s} for s in (20.0, 10.0, 10.0, 10.0)]
    arm_log = [{"epoch_seconds": s, "sampler_seconds": 0.1} for s in (20.0, 6.0, 6.0, 11.0)]
    timed = efficiency.epoch_timing(base_log, arm_log, masked_epochs=3)
    assert timed["ratio"] == 0.6 and timed["unmasked_ratio"] == 1.1
    assert "unmasked_ratio" not in efficiency.epoch_timing(base_log, arm_log)
    arm = "GRIT-VLP drop 0.5"
    curves = {"ALBEF_Base": {1: [{"epoch": 2}, {"epoch": 4}]}, arm: {1: [{"epoch": 2}, {"epoch": 4}]}}
    efficiency.add_timed_seconds(curves, {arm: timed}, {arm: 3})
    assert [p["timed_seconds"] for p in curves[arm][1]] == [pytest.approx(12.0), pytest.approx(29.0)]
    assert [p["timed_seconds"] for p in curves["ALBEF_Base"][1]] == [20.0, 40.0]


def test_timing_a_dropping_arm_needs_a_masked_epoch_after_the_first(monkeypatch, tmp_path):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(efficiency, "run_side_by_side", lambda *a, **k: pytest.fail("nothing may run"))
    runs = {"ALBEF_Base": (2.5e-4, None), "GRIT-VLP drop 0.5": (5e-4, None)}
    with pytest.raises(ValueError, match="--timing 2: GRIT-VLP drop 0.5 drops image tokens in 1 of those"):
        efficiency.time_beside_baseline(runs, str(tmp_path), 2, [])


def test_each_arm_is_timed_beside_albef_base_on_one_thread_each(monkeypatch, tmp_path):
    """--timing: per arm, a fresh short pre-training of ALBEF_Base and of the arm side by side (one thread
    each, the epoch count overridden); the medians skip the first epoch."""
    launched = []

    def fake_side_by_side(jobs, threads=None):
        launched.append((jobs, threads))
        for command, _ in jobs:
            out = command[command.index("--output_dir") + 1]
            os.makedirs(out, exist_ok=True)
            strategy = 0.0 if out.endswith("albef_base") else 0.5
            rows = [{"epoch": e, "epoch_seconds": (30.0 if e == 0 else 10.0 + e) + strategy,
                     "sampler_seconds": strategy} for e in range(3)]
            with open(os.path.join(out, "log.txt"), "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(efficiency, "run_side_by_side", fake_side_by_side)
    runs = {"ALBEF_Base": (2.5e-4, None), "GRIT-VLP": (5e-4, None)}
    timing = efficiency.time_beside_baseline(runs, str(tmp_path), 3, [])
    (jobs, threads), = launched
    assert threads == 1 and len(jobs) == 2
    assert [c[c.index("--output_dir") + 1].split(os.sep)[-2:] for c, _ in jobs] == [
        ["grit_vlp", "albef_base"], ["grit_vlp", "grit_vlp"]]
    for command, _ in jobs:
        assert "max_epoch=3" in command and "schedular.epochs=3" in command and command[-1] != "--resume"
        assert command[command.index("--seed") + 1] == "1"
    assert timing == {"GRIT-VLP": {"epoch_seconds": 12.0, "albef_base_epoch_seconds": 11.5,
                                   "ratio": pytest.approx(12.0 / 11.5), "sampler_seconds": 0.5}}
    assert "| GRIT-VLP | 12.00 s | 11.50 s | 1.043 | 0.500 s |" in efficiency.timing_table(timing, 3)
    # timed again with the same commands: read from its result.json, nothing launched
    assert efficiency.time_beside_baseline(runs, str(tmp_path), 3, []) == timing and len(launched) == 1
    efficiency.time_beside_baseline(runs, str(tmp_path), 4, [])  # another epoch count: timed afresh
    assert len(launched) == 2


def test_timed_seconds_are_epochs_at_the_side_by_side_epoch_time():
    """With --timing the seconds axis and the reach table's seconds are each point's epochs times ALBEF_Base's
    per-epoch seconds (the median of its runs beside the arms) times the arm's ratio to the ALBEF_Base run
    beside it, whatever the logged seconds (a paused epoch)."""
    def curve(seconds):
        return [{"epoch": e, "seconds": seconds * e, "mean_r1": 10.0 * e, "itc_mean_r1": 11.0 * e}
                for e in (1, 2, 3)]

    curves = {"ALBEF_Base": {1: curve(40.0)}, "GRIT-VLP": {1: curve(20.0)}, "B3": {1: curve(90.0)}}
    # B3 was timed when the machine was busier (ALBEF_Base beside it 15 s, not 10 s): its ratio counts
    timing = {"GRIT-VLP": {"epoch_seconds": 11.0, "albef_base_epoch_seconds": 10.0, "ratio": 1.1},
              "B3": {"epoch_seconds": 18.0, "albef_base_epoch_seconds": 15.0, "ratio": 1.2},
              "GCBS": {"epoch_seconds": 10.0, "albef_base_epoch_seconds": 10.0, "ratio": 1.0}}
    curves["GCBS"] = {1: curve(30.0)}
    efficiency.add_timed_seconds(curves, timing)
    assert [p["timed_seconds"] for p in curves["ALBEF_Base"][1]] == [10.0, 20.0, 30.0]
    assert [p["timed_seconds"] for p in curves["B3"][1]] == pytest.approx([12.0, 24.0, 36.0])
    assert [p["timed_seconds"] for p in curves["GRIT-VLP"][1]] == pytest.approx([11.0, 22.0, 33.0])
    text, reach = efficiency.curves_table(curves, [1], "timed_seconds")
    assert "epochs × ALBEF_Base's per-epoch seconds × the arm's ratio to it" in text
    hit = reach["mean_r1"]["B3"][1]  # ALBEF_Base ends at 30.0: B3 reaches it at epoch 3
    assert hit["epoch"] == 3 and hit["timed_seconds"] == pytest.approx(36.0) and hit["seconds"] == 270.0
    assert hit["target_timed_seconds"] == 30.0
    assert "| 1 | mean_r1 | 30.00 (epoch 3) | 30 | 3 | 33 | 3 | 36 | 3 | 30 |" in text


def test_timing_without_albef_base_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        efficiency.main(["--seeds", "1", "--arms", "GRIT-VLP", "--timing", "3"])
    assert e.value.code == 2 and "--timing needs at least 2 epochs and ALBEF_Base" in capsys.readouterr().err


@pytest.mark.slow  # two minutes of micro pre-trainings and evaluations: make test-slow
def test_efficiency_micro_writes_table_figure_and_json(in_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "eff")
    record = efficiency.main(["--seeds", "1", "--micro", "--output_dir", out])
    assert set(record["curves"]) == {"ALBEF_Base", "ALBEF_Base50", "GRIT-VLP"}
    for arm, per_seed in record["curves"].items():
        points = per_seed["1"]
        assert [p["epoch"] for p in points] == [1, 2], arm
        assert 0 < points[0]["seconds"] < points[1]["seconds"]
    # Every point read back from the run's own logs: the seconds summed over its pre-training epochs, the
    # recalls of each epoch's zero-shot evaluation (tools.compare's for the last one), both directions.
    grit_dir = os.path.join(out, "seed1", "grit_vlp_lr" + f'{efficiency.arm_run("GRIT-VLP")[0]:g}')
    with open(os.path.join(grit_dir, "pretrain", "log.txt")) as f:
        seconds = [json.loads(line)["epoch_seconds"] for line in f]
    for p, folder in zip(record["curves"]["GRIT-VLP"]["1"], ("zeroshot_e00", "zeroshot")):
        with open(os.path.join(grit_dir, folder, "log.txt")) as f:
            zero = json.loads(f.readlines()[-1])
        assert p["seconds"] == pytest.approx(sum(seconds[:p["epoch"]]))
        assert p["mean_r1"] == pytest.approx((zero["test_txt_r1"] + zero["test_img_r1"]) / 2)
        assert p["itc_mean_r1"] == pytest.approx((zero["test_itc_txt_r1"] + zero["test_itc_img_r1"]) / 2)
    with open(os.path.join(out, "efficiency.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "against ALBEF_Base's final R@1" in open(os.path.join(out, "efficiency.md")).read()
    assert set(record["reach_albef_base_final"]) == {"mean_r1", "itc_mean_r1"}
    # Compute: each point's FLOPs grow with its epochs; the record keeps each arm's per-epoch counts.
    for arm, per_seed in record["curves"].items():
        assert 0 < per_seed["1"][0]["flops"] < per_seed["1"][1]["flops"], arm
        assert len(record["flops_per_sample"][arm]) == 2
    assert "as a share of ALBEF_Base's run to its last" in open(os.path.join(out, "efficiency.md")).read()


def test_merged_curves_and_timings_are_read_not_run_and_a_foreign_record_is_named(tmp_path, monkeypatch):
    """--merge: the curves and timed pairs an earlier efficiency.json holds for an arm run the same way are
    taken from it, only the rest is run; a record of another rate, epochs or timing length is not used."""
    from grit_io import InputFileError

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(efficiency, "prepare_pretraining", lambda overrides=(), config=None: None)
    lrs = {"ALBEF_Base": efficiency.arm_run("ALBEF_Base")[0], "GRIT-VLP": efficiency.arm_run("GRIT-VLP")[0]}
    timed = {"epoch_seconds": 12.0, "albef_base_epoch_seconds": 10.0, "ratio": 1.2, "sampler_seconds": 0.1}
    saved = {"seeds": [1], "learning_rates": lrs, "settings": {}, "micro": False, "timing_epochs": 3,
             "curves": {"ALBEF_Base": {"1": _curve([10, 20], 10.0)},
                        "GRIT-VLP": {"1": [p | {"timed_seconds": 1.0} for p in _curve([15, 30], 8.0)]}},
             "timing": {"GRIT-VLP": timed}}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(saved))

    def no_run(*args, **kwargs):
        raise AssertionError("a merged curve or timing must not be run")

    monkeypatch.setattr(efficiency, "run_pairs", no_run)
    # ALBEF_Base alone is left to time beside: nothing runs
    monkeypatch.setattr(efficiency, "time_beside_baseline", lambda runs, *a: no_run() if runs.keys() - {
        "ALBEF_Base"} else {})
    out = str(tmp_path / "eff")
    args = ["--seeds", "1", "--output_dir", out, "--merge", str(earlier), "--epochs", "1", "2"]
    record = efficiency.main([*args, "--arms", "ALBEF_Base", "GRIT-VLP", "--timing", "3"])
    grit = record["curves"]["GRIT-VLP"]["1"]
    assert [p["mean_r1"] for p in grit] == [15, 30] and record["timing"] == {"GRIT-VLP": timed}
    assert [p["timed_seconds"] for p in grit] == pytest.approx([12.0, 24.0])  # this run's, not the file's 1.0
    assert record["reach_albef_base_final"]["mean_r1"]["GRIT-VLP"]["1"]["epoch"] == 2
    assert record["merged_from"] == {"files": [str(earlier)], "timing": ["GRIT-VLP"],
                                     "curves": {"ALBEF_Base": [1], "GRIT-VLP": [1]}}
    assert "not run: the curves of ALBEF_Base seeds 1; GRIT-VLP seeds 1; the timing of GRIT-VLP" in open(
        os.path.join(out, "efficiency.md")).read()

    asked = []

    def stop(spec, **kwargs):
        asked.append(sorted(spec))
        raise KeyboardInterrupt

    monkeypatch.setattr(efficiency, "run_pairs", stop)
    with pytest.raises(KeyboardInterrupt):  # B3 is not in the file: only B3 is run
        efficiency.main([*args, "--arms", "ALBEF_Base", "GRIT-VLP", "B3"])
    assert asked == [[("B3", 1)]]
    timed_arms = []
    monkeypatch.setattr(efficiency, "time_beside_baseline",
                        lambda runs, *a: timed_arms.append(sorted(runs)) or {"GRIT-VLP": timed})
    efficiency.main([*args, "--arms", "ALBEF_Base", "GRIT-VLP", "--timing", "4"])  # timed over 3 epochs there
    assert timed_arms == [["ALBEF_Base", "GRIT-VLP"]]
    with pytest.raises(InputFileError, match="earlier.json: GRIT-VLP seed 1 has epochs"):
        efficiency.main([*args, "3", "--arms", "GRIT-VLP"])
    saved["learning_rates"]["GRIT-VLP"] = 1e-3
    earlier.write_text(json.dumps(saved))
    with pytest.raises(InputFileError, match="earlier.json: ran GRIT-VLP at"):
        efficiency.main([*args, "--arms", "GRIT-VLP"])
    earlier.write_text(json.dumps(saved | {"corpus": "real"}))
    with pytest.raises(InputFileError, match="earlier.json: made on the real corpus, this run on the synth"):
        efficiency.main([*args, "--arms", "GRIT-VLP"])


def test_the_real_corpora_run_on_their_configs_at_their_own_selections(monkeypatch, capsys, tmp_path):
    """--corpus real: every run pre-trains configs/real/Pretrain.yaml at the real corpora's selections (the
    ALBEF arms at random batches' real rate), evaluated on the real retrieval config; its epochs are that
    config's, and the synthetic world's --micro preset is refused."""
    from tools import arms
    from tools.runs import CORPORA

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(efficiency, "prepare_pretraining", lambda overrides=(), config=None: None)
    asked = []

    def stop(spec, **kwargs):
        asked.append((spec, kwargs["corpus"]))
        raise KeyboardInterrupt

    monkeypatch.setattr(efficiency, "run_pairs", stop)
    with pytest.raises(KeyboardInterrupt):
        efficiency.main(["--seeds", "1", "--corpus", "real", "--arms", "ALBEF_Base", "GRIT-VLP",
                         "--output_dir", str(tmp_path)])  # not the repository's output/compare
    (spec, corpus), = asked
    assert corpus == CORPORA["real"]
    for arm, rate_of in (("ALBEF_Base", "random batches"), ("GRIT-VLP", "GRIT-VLP")):
        directory, command, _ = spec[(arm, 1)]
        lr = arms.SELECTED_LR_REAL[rate_of]
        assert directory.endswith(f"_lr{lr:g}") and f"optimizer.lr={lr!r}" in command
    assert efficiency.arm_run("ALBEF_Base", "real") == (arms.SELECTED_LR_REAL["random batches"], None)
    with pytest.raises(SystemExit):
        efficiency.main(["--seeds", "1", "--corpus", "real", "--epochs", "7"])
    assert "--epochs must lie in 1..6" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        efficiency.main(["--seeds", "1", "--corpus", "real", "--micro"])
    assert "--micro is a preset of the synthetic world" in capsys.readouterr().err


def test_each_arms_compute_is_paired_with_grit_vlps_seed_by_seed():
    """The FLOPs share of an arm minus GRIT-VLP's, paired by seed, with scipy's t interval and the seeds on
    each side; a seed either arm never reached leaves the bounds out and is counted as missing."""
    import math

    from scipy import stats

    from tools.efficiency_tables import compute_intervals, compute_table

    def seeds(ratios):
        return {s: {"epoch": None if r is None else 6, "flops_ratio": r, "seconds_ratio": r}
                for s, r in enumerate(ratios, 1)}

    grit, sitc = [0.7, 0.7, 0.8, 0.6], [0.5, 0.7, 0.6, 0.5]
    reach = {"mean_r1": {"GRIT-VLP": seeds(grit), "GRIT-VLP + S-ITC": seeds(sitc)}}
    gap = compute_intervals(reach)["mean_r1"]["GRIT-VLP + S-ITC"]["flops_gap_to_grit"]
    diffs = [b - a for a, b in zip(grit, sitc)]
    ci = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    assert gap["mean"] == pytest.approx(-0.125)
    assert (gap["low"], gap["high"]) == pytest.approx((ci.low, ci.high))
    assert (gap["behind"], gap["level"], gap["ahead"], gap["missing"]) == (3, 1, 0, 0)
    assert "flops_gap_to_grit" not in compute_intervals(reach)["mean_r1"]["GRIT-VLP"]
    assert "| mean_r1 | GRIT-VLP + S-ITC | -0.125 [" in compute_table(reach, "seconds")
    reach["mean_r1"]["GRIT-VLP + S-ITC"] = seeds([0.5, 0.7, 0.6, None])  # seed 4 never reached
    gap = compute_intervals(reach)["mean_r1"]["GRIT-VLP + S-ITC"]["flops_gap_to_grit"]
    assert gap["n"] == 3 and gap["missing"] == 1 and math.isnan(gap["low"]) and math.isnan(gap["high"])
    assert "(1 seeds not reached or without FLOPs) | 2 / 1 / 0 |" in compute_table(reach, "seconds")


def test_a_real_corpus_figure_names_its_corpus_and_the_files_take_the_record_name(tmp_path, monkeypatch):
    """--corpus real with --record NAME: NAME.json, NAME.md and NAME.png are written, nothing under the
    default name, and the figure's title names the real corpora, not the synthetic world."""
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(efficiency, "prepare_pretraining", lambda overrides=(), config=None: None)
    lrs = {a: efficiency.arm_run(a, "real")[0] for a in ("ALBEF_Base", "GRIT-VLP")}
    saved = {"seeds": [1], "corpus": "real", "learning_rates": lrs, "settings": {}, "micro": False,
             "timing_epochs": 0, "curves": {"ALBEF_Base": {"1": _curve([1.0, 2.0], 10.0)},
                                            "GRIT-VLP": {"1": _curve([1.5, 2.5], 11.0)}}, "timing": {}}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(saved))
    titles = []
    monkeypatch.setattr("matplotlib.figure.Figure.suptitle", lambda fig, text, **kw: titles.append(text))
    # The FLOP count builds the real corpora's tokenizer, whose vocabulary tools.make_real writes: stood in.
    monkeypatch.setattr(efficiency, "epoch_flops", lambda config: [1.0e8] * config.max_epoch)
    out = tmp_path / "eff"
    efficiency.main(["--seeds", "1", "--corpus", "real", "--arms", "ALBEF_Base", "GRIT-VLP", "--epochs", "1",
                     "2", "--merge", str(earlier), "--output_dir", str(out), "--record", "eff_real"])
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "eff_real.json", "eff_real.md", "eff_real.png"]
    assert titles == ["Tiny pre-training on the real corpora (tools.make_real), seeds 1 (tools.efficiency)"]
    with pytest.raises(SystemExit):  # a mistake in the arguments claims nothing: no folder is made
        efficiency.main(["--seeds", "1", "--timing", "1", "--output_dir", str(tmp_path / "mistake")])
    assert not (tmp_path / "mistake").exists()
