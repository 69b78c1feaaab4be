"""dataset.synthetic_vit, tools.vit_pretrain and training.inputs: attribute targets, held-out scenes,
learning, a file vision_init loads, and generation before the model is built (models/ only loads it)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import tiny_config

from dataset import synthetic_vit
from dataset.synthetic_world import SHAPES, Scene, sample_scenes
from models.vit import build_vision_encoder, synthetic_vit_path, vit_shape
from tools import vit_pretrain
from training.cli import run_main
from training.config_files import ConfigError
from training.inputs import bare_vision_encoder, prepare_inputs


def synthetic_copy(root) -> str:
    """A synthetic_root holding only what the ViT generator reads: the dataset's marker and scenes."""
    root.mkdir()
    for name in ("synthetic.json", "scenes.json"):
        shutil.copy(os.path.join("data/synthetic", name), root / name)
    return str(root)


def test_attribute_targets_name_every_object_and_mark_absent_shapes():
    scene = Scene((("red", "circle", "small"), ("blue", "cross", "large")), "left")
    y = synthetic_vit.attribute_targets(scene)
    c, x = SHAPES.index("circle"), SHAPES.index("cross")
    assert y[:, c].tolist() == [1, 0, 0] and y[:, x].tolist() == [1, 2, 1]  # red=0, blue=2; small=0, large=1
    absent = [s for s in range(len(SHAPES)) if s not in (c, x)]
    assert y[0, absent].tolist() == [0] * 3 and (y[1:, absent] == -100).all()


def test_training_scenes_avoid_the_eval_scenes(in_repo):
    exclude = synthetic_vit._eval_scene_keys("data/synthetic")
    assert len(exclude) > 1000  # 100 val + 1,000 test images
    # Exclude the first scenes the same stream draws: without the filter they would come out.
    first = {sc.key() for sc in sample_scenes(np.random.default_rng(3), 200)}
    scenes = synthetic_vit.fresh_scenes(np.random.default_rng(3), 500, exclude | first)
    assert len(scenes) == 500 and not {sc.key() for sc in scenes} & (exclude | first)


def test_vit_learns_the_attributes_and_vision_init_loads_it(in_repo, tmp_path, capsys):
    record = vit_pretrain.main(["--config", "configs/tiny/Pretrain.yaml", "--output_dir", str(tmp_path),
                                "--steps", "150", "--seed", "0", "--threads", "1"])
    out = tmp_path / "vit_r48_p8_w64_d3_h4_linear.pth"  # the name vision_init: synthetic loads
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == record and record["output"] == str(out)
    assert json.loads((tmp_path / "vit_pretrain.json").read_text()) == record
    acc = record["held_out_accuracy"]
    # Answering "absent" everywhere scores about 0.57 on shape_present; colour chance is 1/6, size 1/2.
    assert acc["shape_present"] > 0.75 and acc["size"] > 0.8, acc
    config = tiny_config("pretrain")
    torch.manual_seed(1)
    fresh = build_vision_encoder(dataclasses.replace(config, vision_init=None))
    loaded = build_vision_encoder(dataclasses.replace(config, vision_init=str(out)))
    saved = torch.load(out, weights_only=True)["model"]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
    assert not torch.equal(fresh.pos_embed, loaded.pos_embed)


