"""Slow (`make test-slow`, about 30 minutes): issue 11's claim on the tiny world, per seed.

For seeds 1, 2 and 3, tools.compare pre-trains configs/tiny/Pretrain.yaml with GRIT batches and with
random batches (grit.enabled=false) and evaluates both: under GRIT the ITM loss must end well below
chance (0.637, one positive in three), and GRIT must be ahead on mean zero-shot R@1 and on the
compositional ITM probe. From each GRIT checkpoint the downstream chain then runs (demo --downstream):
VQA must beat always answering the most frequent training answer by 0.3 or more, and NLVR2 dev and
test-P, pooled over the seeds, must be above chance. Issue 11 asks NLVR2 for 0.60 on every seed; that
does not hold (a strict xfail, which fails once it holds; README, "NLVR2 on the synthetic data").
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("in_repo")]

SEEDS = (1, 2, 3)
CHANCE_ITM = 0.637  # cross-entropy of always saying p(match) = 1/3


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    from tools.compare import main as compare

    out = tmp_path_factory.mktemp("compare")
    return out, compare(["--seeds", *map(str, SEEDS), "--output_dir", str(out)])


@pytest.mark.parametrize("seed", SEEDS)
def test_grit_beats_random_batches(comparison, seed):
    _, result = comparison
    grit, rand = result[seed]["GRIT-VLP"], result[seed]["random batches"]
    assert grit["loss_itm"] < CHANCE_ITM - 0.05, grit  # ITM has learned on GRIT's grouped batches
    assert grit["mean_r1"] > rand["mean_r1"], (grit, rand)
    assert grit["probe"] > rand["probe"], (grit, rand)


@pytest.fixture(scope="module")
def downstream(comparison):
    """demo.run_downstream from each seed's GRIT checkpoint: {seed: accuracies}."""
    from demo import run_downstream
    from tools.compare import last_checkpoint

    out, _ = comparison
    results = {}
    for seed in SEEDS:
        seed_dir = os.path.join(str(out), f"seed{seed}")
        results[seed] = run_downstream(seed_dir, last_checkpoint(os.path.join(seed_dir, "pretrain")))
    return results


@pytest.mark.parametrize("seed", SEEDS)
def test_vqa_from_the_grit_checkpoint(downstream, seed):
    result = downstream[seed]
    assert result["vqa_test"] >= result["vqa_majority"] + 0.3, result


def test_nlvr_from_the_grit_checkpoints_is_above_chance_over_the_seeds(downstream):
    # 600 balanced pairs per split and seed: 3,600 pairs pooled, where 0.53 is 3.6 standard errors
    # above chance. Measured 0.547 (seeds 1-3: 0.541, 0.552, 0.547). One seed's 1,200 pairs are too
    # few for a per-seed claim at this margin: seed 42 (test_downstream) gave 0.528.
    pooled = [(r["nlvr_dev"] + r["nlvr_test"]) / 2 for r in downstream.values()]
    assert sum(pooled) / len(pooled) > 0.53, downstream


@pytest.mark.xfail(strict=True, reason="issue 11: NLVR2 reaches 0.51-0.59, not 0.60 (README)")
def test_nlvr_reaches_the_issue_target_on_every_seed(downstream):
    assert all(r["nlvr_dev"] >= 0.60 and r["nlvr_test"] >= 0.60 for r in downstream.values()), downstream
