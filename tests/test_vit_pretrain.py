"""models.vit_synthetic and tools.vit_pretrain: attribute targets, held-out scenes, learning, a file
vision_init loads, and generation on first use."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from dataset.synthetic_world import SHAPES, Scene, sample_scenes
from models import vit_synthetic
from models.vit import build_vision_encoder
from tools import vit_pretrain
from training.config import load_config


def test_attribute_targets_name_every_object_and_mark_absent_shapes():
    scene = Scene((("red", "circle", "small"), ("blue", "cross", "large")), "left")
    y = vit_synthetic.attribute_targets(scene)
    c, x = SHAPES.index("circle"), SHAPES.index("cross")
    assert y[:, c].tolist() == [1, 0, 0] and y[:, x].tolist() == [1, 2, 1]  # red=0, blue=2; small=0, large=1
    absent = [s for s in range(len(SHAPES)) if s not in (c, x)]
    assert y[0, absent].tolist() == [0] * 3 and (y[1:, absent] == -100).all()


def test_training_scenes_avoid_the_eval_scenes(in_repo):
    exclude = vit_synthetic._eval_scene_keys("data/synthetic")
    assert len(exclude) > 1000  # 100 val + 1,000 test images
    # Exclude the first scenes the same stream draws: without the filter they would come out.
    first = {sc.key() for sc in sample_scenes(np.random.default_rng(3), 200)}
    scenes = vit_synthetic.fresh_scenes(np.random.default_rng(3), 500, exclude | first)
    assert len(scenes) == 500 and not {sc.key() for sc in scenes} & (exclude | first)


def test_vit_learns_the_attributes_and_vision_init_loads_it(in_repo, tmp_path, capsys):
    out = tmp_path / "vit.pth"
    record = vit_pretrain.main(["--config", "configs/tiny/Pretrain.yaml", "--output", str(out),
                                "--steps", "150", "--seed", "0", "--threads", "1"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == record
    acc = record["held_out_accuracy"]
    # Answering "absent" everywhere scores about 0.57 on shape_present; colour chance is 1/6, size 1/2.
    assert acc["shape_present"] > 0.75 and acc["size"] > 0.8, acc
    config = dict(load_config("configs/tiny/Pretrain.yaml"))
    torch.manual_seed(1)
    fresh = build_vision_encoder(config)
    loaded = build_vision_encoder({**config, "vision_init": str(out)})
    saved = torch.load(out, weights_only=True)["model"]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
    assert not torch.equal(fresh.pos_embed, loaded.pos_embed)


def test_bad_arguments_are_refused(in_repo, tmp_path):
    with pytest.raises(Exception, match="steps"):
        vit_pretrain.main(["--config", "configs/tiny/Pretrain.yaml", "--output", str(tmp_path / "x.pth"),
                           "--steps", "0"])


def test_vision_init_synthetic_is_generated_once_per_vit_shape(in_repo, monkeypatch, tmp_path):
    monkeypatch.setitem(vit_synthetic.DEFAULTS, "steps", 5)  # the recipe's length is not under test
    root = tmp_path / "synthetic"  # the dataset's marker and scenes are all the generator reads
    root.mkdir()
    for name in ("synthetic.json", "scenes.json"):
        shutil.copy(os.path.join("data/synthetic", name), root / name)
    config = {**dict(load_config("configs/tiny/Pretrain.yaml")), "synthetic_root": str(root)}
    assert config["vision_init"] == "synthetic"
    path = vit_synthetic.synthetic_vit_path(config)
    assert path == str(root / "vit_r48_p8_w64_d3_h4_linear.pth") and not os.path.exists(path)
    torch.manual_seed(0)
    vit = build_vision_encoder(config)  # generates it
    saved = torch.load(path, weights_only=True)
    assert saved["vit"] == vit_synthetic.vit_shape(config) and saved["recipe"]["steps"] == 5
    assert all(torch.equal(vit.state_dict()[k], v) for k, v in saved["model"].items())
    stamp = os.stat(path).st_mtime_ns
    assert vit_synthetic.ensure_synthetic_vit(config) == path and os.stat(path).st_mtime_ns == stamp
    # Another shape gets its own file; the first one stays as it was.
    other = {**config, "vision_width": 32, "vision_heads": 2}
    assert vit_synthetic.ensure_synthetic_vit(other) == str(root / "vit_r48_p8_w32_d3_h2_linear.pth")
    assert os.stat(path).st_mtime_ns == stamp
    with pytest.raises(ValueError, match="synthetic_root"):
        build_vision_encoder({**config, "synthetic_root": None})


def test_generated_vit_does_not_depend_on_the_callers_thread_count(in_repo, monkeypatch, tmp_path):
    monkeypatch.setitem(vit_synthetic.DEFAULTS, "steps", 5)  # the recipe's length is not under test
    config = dict(load_config("configs/tiny/Pretrain.yaml"))
    weights, threads = [], torch.get_num_threads()
    for count in (1, 2):
        root = tmp_path / f"threads{count}"
        root.mkdir()
        for name in ("synthetic.json", "scenes.json"):
            shutil.copy(os.path.join("data/synthetic", name), root / name)
        torch.set_num_threads(count)
        try:
            path = vit_synthetic.ensure_synthetic_vit({**config, "synthetic_root": str(root)})
            assert torch.get_num_threads() == count  # the caller's setting is given back
        finally:
            torch.set_num_threads(threads)
        weights.append(torch.load(path, weights_only=True)["model"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
