"""tools.selection_bench: online selection's share of the step, by arithmetic from counted FLOPs and by timing
the selection itself (issue 52, item 6)."""

from __future__ import annotations

import json

import pytest
import torch

from tools.selection_bench import main, selection_seconds, shares


def test_shares_by_hand():
    # f_train 10, f_score 1, k 4: two scorers add 8 per sample -> share 8/18, step 1.8x, epoch 1.8/4.
    two = shares(10.0, 1.0, 4, 2, step_seconds=0.5)
    assert two == pytest.approx({'scorers': 2, 'scoring_share': 8 / 18, 'step_ratio': 1.8,
                                 'epoch_ratio': 0.45, 'scoring_seconds_estimate': 0.4})
    one = shares(10.0, 1.0, 4, 1, step_seconds=0.5)
    assert one['scoring_share'] == pytest.approx(4 / 14) and one['step_ratio'] == pytest.approx(1.4)


@pytest.mark.parametrize("name", ["jest", "rho"])
def test_selection_seconds_times_a_valid_selection(name):
    seconds = selection_seconds(name, 6, 3, torch.device("cpu"), repeats=2, seed=0)
    assert 0 < seconds < 5


def test_main_counts_the_configs_model(tmp_path, capsys):
    record = main(["--config", "configs/tiny/Pretrain.yaml", "--ks", "2", "5", "--count_batch", "2",
                   "--repeats", "1", "--strategies", "rho", "--output_dir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert json.loads((tmp_path / "selection_bench.json").read_text()) == record
    assert record["batch_size"] == 8 and record["image_res"] == 48
    # The tiny model: the scoring forward is a small part of a training step's forward + backward.
    train, score = record["train_gflop_per_sample"], record["score_gflop_per_candidate"]
    assert 0 < score < train / 3
    for row in record["rows"]:
        k = row["k"]
        assert row["candidates"] == 8 * k and row["filtering_ratio"] == pytest.approx(1 - 1 / k)
        assert row["learnability"]["step_ratio"] == pytest.approx(1 + 2 * k * score / train)
        assert row["hard_learner"]["epoch_ratio"] == pytest.approx((1 + k * score / train) / k)
        assert row["rho_select_seconds"] > 0 and "jest_select_seconds" not in row
    # More candidates: scoring takes a larger share of the step.
    small, large = (row["learnability"]["scoring_share"] for row in record["rows"])
    assert large > small