def test_bad_arguments_are_refused(in_repo, tmp_path, capsys):
    argv = ["--config", "configs/tiny/Pretrain.yaml", "--output_dir", str(tmp_path / "x"), "--steps", "0"]
    with pytest.raises(ConfigError, match="steps"):
        vit_pretrain.main(argv)
    # On the command line: one `error:` line, exit 2 (training.cli.run_main), no file written.
    with pytest.raises(SystemExit) as stop:
        run_main(vit_pretrain.main, argv)
    assert stop.value.code == 2 and capsys.readouterr().err.startswith("error: --steps")
    with pytest.raises(SystemExit) as stop:
        run_main(vit_pretrain.main, ["--config", "configs/tiny/Pretrain.yaml", "--set", "synthetic_root=null",
                                     "vision_init=null"])
    assert stop.value.code == 2 and "synthetic_root" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_tool_writes_the_file_vision_init_synthetic_loads(in_repo, tmp_path):
    """Without --output_dir the tool writes where `vision_init: synthetic` looks, for the config's shape."""
    root = synthetic_copy(tmp_path / "synthetic")
    record = vit_pretrain.main(["--config", "configs/tiny/Pretrain.yaml", "--steps", "2", "--threads", "1",
                                "--set", f"synthetic_root={root}"])
    config = tiny_config("pretrain", synthetic_root=root)
    assert record["output"] == synthetic_vit_path(config) and os.path.isfile(record["output"])
    saved = torch.load(record["output"], weights_only=True)
    assert saved["vit"] == vit_shape(config) and saved["recipe"]["steps"] == 2
    vit = build_vision_encoder(config)
    assert all(torch.equal(vit.state_dict()[k], v) for k, v in saved["model"].items())


def test_vision_init_synthetic_is_generated_once_per_vit_shape(in_repo, monkeypatch, tmp_path):
    monkeypatch.setitem(synthetic_vit.DEFAULTS, "steps", 5)  # the recipe's length is not under test
    root = synthetic_copy(tmp_path / "synthetic")
    config = tiny_config("pretrain", synthetic_root=root)
    assert config.vision_init == "synthetic"
    path = synthetic_vit_path(config)
    assert path == os.path.join(root, "vit_r48_p8_w64_d3_h4_linear.pth") and not os.path.exists(path)
    # The model only loads the file: missing, the error names it and the command that makes it.
    made_by = r"vit_r48_p8_w64_d3_h4_linear\.pth.*python -m tools\.vit_pretrain --config"
    with pytest.raises(FileNotFoundError, match=made_by):
        build_vision_encoder(config)
    prepare_inputs(config)  # generates it, as every task script does before building its model
    torch.manual_seed(0)
    vit = build_vision_encoder(config)
    saved = torch.load(path, weights_only=True)
    assert set(saved) == {"model", "vit", "recipe", "held_out_accuracy"}
    assert saved["vit"] == vit_shape(config) and saved["recipe"]["steps"] == 5
    assert all(torch.equal(vit.state_dict()[k], v) for k, v in saved["model"].items())
    stamp = os.stat(path).st_mtime_ns
    prepare_inputs(config)
    assert os.stat(path).st_mtime_ns == stamp
    # Another shape gets its own file; the first one stays as it was.
    other = tiny_config("pretrain", synthetic_root=root, vision_width=32, vision_heads=2)
    prepare_inputs(other)
    assert os.path.isfile(os.path.join(root, "vit_r48_p8_w32_d3_h2_linear.pth"))
    assert synthetic_vit_path(other) == os.path.join(root, "vit_r48_p8_w32_d3_h2_linear.pth")
    assert os.stat(path).st_mtime_ns == stamp
    with pytest.raises(ValueError, match="synthetic_root"):
        build_vision_encoder(dataclasses.replace(config, synthetic_root=None))


def test_generated_vit_does_not_depend_on_the_callers_thread_count(in_repo, monkeypatch, tmp_path):
    monkeypatch.setitem(synthetic_vit.DEFAULTS, "steps", 5)  # the recipe's length is not under test
    weights, threads = [], torch.get_num_threads()
    for count in (1, 2):
        config = tiny_config("pretrain", synthetic_root=synthetic_copy(tmp_path / f"threads{count}"))
        torch.set_num_threads(count)
        try:
            path = synthetic_vit.ensure_synthetic_vit(
                synthetic_vit_path(config), bare_vision_encoder(config), config.vision_width,
                config.synthetic_root, vit_shape(config), config.image_res)
            assert torch.get_num_threads() == count  # the caller's setting is given back
        finally:
            torch.set_num_threads(threads)
        weights.append(torch.load(path, weights_only=True)["model"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
