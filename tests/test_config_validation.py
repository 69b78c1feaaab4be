"""Start-up config validation (training.schema, training.validation, training.cli.start): unknown keys
with hints, types, GRIT sizes, missing data paths, the one-global-batch check, all before data or model."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import Pretrain
import Retrieval
import training.cli
from training import schema
from training.cli import parse_args
from training.config import ConfigError, load_config, save_config
from training.validation import check_global_batch, load_task_config, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"pretrain": "configs/tiny/Pretrain.yaml", "retrieval": "configs/tiny/Retrieval.yaml",
        "nlvr": "configs/tiny/NLVR.yaml", "vqa": "configs/tiny/VQA.yaml"}
SHIPPED = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"),
                                                             recursive=True))
DATA_KEYS = ("train_file", "val_file", "test_file", "answer_list")


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    """Configs name repo-relative paths; the scripts' start() sets process-wide torch flags."""
    monkeypatch.chdir(ROOT)
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)


def task_of(path: str) -> str:
    """The script a shipped config is for, from its name (ablation rows are pre-training configs)."""
    name = os.path.basename(path)
    if "ablation" in path.split(os.sep) or name.startswith("Pretrain"):
        return "pretrain"
    for prefix, task in (("Retrieval", "retrieval"), ("NLVR", "nlvr"), ("VQA", "vqa")):
        if name.startswith(prefix):
            return task
    raise AssertionError(f"{path}: no task known for this config; add it to task_of")


def load(config: str, task: str, *sets: str):
    return load_task_config(parse_args(["--config", config, "--set", *sets]), task)


def validated(config: str, task: str, *sets: str):
    cfg = load(config, task, *sets)
    validate_config(cfg, task, config, list(sets))
    return cfg


def variant(tmp_path, task: str, edit) -> str:
    """The tiny config of `task` changed by edit(config), written to tmp_path/config.yaml."""
    config = load_config(TINY[task])
    edit(config)
    path = str(tmp_path / "config.yaml")
    save_config(config, path)
    return path


# ---------------------------------------------------------------- shipped configs


@pytest.mark.parametrize("path", SHIPPED)
def test_shipped_configs_validate(path):
    task = task_of(path)
    if os.sep + "tiny" + os.sep in path:  # the synthetic data is generated on first use: no path errors
        validated(path, task)
        return
    # The paper-scale configs name the paper's datasets, which the repository does not hold: keys,
    # types and GRIT sizes pass, and those data files are the only complaint.
    with pytest.raises(ConfigError) as err:
        validated(path, task)
    head, *lines = str(err.value).splitlines()
    assert head == "configured data paths that do not exist:" and lines
    for line in lines:
        key, _, rest = line.strip().partition(": ")
        assert key in DATA_KEYS and rest.startswith("data/") and rest.endswith(f"(no such file; from {path})")


# The image transform's keys, with create_dataset's defaults: every tiny stage must see the synthetic
# images as the tiny pre-training did (NLVR stage 1 once lacked randaugment: false and so trained on
# RandAugment-ed 48 px shapes, where its accuracy stayed at chance).
TRANSFORM_DEFAULTS = {"image_res": None, "hflip": True, "randaugment": True, "crop_scale": None}


@pytest.mark.parametrize("path", [p for p in SHIPPED if f"{os.sep}tiny{os.sep}" in p])
def test_tiny_configs_transform_images_as_the_tiny_pretraining(path):
    pretrain = load_config(os.path.join(ROOT, TINY["pretrain"]))
    config = load_config(os.path.join(ROOT, path))
    for key, default in TRANSFORM_DEFAULTS.items():
        assert config.get(key, default) == pretrain.get(key, default), (path, key)


def test_schema_covers_every_task():
    assert set(schema.TASKS) == {task_of(p) for p in SHIPPED}
    with pytest.raises(ValueError, match="unknown task"):
        schema.keys("captioning")


# ---------------------------------------------------------------- unknown keys


def test_unknown_keys_in_file_and_set_are_listed_together_with_hints(tmp_path):
    def edit(config):
        config["lamda_cons"] = 0.1
        config["grit"]["serch_space"] = 8

    path = variant(tmp_path, "pretrain", edit)
    with pytest.raises(ConfigError) as err:
        load(path, "pretrain", "image_rez=32", "grit.enabled=false")
    msg = str(err.value)
    assert msg.startswith("3 unknown config keys:")
    assert f"unknown config key 'lamda_cons' (did you mean 'lambda_cons'?) in {path}" in msg
    assert f"unknown config key 'grit.serch_space' (did you mean 'grit.search_space'?) in {path}" in msg
    assert "unknown config key 'image_rez' (did you mean 'image_res'?) in --set" in msg
    assert "grit.enabled" not in msg


