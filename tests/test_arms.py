"""tools.arms: what each compared arm is, its grid, and its selection (no training)."""

from __future__ import annotations

import os

import pytest

from tools.arms import (
    ARMS,
    GRIDS,
    SELECTED_LR,
    SELECTED_LR_24,
    SELECTED_LR_REAL,
    SELECTED_SETTING,
    arm_overrides,
    grid_overrides,
    selection,
)
from tools.runs import PRETRAIN_CONFIG, lr_overrides, run_dir
from training.config_resolve import resolve_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_arm_and_grid_setting_is_a_config_the_pretraining_accepts(monkeypatch):
    """An arm with a hyper-parameter gets a grid of the same size as every other such arm; each setting
    maps onto the config keys its paper names, and every arm at every setting resolves to a pre-training
    config with the strategy it claims."""
    monkeypatch.chdir(ROOT)
    assert {len(g) for g in GRIDS.values()} == {2}  # the same tuning budget for every arm with a grid
    assert grid_overrides("B3", "p=2,m=20") == ["batching.b3.rank_skip=2", "batching.b3.rank_window=20"]
    assert grid_overrides("GCBS", "k=5") == ["batching.gcbs.neighbours=5"]
    assert grid_overrides("random walk", "k=10,restart=0.3") == ["batching.rwr.neighbours=10",
                                                                 "batching.rwr.restart=0.3"]
    assert grid_overrides("GRIT-VLP + HN-NCE", "beta=1") == ["itc_hn_beta=1"]
    assert grid_overrides("GRIT-VLP + S-ITC", "s=0.5") == ["itc_smoothing=0.5"]
    assert grid_overrides("B3", None) == []
    assert "s=0.5" in GRIDS["GRIT-VLP + S-ITC"] and "beta=0.5" in GRIDS["GRIT-VLP + HN-NCE"]  # papers' values
    # An arm's run: its keys, then its setting, then its rate (the order the recorded commands have)
    assert arm_overrides("B3", 5e-4, "p=2,m=20") == (ARMS["B3"] + grid_overrides("B3", "p=2,m=20")
                                                     + lr_overrides(5e-4))
    assert arm_overrides("GRIT-VLP", None, None) == ARMS["GRIT-VLP"]
    for arm, settings in GRIDS.items():
        for setting in settings:
            config = resolve_config("pretrain", PRETRAIN_CONFIG, ARMS[arm] + grid_overrides(arm, setting),
                                    check_paths=False)
            assert config.strategy == {"B3": "b3", "GCBS": "gcbs", "random walk": "rwr",
                                       "random + HN-NCE": "random"}.get(arm, "grit"), arm
    smoothed = resolve_config("pretrain", PRETRAIN_CONFIG, ARMS["GRIT-VLP + S-ITC"], check_paths=False)
    assert smoothed.itc_smoothing_epoch == 1  # MAFA smooths from its second epoch
    assert run_dir("/o", "B3", 1, 5e-4, "p=2,m=20") == "/o/seed1/b3_lr0.0005_p_2_m_20"


def test_a_selection_is_the_rate_and_for_a_grid_arm_the_setting(monkeypatch):
    """selection() returns what the sweep chose; an arm with a grid needs its setting as well as its rate,
    and an arm without a selection is refused with a message naming where selections live."""
    assert selection("GRIT-VLP") == (SELECTED_LR["GRIT-VLP"], None)
    monkeypatch.setitem(SELECTED_LR, "GRIT-VLP + HN-NCE", 5e-4)
    monkeypatch.delitem(SELECTED_SETTING, "GRIT-VLP + HN-NCE", raising=False)
    with pytest.raises(ValueError, match=r"'GRIT-VLP \+ HN-NCE' has a grid but no selected setting"):
        selection("GRIT-VLP + HN-NCE")
    monkeypatch.setitem(SELECTED_SETTING, "GRIT-VLP + HN-NCE", "beta=0.5")
    assert selection("GRIT-VLP + HN-NCE") == (5e-4, "beta=0.5")


def test_each_corpus_has_its_own_selection(monkeypatch):
    """--corpus real runs an arm at the real corpora's selection (SELECTED_LR_REAL) with its synthetic grid
    setting; an arm the real sweep never ran is refused, naming that table."""
    monkeypatch.setitem(SELECTED_LR_REAL, "B3", 1e-3)
    monkeypatch.setitem(SELECTED_LR, "B3", 5e-4)
    assert selection("B3", "real") == (1e-3, SELECTED_SETTING["B3"])
    assert selection("B3") == selection("B3", "synthetic") == (5e-4, SELECTED_SETTING["B3"])
    monkeypatch.delitem(SELECTED_LR_REAL, "random walk", raising=False)
    with pytest.raises(ValueError, match=r"'random walk' has no selected rate yet on the real corpus"):
        selection("random walk", "real")


def test_a_longer_schedule_has_its_own_selection(monkeypatch):
    """At 24 epochs an arm runs at the 24-epoch sweep's rate (SELECTED_LR_24), at the corpus config's own
    epochs at SELECTED_LR's; a schedule no sweep selected at is refused naming it, never given the 12-epoch
    rate."""
    monkeypatch.setitem(SELECTED_LR_24, "B3", 1.25e-4)
    monkeypatch.setitem(SELECTED_LR, "B3", 5e-4)
    assert selection("B3", "synthetic", 24) == (1.25e-4, SELECTED_SETTING["B3"])
    assert selection("B3", "synthetic", 12) == selection("B3") == (5e-4, SELECTED_SETTING["B3"])
    monkeypatch.delitem(SELECTED_LR_24, "GCBS", raising=False)
    with pytest.raises(ValueError, match=r"'GCBS' has no selected rate yet on the synthetic corpus at 24 "
                                         r"epochs \(tools.arms.SELECTED_LRS_LONGER\[\('synthetic', 24\)\]"):
        selection("GCBS", "synthetic", 24)
    with pytest.raises(ValueError, match="'GRIT-VLP' has no selected rate yet on the synthetic corpus at 18"):
        selection("GRIT-VLP", "synthetic", 18)
    assert selection("GRIT-VLP", "real", 6) == selection("GRIT-VLP", "real")  # configs/real: six epochs


def test_online_arms_run_at_equal_compute_with_plain_batches(monkeypatch):
    """JEST's and RHO-LOSS's epochs are those tools.step_measure.equal_compute_epochs gives for the tiny
    config (its 2,909 pre-training entries; scoring by learner and reference): their executed FLOPs at most
    those of 12 epochs of plain batches, and within one online epoch of them."""
    from tools.arms import ONLINE_ARMS
    from tools.step_measure import equal_compute_epochs

    monkeypatch.chdir(ROOT)
    base = resolve_config("pretrain", PRETRAIN_CONFIG, ARMS["random batches"], check_paths=False)
    epochs, counts = equal_compute_epochs(base, 2909, base.max_epoch, super_batch=5, scorers=2)
    assert 0.95 < counts["compute_ratio"] <= 1.0
    for arm, strategy in ONLINE_ARMS.items():
        config = resolve_config("pretrain", PRETRAIN_CONFIG,
                                ARMS[arm] + [f"batching.{strategy}.reference=ref.pth"], check_paths=False)
        assert config.strategy == strategy and getattr(config.batching, strategy).super_batch == 5
        assert config.max_epoch == config.schedular.epochs == epochs
