"""The per-epoch batch figures every strategy logs (issue 37): the false-negative rate of the mined ITM
negatives against a hand-made batch with known same-scene pairs, the share of examples whose batch holds
another of their scene, how many groups a batch draws from, the scene table behind the rates (the fields
in a pre-training's log: tests/test_pretrain.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from grit_sim import clustered_features, make_samplers, run_epoch

from grit.collector import groups_per_batch
from models.false_negatives import mined_false_negative_rate, same_group_share


def test_false_negative_rate_on_a_hand_made_batch():
    """Six pairs of scenes 0, 0, 1, 2, 2, 2. Image anchors' mined texts: 1 (same scene: false), 2, 0,
    5 (same scene: false), 3 (same: false), 0; text anchors' mined images: 0 (same: false), 3, 4, 1, 0,
    4 (same: false). 5 of 12 anchors got a false negative."""
    scene = torch.tensor([0, 0, 1, 2, 2, 2])
    neg_text = torch.tensor([1, 2, 0, 5, 3, 0])
    neg_image = torch.tensor([0, 3, 4, 1, 0, 4])
    neg_image[0] = 1  # a text's negative is never itself: text 0's image negative is image 1 (same scene)
    assert float(mined_false_negative_rate(scene, neg_text, neg_image)) == pytest.approx(5 / 12)
    # a bad sample's anchors are left out: without pair 3 (one false as image, none as text), 4 of 10
    valid = torch.tensor([True, True, True, False, True, True])
    assert float(mined_false_negative_rate(scene, neg_text, neg_image, valid)) == pytest.approx(4 / 10)


def test_same_scene_share_on_hand_made_batches():
    """Two batches of four, scenes [0, 0, 1, 2] and [3, 3, 3, 4]: examples 0, 1 and 4, 5, 6 share their
    batch with another of their scene, 5 of 8."""
    scenes = torch.tensor([[0, 0, 1, 2], [3, 3, 3, 4]])
    assert float(same_group_share(scenes)) == pytest.approx(5 / 8)
    # a bad sample neither counts nor makes its twin count: without example 1, 3 of the 7 valid share
    valid = torch.tensor([[True, False, True, True], [True, True, True, True]])
    assert float(same_group_share(scenes, valid)) == pytest.approx(3 / 7)
    # a row is a batch: the same scenes in two different batches share nothing
    assert float(same_group_share(torch.tensor([[0, 1], [0, 1]]))) == 0.0
    assert float(same_group_share(torch.tensor([0, 1, 0]))) == pytest.approx(2 / 3)  # one batch (B,)


def test_groups_per_batch_counts_the_boundaries_inside_batches():
    assert groups_per_batch(torch.tensor([8, 8, 8]), 4) == 1.0  # every boundary on a batch edge
    assert groups_per_batch(torch.tensor([6, 6]), 4) == pytest.approx(4 / 3)  # 6 splits 1 batch of 3
    assert groups_per_batch(torch.tensor([5, 0, 3, 2]), 4) == 1.5  # boundaries 5 and 8: one inside batch 1
    assert groups_per_batch(torch.tensor([3]), 4) is None  # no whole batch


@pytest.mark.parametrize("M, expected", [(16, 1.0), (12, None)])
def test_the_sampler_reports_the_groups_of_its_epochs(M, expected):
    """N divides M and L, no invalid sample: every batch of a grouped epoch is one sub-queue's; with
    M = 12 and N = 8, the sub-queues' boundaries cut batches (more than one group each); the random
    first epoch has none."""
    D, N = 96, 8
    feats = clustered_features(D)
    (s,) = make_samplers(D, N, 1, dict(enabled=True, queue_size=48, search_space=M))
    run_epoch([s], 0, feats)
    assert s.groups_per_batch is None  # epoch 0 was random
    run_epoch([s], 1, feats, stop_after=2)
    if expected is not None:
        assert s.groups_per_batch == expected
    else:
        assert s.groups_per_batch > 1.0
    # a checkpoint keeps it for the resumed epoch's log
    (t,) = make_samplers(D, N, 1, dict(enabled=True, queue_size=48, search_space=M))
    t.load_state_dict(s.state_dict())
    assert t.groups_per_batch == s.groups_per_batch


def test_scene_ids_come_from_the_scene_table_beside_the_json(tmp_path):
    from dataset.corpus import PretrainCorpus
    from dataset.pretrain import PretrainDataset

    root = tmp_path / "world"
    (root / "images").mkdir(parents=True)
    entries = [{"image": f"images/{i}.png", "caption": "a red circle"} for i in (0, 1, 2, 0)]
    (root / "pretrain.json").write_text(json.dumps(entries))
    table = {"images/0.png": "red circle", "images/1.png": "blue square", "images/2.png": "red circle"}
    (root / "scenes.json").write_text(json.dumps(table))
    ds = PretrainDataset([str(root / "pretrain.json")], transform=None, image_root=str(root))
    corpus = PretrainCorpus([(str(root / "pretrain.json"), ds)])
    assert corpus.scene_ids.tolist() == [0, 1, 0, 0]  # images 0 and 2 show the same scene
    os.remove(root / "scenes.json")
    bare = PretrainCorpus([(str(root / "pretrain.json"), ds)])
    assert bare.scene_ids is None  # real data: no truth, no rate