def test_one_unknown_key_is_one_line():
    with pytest.raises(ConfigError) as err:
        load(TINY["retrieval"], "retrieval", "k_tset=8")
    assert str(err.value) == "unknown config key 'k_tset' (did you mean 'k_test'?) in --set"
    with pytest.raises(ConfigError) as err:  # inside a mapping set whole
        load(TINY["retrieval"], "retrieval", "optimizer={opt: adamW, lrr: 1.0e-4}")
    assert str(err.value) == "unknown config key 'optimizer.lrr' (did you mean 'optimizer.lr'?) in --set"


def test_a_config_for_another_script_names_the_script_that_reads_its_keys():
    with pytest.raises(ConfigError) as err:
        load(TINY["pretrain"], "retrieval")
    msg = str(err.value)
    for key in ("grit", "batch_size"):
        assert f"unknown config key '{key}' (read by pretrain, not by retrieval) in {TINY['pretrain']}" in msg


def test_set_may_add_a_known_key_the_file_lacks(tmp_path):
    def edit(config):
        del config["print_freq"]
        config["grit"] = None

    path = variant(tmp_path, "pretrain", edit)
    config = validated(path, "pretrain", "print_freq=7", "vision_drop_path=0.1", "grit.enabled=false",
                       "train_file.1=data/synthetic/pretrain.json")
    assert config["print_freq"] == 7 and config["vision_drop_path"] == 0.1
    assert dict(config["grit"]) == {"enabled": False}  # the null block became a mapping
    assert list(config["train_file"]) == ["data/synthetic/pretrain.json"] * 2  # a list item, as before
    # Without a schema (tools, tests) an override still has to name a key of the file.
    with pytest.raises(ConfigError, match="unknown config key 'vision_drop_path'"):
        load_config(path, ["vision_drop_path=0.1"])


def test_schedular_and_scheduler_together_are_refused(tmp_path):
    path = variant(tmp_path, "vqa", lambda config: config.update(scheduler={"epochs": 3}))
    with pytest.raises(ConfigError, match="both 'schedular' and 'scheduler'.*keep one"):
        load(path, "vqa")


# ---------------------------------------------------------------- types


def test_wrong_types_name_key_type_value_and_source(tmp_path):
    path = variant(tmp_path, "pretrain", lambda config: config.update(image_res="48"))
    with pytest.raises(ConfigError) as err:
        validated(path, "pretrain", "grit.enabled=maybe", "train_file=5", "clip_grad=[1]",
                  "optimizer.lr=fast", "seed=1.5")
    head, *lines = str(err.value).splitlines()
    assert head == "6 config values have the wrong type:"
    assert sorted(lines) == [
        "  config key 'clip_grad' must be float or null, got [1] (list) from --set",
        "  config key 'grit.enabled' must be bool, got 'maybe' (str) from --set",
        f"  config key 'image_res' must be int, got '48' (str) from {path}",
        "  config key 'optimizer.lr' must be number, got 'fast' (str) from --set",
        "  config key 'seed' must be int, got 1.5 (float) from --set",
        "  config key 'train_file' must be str or list of str, got 5 (int) from --set",
    ]


def test_types_accept_ints_for_floats_nulls_where_allowed_and_numeric_strings_for_the_optimizer():
    config = validated(TINY["pretrain"], "pretrain", "lambda_cons=0", "temp=1", "clip_grad=null",
                       "optimizer.lr='5e-4'", "crop_scale=[1, 1]", "vision_init=null", "grit.queue_size=null",
                       "grit.enabled=false")
    assert config["optimizer"]["lr"] == "5e-4"  # training.optimizer reads it with float()


# ---------------------------------------------------------------- GRIT sizes


@pytest.mark.parametrize("sets, message", [
    (["grit.search_space=4"], "grit.search_space (4) must be >= batch_size (8)"),
    (["batch_size=1024"], "grit.search_space (768) must be >= batch_size (1024)"),
    (["grit.queue_size=512"], "grit.queue_size (512) must be >= grit.search_space (768)"),
])
def test_grit_sizes_are_checked_when_grit_is_on(sets, message):
    with pytest.raises(ConfigError) as err:
        validated(TINY["pretrain"], "pretrain", *sets)
    assert message in str(err.value) and str(err.value).endswith(f"(from --set and {TINY['pretrain']})")
    validated(TINY["pretrain"], "pretrain", *sets, "grit.enabled=false")


# ---------------------------------------------------------------- data paths


