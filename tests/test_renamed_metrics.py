"""Logs and records written before the metrics were named for any batching strategy (grit_hardness,
grit_hardness_t2i, grit_seconds, grit_share) are read with the new names (hardness, hardness_t2i,
sampler_seconds, sampler_share) by every reader: tools.runs.read_log, tools.report's, and the --merge
readers of tools.compare and tools.efficiency."""

from __future__ import annotations

import json

from tools import report
from tools.records import merged_curves, merged_rows
from tools.runs import read_log
from training.logger import RENAMED_METRICS, current_names

OLD = {"epoch": 0, "loss_itm": 0.6, "grit_hardness": 0.4, "grit_hardness_t2i": 0.3, "grit_seconds": 1.5}
NEW = {"epoch": 0, "loss_itm": 0.6, "hardness": 0.4, "hardness_t2i": 0.3, "sampler_seconds": 1.5}


def test_current_names_renames_only_the_old_metrics():
    assert current_names(OLD) == NEW
    assert current_names(NEW) == NEW
    assert set(RENAMED_METRICS.values()) == {"hardness", "hardness_t2i", "sampler_seconds", "sampler_share"}


def test_log_readers_take_old_names_as_new(tmp_path):
    path = tmp_path / "log.txt"
    path.write_text(json.dumps(OLD) + "\n" + json.dumps({**NEW, "epoch": 1}) + "\n")
    assert read_log(str(path)) == [NEW, {**NEW, "epoch": 1}]
    assert [r for _, r in report.read_log(str(path))] == [NEW, {**NEW, "epoch": 1}]


def test_merge_readers_take_old_names_as_new_and_match_new_records(tmp_path):
    old_row = {"loss_itm": 0.6, "grit_hardness": 0.4, "grit_share": 0.01, "mean_r1": 50.0}
    new_row = current_names(old_row)
    for name, row in (("old.json", old_row), ("new.json", new_row)):
        record = {"tool": "tools.compare", "corpus": "synthetic", "overrides": [],
                  "sweep": {"GRIT-VLP": {"0.0005": {"1": row}}}}
        (tmp_path / name).write_text(json.dumps(record))
    files = [str(tmp_path / "old.json"), str(tmp_path / "new.json")]
    rows = merged_rows(files, [])  # the same row in both spellings is one row, not a conflict
    assert rows == {("GRIT-VLP", "0.0005", 1): {"loss_itm": 0.6, "hardness": 0.4, "sampler_share": 0.01,
                                               "mean_r1": 50.0}}
    timing = {"epoch_seconds": 12.0, "albef_base_epoch_seconds": 10.0, "ratio": 1.2, "grit_seconds": 0.1}
    (tmp_path / "eff.json").write_text(json.dumps({
        "tool": "tools.efficiency", "micro": False, "learning_rates": {"GRIT-VLP": 5e-4},
        "settings": {"GRIT-VLP": None}, "curves": {"GRIT-VLP": {"1": [{"epoch": 1, "mean_r1": 1.0}]}},
        "timing": {"GRIT-VLP": timing}, "timing_epochs": 2}))
    _, timed = merged_curves([str(tmp_path / "eff.json")], {"GRIT-VLP": (5e-4, None)}, [1], False, 2)
    assert timed["GRIT-VLP"]["sampler_seconds"] == 0.1 and "grit_seconds" not in timed["GRIT-VLP"]
