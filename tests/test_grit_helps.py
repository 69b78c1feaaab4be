"""Slow (`make test-slow`, about 50 minutes): issue 11's claim on the tiny world, per seed.

For seeds 1, 2 and 3, tools.compare --selected --epochs 12 pre-trains configs/tiny/Pretrain.yaml (its own 12
epochs, the short budget where the paper's claim is made, not the comparison's 24) with GRIT batches and
with random batches (batching.strategy=random), each at its learning rate selected on val (the README's
sweep), and evaluates both: under GRIT the ITM loss must end well below chance (0.637, one positive in three),
and GRIT must be ahead on mean zero-shot R@1, re-ranked and ITC only, and on the compositional ITM probe.
The downstream chain of demo --downstream then runs per seed: GRIT pre-training for 36 epochs
(configs/tiny/Pretrain_long.yaml), NLVR2 text assignment and fine-tune, and VQA from that checkpoint.
NLVR2 dev and test-P must be at least 0.57 and VQA must beat always answering the most frequent training
answer by 0.5 or more, on every seed (targets re-measured on format 6 with `python -m tools.downstream
--seeds 1 2 3`, docs/synthetic-world.md: NLVR2 0.592-0.665, VQA 0.725-0.742 against 0.150).
"""

from __future__ import annotations

import os

import pytest

from tools.compare_summary import ITM_CHANCE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("in_repo")]

SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    from tools.compare import main as compare

    out = tmp_path_factory.mktemp("compare")
    return out, compare(["--seeds", *map(str, SEEDS), "--selected", "--epochs", "12",
                         "--output_dir", str(out)])


@pytest.mark.parametrize("seed", SEEDS)
def test_grit_beats_random_batches(comparison, seed):
    _, record = comparison
    lrs = record["selected_lr"]
    grit, rand = (record["sweep"][arm][f"{lrs[arm]:g}"][seed] for arm in ("GRIT-VLP", "random batches"))
    assert grit["loss_itm"] < ITM_CHANCE - 0.05, grit  # ITM has learned on GRIT's grouped batches
    assert grit["mean_r1"] > rand["mean_r1"] and grit["itc_mean_r1"] > rand["itc_mean_r1"], (grit, rand)
    assert grit["probe"] > rand["probe"], (grit, rand)


@pytest.fixture(scope="module")
def downstream(comparison):
    """demo --downstream's chain per seed, from a 36-epoch GRIT pre-training: {seed: accuracies}."""
    from tools.arms import arm_overrides, selection
    from tools.downstream import DOWNSTREAM_PRETRAIN_CONFIG, pretrain_for_downstream, run_chains

    out, _ = comparison
    seed_dirs = [os.path.join(str(out), f"seed{seed}") for seed in SEEDS]
    # GRIT-VLP at its selection, the pre-trainings two side by side, then the chains two at a time, every run
    # on one thread: as `python -m tools.downstream` measured them for the docs, so that these runs repeat
    # those numbers.
    sets = arm_overrides("GRIT-VLP", *selection("GRIT-VLP"), DOWNSTREAM_PRETRAIN_CONFIG)
    checkpoints = pretrain_for_downstream(seed_dirs, list(SEEDS), [sets] * len(SEEDS), threads=1)
    return dict(zip(SEEDS, run_chains(list(zip(seed_dirs, checkpoints)), threads=1)))


@pytest.mark.parametrize("seed", SEEDS)
def test_vqa_from_the_grit_checkpoint(downstream, seed):
    result = downstream[seed]
    assert result["vqa_test"] >= result["vqa_majority"] + 0.5, result


@pytest.mark.parametrize("seed", SEEDS)
def test_nlvr_from_the_grit_checkpoint_is_well_above_chance(downstream, seed):
    # Measured on format 6 (best dev epoch of 20): dev 0.648 / 0.620 / 0.665, test-P 0.657 / 0.592 / 0.645
    # for seeds 1-3; 600 pairs a split, standard error 0.02. The target is chance (0.5) plus 3.5 standard
    # errors, about one below the lowest seed, so another CPU's floats do not fail it by themselves.
    result = downstream[seed]
    assert result["nlvr_dev"] >= 0.57 and result["nlvr_test"] >= 0.57, result