def test_missing_data_paths_are_listed_together_and_synthetic_ones_are_not(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("[]")
    synthetic = tmp_path / "synthetic"  # not there yet: prepare_data generates it
    sets = [f"synthetic_root={synthetic}",
            f"train_file=[{real}, {tmp_path}/gone.json, {synthetic}/later.json]",
            f"image_root={tmp_path}/images", f"vocab_file={synthetic}/vocab.txt",
            f"grit.warmstart_indices={tmp_path}/g.pt"]
    with pytest.raises(ConfigError) as err:
        validated(TINY["pretrain"], "pretrain", *sets)
    assert str(err.value).splitlines() == [
        "configured data paths that do not exist:",
        f"  train_file: {tmp_path}/gone.json (no such file; from --set)",
        f"  image_root: {tmp_path}/images (no such folder; from --set)",
        f"  grit.warmstart_indices: {tmp_path}/g.pt (no such file; from --set)",
    ]
    # GritSampler reads warmstart_indices only with GRIT on
    with pytest.raises(ConfigError) as err:
        validated(TINY["pretrain"], "pretrain", *sets, "grit.enabled=false")
    assert "warmstart" not in str(err.value)


def test_nlvr_stage_1_does_not_open_the_evaluation_files(tmp_path):
    missing = f"val_file={tmp_path}/dev.json"
    validated("configs/tiny/NLVR_pretrain.yaml", "nlvr", missing)
    with pytest.raises(ConfigError, match="val_file: .*dev.json"):
        validated(TINY["nlvr"], "nlvr", missing)


# ---------------------------------------------------------------- one global batch


def test_check_global_batch():
    config = {"train_file": ["a.json", "b.json"], "batch_size": 8}
    check_global_batch(16, config, "batch_size", 2)  # exactly one global batch
    with pytest.raises(ConfigError) as err:
        check_global_batch(15, config, "batch_size", 2)
    assert str(err.value) == ("train_file (a.json, b.json) has 15 entries, fewer than one global batch: "
                              "batch_size 8 x world size 2 = 16; lower batch_size or use fewer processes")


def _model_built(*args, **kwargs):
    raise AssertionError("the model was built")


def _small_data(tmp_path) -> list[str]:
    """--set items pointing a tiny config at 3 image-caption entries (no images: none is read)."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "cat"]) + "\n")
    train = tmp_path / "train.json"
    train.write_text(json.dumps([{"image": f"{i}.png", "caption": "a cat", "image_id": i} for i in range(3)]))
    evaluation = tmp_path / "eval.json"
    evaluation.write_text(json.dumps([{"image": "0.png", "caption": ["a cat"]}]))
    return ["synthetic_root=null", f"image_root={tmp_path}", f"vocab_file={vocab}", f"train_file=[{train}]",
            f"val_file={evaluation}", f"test_file={evaluation}"]


def test_pretrain_too_small_for_a_batch_fails_before_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(Pretrain, "ALBEF_Base", _model_built)
    sets = [s for s in _small_data(tmp_path) if not s.startswith(("val_file", "test_file"))]
    with pytest.raises(ConfigError, match=r"has 3 entries, fewer than one global batch: batch_size 8 x world "
                                          r"size 1 = 8"):
        Pretrain.main(["--config", TINY["pretrain"], "--output_dir", str(tmp_path / "out"), "--device", "cpu",
                       "--set", *sets])


def test_finetune_too_small_for_a_batch_fails_before_the_model_unless_evaluating(tmp_path, monkeypatch):
    monkeypatch.setattr(Retrieval, "build_on_every_rank", _model_built)
    argv = ["--config", TINY["retrieval"], "--output_dir", str(tmp_path / "out"), "--device", "cpu",
            "--set", *_small_data(tmp_path)]
    with pytest.raises(ConfigError, match=r"has 3 entries, fewer than one global batch: batch_size_train 32"):
        Retrieval.main(argv)
    with pytest.raises(AssertionError, match="the model was built"):  # evaluation trains on nothing
        Retrieval.main([*argv, "--evaluate"])


# ---------------------------------------------------------------- start() and the command line


@pytest.mark.parametrize("sets, message", [
    (["grit.serch_space=4"],
     "unknown config key 'grit.serch_space' (did you mean 'grit.search_space'?) in --set"),
    (["image_res=big"], "config key 'image_res' must be int, got 'big' (str) from --set"),
    (["grit.search_space=4"], "grit.search_space (4) must be >= batch_size (8)"),
    (["synthetic_root=null", "train_file=[nowhere.json]"],
     "train_file: nowhere.json (no such file; from --set)"),
])
def test_start_validates_before_the_process_group_data_and_model(monkeypatch, sets, message):
    def started(*args, **kwargs):
        raise AssertionError("init_distributed ran")

    monkeypatch.setattr(training.cli, "init_distributed", started)
    with pytest.raises(ConfigError) as err:
        training.cli.start(["--config", TINY["pretrain"], "--set", *sets], task="pretrain")
    assert message in str(err.value)


def test_script_with_a_bad_key_exits_2_with_one_message(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("WORLD_SIZE", None)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "Pretrain.py", "--config", TINY["pretrain"], "--output_dir",
                           str(out), "--device", "cpu", "--set", "lamda_cons=0.1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last == "error: unknown config key 'lamda_cons' (did you mean 'lambda_cons'?) in --set"
    assert not out.exists()  # nothing was written: the run stopped at start()
