"""The typed config (training.config, training.config_resolve): every key defined once, YAML + base overlays +
--set resolved once at start-up, unknown keys with hints, types, allowed values, bounds, rules between keys,
data paths, ALBEF's own config files, and the resolved config written out and read back."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import typing

import pytest
import torch

import Pretrain
import Retrieval
import training.cli
from training.config import TASK_CONFIGS, Batching, Optimizer, Schedule, config_class
from training.config_albef import ALBEF_KEYS
from training.config_files import (
    ConfigError,
    config_to_dict,
    load_config,
    render_config,
    save_config,
    save_resolved,
)
from training.config_resolve import known_keys, resolve_config
from training.loaders import check_global_batch

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


def variant(tmp_path, task: str, edit, name: str = "config.yaml") -> str:
    """The tiny config of `task` changed by edit(config), written to tmp_path/name."""
    config = load_config(TINY[task])
    edit(config)
    path = str(tmp_path / name)
    save_config(config, path)
    return path


def message(task: str, path: str, *sets: str, **flags) -> str:
    """The ConfigError resolving `path` for `task` with --set items raises."""
    with pytest.raises(ConfigError) as err:
        resolve_config(task, path, list(sets), flags)
    return str(err.value)


# ---------------------------------------------------------------- one place per key


@pytest.mark.parametrize("task", sorted(TASK_CONFIGS))
def test_every_key_has_a_type_a_meaning_and_at_most_one_default(task):
    cls = config_class(task)
    hints = typing.get_type_hints(cls)
    for block in (cls, Optimizer, Schedule, Batching):
        for f in dataclasses.fields(block):
            assert f.metadata.get("meaning"), f"{block.__name__}.{f.name} has no meaning"
            assert f.name in typing.get_type_hints(block)
    assert set(known_keys(task)) >= set(hints) - {"task"}


def test_the_code_holds_no_default_of_a_config_key():
    """`config.get(` and `config[` reads are gone: code reads the typed config's attributes."""
    offenders = []
    for folder in ("models", "dataset", "grit", "training", "tools"):
        for path in glob.glob(os.path.join(ROOT, folder, "*.py")):
            if os.path.basename(path) in ("config_files.py", "config_resolve.py"):  # YAML mechanics
                continue
            text = open(path, encoding="utf-8").read()
            for needle in ("config.get(", 'config["', "config['", "cfg.get("):
                if needle in text:
                    offenders.append(f"{os.path.relpath(path, ROOT)}: {needle}")
    for script in ("Pretrain.py", "Retrieval.py", "NLVR.py", "VQA.py", "demo.py"):
        text = open(os.path.join(ROOT, script), encoding="utf-8").read()
        offenders += [f"{script}: {n}" for n in ("config.get(", 'config["', "config['") if n in text]
    assert offenders == []


# ---------------------------------------------------------------- shipped configs


@pytest.mark.parametrize("path", SHIPPED)
def test_shipped_configs_resolve(path):
    task = task_of(path)
    if os.sep + "tiny" + os.sep in path:  # the synthetic data is generated on first use: no path errors
        assert isinstance(resolve_config(task, path), config_class(task))
        return
    keys, missing = DATA_KEYS, "no such file"
    if os.sep + "real" + os.sep in path:  # tools.make_real's corpora (data/real): built here, or not
        if os.path.isfile(os.path.join(ROOT, "data", "real", "card.json")):
            assert isinstance(resolve_config(task, path), config_class(task))
            return
        keys, missing = DATA_KEYS + ("image_root", "vocab_file"), "no such f"  # file, or folder
    # The paper-scale configs name the paper's datasets, which the repository does not hold: keys,
    # types and GRIT sizes pass, and those data files are the only complaint.
    head, *lines = message(task, path).splitlines()
    assert head == "configured data paths that do not exist:" and lines
    for line in lines:
        key, _, rest = line.strip().partition(": ")
        assert key in keys and rest.startswith("data/") and f"({missing}" in rest
        assert rest.endswith(f"; from {path})")
    assert isinstance(resolve_config(task, path, check_paths=False), config_class(task))


# The image transform's keys: every tiny stage must see the synthetic images as the tiny pre-training did
# (NLVR stage 1 once lacked randaugment: false and so trained on RandAugment-ed 48 px shapes, where its
# accuracy stayed at chance).
@pytest.mark.parametrize("path", [p for p in SHIPPED if f"{os.sep}tiny{os.sep}" in p])
def test_tiny_configs_transform_images_as_the_tiny_pretraining(path):
    pretrain = resolve_config("pretrain", TINY["pretrain"])
    config = resolve_config(task_of(path), path)
    for key in ("image_res", "hflip", "randaugment", "crop_scale"):
        assert getattr(config, key) == getattr(pretrain, key), (path, key)


def test_base_overlays_resolve_to_the_base_with_the_overlay_laid_over():
    row = resolve_config("pretrain", "configs/ablation/tiny/grit_naive.yaml")
    base = resolve_config("pretrain", TINY["pretrain"])
    assert row.batching.mode == "naive" and not row.batching.example_shuffle and row.lambda_cons == 0.0
    assert dataclasses.replace(row, batching=base.batching, lambda_cons=base.lambda_cons) == base


# ---------------------------------------------------------------- defaults and round trip


def test_defaults_are_filled_once_and_the_resolved_config_round_trips(tmp_path):
    def edit(config):
        for key in ("print_freq", "max_epoch", "num_workers"):
            del config[key]
        del config["schedular"]["warmup_lr"]

    path = variant(tmp_path, "pretrain", edit)
    config = resolve_config("pretrain", path, ["optimizer.eps=1.0e-6"], {"seed": 7})
    default = {f.name: f.default for f in dataclasses.fields(config)}
    assert config.print_freq == default["print_freq"] == 50 and config.num_workers == 0
    assert config.max_epoch == config.schedular.epochs  # null: schedular.epochs, written as the number
    assert config.schedular.warmup_lr == config.schedular.min_lr
    assert config.schedular.lr == config.optimizer.lr
    assert config.optimizer.eps == 1e-6 and config.seed == 7
    saved = str(tmp_path / "resolved.yaml")
    save_resolved(config, saved)
    assert resolve_config("pretrain", saved) == config
    text = open(saved, encoding="utf-8").read()
    for key in known_keys("pretrain"):  # every key written, each with its meaning
        assert f"{key.rsplit('.', 1)[-1]}:" in text
    assert "# MLM masking rate" in text
    assert config_to_dict(config)["batching"]["search_space"] == 120


def test_print_config_prints_every_key_with_its_meaning_and_exits_0(capsys):
    with pytest.raises(SystemExit) as stop:
        training.cli.start(["--config", TINY["retrieval"], "--print_config", "--set", "k_test=4"],
                           Retrieval.PARSER, "retrieval")
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out == render_config(resolve_config("retrieval", TINY["retrieval"], ["k_test=4"]))
    assert "k_test: 4" in out and "# ITC candidates per query that ITM re-ranks" in out


# ---------------------------------------------------------------- unknown keys


def test_unknown_keys_in_file_and_set_are_listed_together_with_hints(tmp_path):
    def edit(config):
        config["lamda_cons"] = 0.1
        config["batching"]["serch_space"] = 8

    path = variant(tmp_path, "pretrain", edit)
    msg = message("pretrain", path, "image_rez=32", "batching.strategy=random")
    assert msg.startswith("3 unknown config keys:")
    assert f"unknown config key 'lamda_cons' (did you mean 'lambda_cons'?) in {path}" in msg
    assert (f"unknown config key 'batching.serch_space' (did you mean 'batching.search_space'?) in {path}"
            in msg)
    assert "unknown config key 'image_rez' (did you mean 'image_res'?) in --set" in msg
    assert "batching.strategy" not in msg


def test_one_unknown_key_is_one_line():
    assert message("retrieval", TINY["retrieval"], "k_tset=8") == \
        "unknown config key 'k_tset' (did you mean 'k_test'?) in --set"
    assert message("retrieval", TINY["retrieval"], "optimizer={opt: adamW, lrr: 1.0e-4}") == \
        "unknown config key 'optimizer.lrr' (did you mean 'optimizer.lr'?) in --set"


def test_a_config_for_another_script_names_the_script_that_reads_its_keys():
    msg = message("retrieval", TINY["pretrain"])
    for key in ("batching", "batch_size"):
        assert f"unknown config key '{key}' (read by pretrain, not by retrieval) in {TINY['pretrain']}" in msg


def test_set_may_add_a_known_key_the_file_lacks(tmp_path):
    def edit(config):
        del config["print_freq"]
        config["batching"] = None

    def old_null(config):
        del config["batching"]
        config["grit"] = None

    path = variant(tmp_path, "pretrain", edit)
    config = resolve_config("pretrain", path, ["print_freq=7", "vision_drop_path=0.1",
                                               "batching.strategy=random",
                                               "train_file.1=data/synthetic/pretrain.json"])
    assert config.print_freq == 7 and config.vision_drop_path == 0.1
    assert config.batching == Batching()  # the null block became a mapping: random batches, defaults
    assert config.train_file == ["data/synthetic/pretrain.json"] * 2  # a list item, as before
    old = variant(tmp_path, "pretrain", old_null, "old.yaml")
    assert resolve_config("pretrain", old).batching == Batching()  # `grit: null` (old spelling): random
    # Without a task (plain YAML loading) an override still has to name a key of the file.
    with pytest.raises(ConfigError, match="unknown config key 'vision_drop_path'"):
        load_config(path, ["vision_drop_path=0.1"])


def test_old_batching_spelling_resolves_to_the_new(tmp_path, monkeypatch, capsys):
    """The `grit:` block of older configs (and `--set grit.X`) is read as `batching:`: grit.enabled true ->
    strategy grit, false or `grit: null` -> random, grit.<key> -> batching.<key>; a command line's old key
    overrides the file's new one; the same key in both spellings from one source is refused."""
    import training.config_resolve

    monkeypatch.setattr(training.config_resolve, "_noticed", set())  # the notice is printed once per source
    sizes = {"queue_size": 64, "search_space": 16}

    def block(name: str, value):
        def edit(config):
            del config["batching"]
            config[name] = value
        return edit

    old = variant(tmp_path, "pretrain", block("grit", {"enabled": True, **sizes}), "old.yaml")
    new = variant(tmp_path, "pretrain", block("batching", {"strategy": "grit", **sizes}), "new.yaml")
    assert capsys.readouterr().err == ""
    assert resolve_config("pretrain", old) == resolve_config("pretrain", new)
    assert resolve_config("pretrain", new).batching == Batching(strategy="grit", **sizes)
    err = capsys.readouterr().err
    assert f"notice: {old}: the `grit:` block is read as `batching:`" in err and str(new) not in err
    old_null = variant(tmp_path, "pretrain", block("grit", None), "old_null.yaml")
    new_random = variant(tmp_path, "pretrain", block("batching", {"strategy": "random"}), "new_random.yaml")
    assert resolve_config("pretrain", old_null) == resolve_config("pretrain", new_random)
    assert resolve_config("pretrain", old_null).batching == Batching()
    # --set in the old spelling over a file in the new one, and in the new over one in the old
    random = variant(tmp_path, "pretrain", block("batching", {"strategy": "random", **sizes}), "random.yaml")
    for path, old_sets, new_sets in (
            (TINY["pretrain"], ["grit.enabled=false"], ["batching.strategy=random"]),
            (random, ["grit.enabled=true"], ["batching.strategy=grit"]),
            (TINY["pretrain"], ["grit.search_space=32"], ["batching.search_space=32"]),
            (TINY["pretrain"], ["grit.queue_size=240", "grit.mode=naive"],
             ["batching.queue_size=240", "batching.mode=naive"]),
            (old, ["batching.search_space=32"], ["batching.search_space=32"])):
        via_old = resolve_config("pretrain", path, old_sets)
        assert via_old == resolve_config("pretrain", path, new_sets), (path, old_sets)
        assert via_old != resolve_config("pretrain", path), (path, old_sets)  # the override acted
    assert resolve_config("pretrain", TINY["pretrain"], ["grit.search_space=32"]).batching.search_space == 32
    assert resolve_config("pretrain", old, ["batching.search_space=32"]).batching.search_space == 32
    # one key in both spellings from one source: refused, naming both
    both = variant(tmp_path, "pretrain", lambda config: config.update(grit={"queue_size": 1440}), "both.yaml")
    msg = message("pretrain", both)
    assert "config has both 'grit.queue_size' and 'batching.queue_size'" in msg and both in msg
    msg = message("pretrain", TINY["pretrain"], "grit.search_space=32", "batching.search_space=32")
    assert "config has both 'grit.search_space' and 'batching.search_space' (from --set)" in msg
    assert "batching.strategy 'b3' groups batches, but grit.enabled is false" in message(
        "pretrain", TINY["pretrain"], "batching.strategy=b3", "grit.enabled=false")
    # a grit block without `enabled` meant GRIT on (the block's default), and `--set grit=null` off
    no_switch = variant(tmp_path, "pretrain", block("grit", dict(sizes)), "no_switch.yaml")
    assert resolve_config("pretrain", no_switch) == resolve_config("pretrain", new)
    assert resolve_config("pretrain", TINY["pretrain"], ["grit=null"]) == resolve_config(
        "pretrain", TINY["pretrain"], ["batching.strategy=random"])
    assert "config key 'grit.enabled' (the old spelling of batching.strategy) must be bool" in message(
        "pretrain", TINY["pretrain"], "grit.enabled=maybe")


def test_scheduler_is_read_as_schedular_and_both_together_are_refused(tmp_path):
    def rename(config):
        config["scheduler"] = config.pop("schedular")

    path = variant(tmp_path, "vqa", rename)
    assert resolve_config("vqa", path).schedular == resolve_config("vqa", TINY["vqa"]).schedular
    both = variant(tmp_path, "vqa", lambda config: config.update(scheduler={"epochs": 3}), "both.yaml")
    assert "both 'schedular' and 'scheduler'" in message("vqa", both) and "keep one" in message("vqa", both)


def test_a_missing_required_key_is_named_with_its_file(tmp_path):
    path = variant(tmp_path, "retrieval", lambda config: config.pop("image_res"))
    assert message("retrieval", path) == f"config key 'image_res' is required but missing in {path}"


# ---------------------------------------------------------------- types, values, bounds


def test_wrong_types_name_key_type_value_and_source(tmp_path):
    path = variant(tmp_path, "pretrain", lambda config: config.update(image_res="48"))
    head, *lines = message("pretrain", path, "batching.example_shuffle=maybe", "train_file=5",
                           "clip_grad=[1]", "optimizer.lr=fast", "seed=1.5").splitlines()
    assert head == "6 config values are wrong:"
    assert sorted(lines) == [
        "  config key 'batching.example_shuffle' must be bool, got 'maybe' (str) from --set",
        "  config key 'clip_grad' must be float or null, got [1] (list) from --set",
        f"  config key 'image_res' must be int, got '48' (str) from {path}",
        "  config key 'optimizer.lr' must be float, got 'fast' (str) from --set",
        "  config key 'seed' must be int, got 1.5 (float) from --set",
        "  config key 'train_file' must be str or list of str or null, got 5 (int) from --set",
    ]


def test_values_outside_the_allowed_set_name_the_key_the_values_and_the_file(tmp_path):
    path = variant(tmp_path, "pretrain", lambda config: config.update(hard_sampling="softmax"))
    assert message("pretrain", path) == ("config key 'hard_sampling' must be one of 'argmax', "
                                         f"'multinomial', got 'softmax' (str) from {path}")
    assert message("retrieval", TINY["retrieval"], "momentum_init=latest") == (
        "config key 'momentum_init' must be one of 'initial', 'checkpoint', got 'latest' (str) from --set")
    assert "'amp' must be bool or 'bf16'" in message("pretrain", TINY["pretrain"], "amp=fp8")


def test_numbers_out_of_bounds_are_refused():
    assert message("pretrain", TINY["pretrain"], "batch_size=0") == \
        "config key 'batch_size' must be >= 1, got 0 from --set"
    assert "config key 'max_bad_fraction' must be <= 1, got 2 from --set" in \
        message("pretrain", TINY["pretrain"], "max_bad_fraction=2")
    assert "config key 'optimizer.lr' must be > 0, got 0 from --set" in \
        message("pretrain", TINY["pretrain"], "optimizer.lr=0")


def test_types_accept_ints_for_floats_nulls_where_allowed_and_numeric_strings_for_floats():
    config = resolve_config("pretrain", TINY["pretrain"],
                            ["lambda_cons=0", "temp=1", "clip_grad=null", "optimizer.lr='5e-4'",
                             "schedular.lr='5e-4'", "crop_scale=[1, 1]", "vision_init=null",
                             "batching.queue_size=null", "batching.strategy=random"])
    assert config.optimizer.lr == 5e-4 and isinstance(config.temp, float) and config.crop_scale == [1.0, 1.0]
    assert config.clip_grad is None and config.batching.queue_size is None


def test_rules_between_keys_name_the_keys_and_where_they_came_from():
    assert message("pretrain", TINY["pretrain"], "image_res=50") == (
        f"image_res (50) must be a multiple of patch_size (8) (from --set and {TINY['pretrain']})")
    assert "schedular.lr (0.001) differs from optimizer.lr (0.0005)" in \
        message("pretrain", TINY["pretrain"], "schedular.lr=1.0e-3")
    assert "itc, itm and mlm are all false" in message("pretrain", TINY["pretrain"], "itc=false", "itm=false",
                                                      "mlm=false")
    assert "crop_scale must be two numbers" in message("pretrain", TINY["pretrain"], "crop_scale=[0.5]")


@pytest.mark.parametrize("sets, text", [
    (["batching.search_space=4"], "batching.search_space (4) must be >= batch_size (8)"),
    (["batch_size=1024"], "batching.search_space (120) must be >= batch_size (1024)"),
    (["batching.queue_size=96"], "batching.queue_size (96) must be >= batching.search_space (120)"),
])
def test_grit_sizes_are_checked_when_batches_are_grouped(sets, text):
    msg = message("pretrain", TINY["pretrain"], *sets)
    assert text in msg and msg.endswith(f"(from --set and {TINY['pretrain']})")
    resolve_config("pretrain", TINY["pretrain"], [*sets, "batching.strategy=random"])


# ---------------------------------------------------------------- data paths


def test_missing_data_paths_are_listed_together_and_synthetic_ones_are_not(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("[]")
    synthetic = tmp_path / "synthetic"  # not there yet: prepare_data generates it
    sets = [f"synthetic_root={synthetic}",
            f"train_file=[{real}, {tmp_path}/gone.json, {synthetic}/later.json]",
            f"image_root={tmp_path}/images", f"vocab_file={synthetic}/vocab.txt",
            f"batching.warmstart_indices={tmp_path}/g.pt"]
    assert message("pretrain", TINY["pretrain"], *sets).splitlines() == [
        "configured data paths that do not exist:",
        f"  train_file: {tmp_path}/gone.json (no such file; from --set)",
        f"  image_root: {tmp_path}/images (no such folder; from --set)",
        f"  batching.warmstart_indices: {tmp_path}/g.pt (no such file; from --set)",
    ]
    # GritSampler reads warmstart_indices only while batches are grouped
    assert "warmstart" not in message("pretrain", TINY["pretrain"], *sets, "batching.strategy=random")


def test_nlvr_stage_1_does_not_open_the_evaluation_files(tmp_path):
    missing = f"val_file={tmp_path}/dev.json"
    resolve_config("nlvr", "configs/tiny/NLVR_pretrain.yaml", [missing])
    assert "val_file: " in message("nlvr", TINY["nlvr"], missing)
    assert "val_file is required for NLVR2 fine-tuning" in message("nlvr", TINY["nlvr"], "val_file=null")


# ---------------------------------------------------------------- ALBEF's own config files

# Configs in the format of ALBEF's configs/*.yaml (their keys and values), written for the test.
ALBEF_RETRIEVAL = """train_file: ['data/coco_train.json']
val_file: 'data/coco_val.json'
test_file: 'data/coco_test.json'
image_root: '/datasets/coco/'
bert_config: 'configs/config_bert.json'
image_res: 384
batch_size_train: 32
batch_size_test: 64
queue_size: 65536
momentum: 0.995
vision_width: 768
embed_dim: 256
temp: 0.07
k_test: 256
alpha: 0.4
distill: True
warm_up: True
optimizer: {opt: adamW, lr: 1e-5, weight_decay: 0.02}
schedular: {sched: cosine, lr: 1e-5, epochs: 5, min_lr: 1e-6, decay_rate: 1, warmup_lr: 1e-5,
            warmup_epochs: 1, cooldown_epochs: 0}
"""
ALBEF_NLVR = """train_file: ['data/nlvr_train.json']
val_file: ['data/nlvr_dev.json']
test_file: ['data/nlvr_test.json']
image_root: '/datasets/NLVR2/'
image_res: 384
batch_size: 16
bert_config: 'configs/config_bert.json'
alpha: 0.4
distill: True
warm_up: True
eval_ema: False
optimizer: {opt: adamW, lr: 2e-5, weight_decay: 0.02}
schedular: {sched: cosine, lr: 2e-5, epochs: 10, min_lr: 1e-6, decay_rate: 1, warmup_lr: 1e-5,
            warmup_epochs: 1, cooldown_epochs: 0}
"""
ALBEF_PRETRAIN = """train_file: ['data/coco.json', 'data/vg.json']
bert_config: 'configs/config_bert.json'
image_res: 256
vision_width: 768
embed_dim: 256
batch_size: 64
temp: 0.07
mlm_probability: 0.15
queue_size: 65536
momentum: 0.995
alpha: 0.4
optimizer: {opt: adamW, lr: 1e-4, weight_decay: 0.02}
schedular: {sched: cosine, lr: 1e-4, epochs: 30, min_lr: 1e-5, decay_rate: 1, warmup_lr: 1e-5,
            warmup_epochs: 20, cooldown_epochs: 0}
"""
ALBEF_VQA = """train_file: ['data/vqa_train.json']
test_file: ['data/vqa_test.json']
answer_list: 'data/answer_list.json'
vqa_root: '/datasets/VQA/Images/mscoco/'
vg_root: '/datasets/visual-genome/'
image_res: 384
batch_size_train: 32
batch_size_test: 16
k_test: 128
eos: '[SEP]'
bert_config: 'configs/config_bert.json'
optimizer: {opt: adamW, lr: 2e-5, weight_decay: 0.02}
schedular: {sched: cosine, lr: 2e-5, epochs: 8, min_lr: 1e-6, decay_rate: 1, warmup_lr: 1e-5,
            warmup_epochs: 4, cooldown_epochs: 0}
"""


def albef_file(tmp_path, text: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_albef_files_refuse_momentum_distillation_and_say_what_to_do(tmp_path):
    path = albef_file(tmp_path, ALBEF_RETRIEVAL, "Retrieval_coco.yaml")
    msg = message("retrieval", path)
    assert msg.startswith("3 ALBEF config keys this code does not take:")
    assert "'distill' (True, from" in msg and "delete distill, alpha and warm_up" in msg
    msg = message("pretrain", albef_file(tmp_path, ALBEF_PRETRAIN, "Pretrain.yaml"))
    assert "delete queue_size (GRIT's own queue is batching.queue_size)" in msg and "delete momentum" in msg
    msg = message("vqa", albef_file(tmp_path, ALBEF_VQA, "VQA.yaml"))
    assert "vqa_root is ALBEF's; here every json image path is relative to image_root" in msg
    assert "eos" not in msg  # '[SEP]' is what the decoder does


def test_albef_files_resolve_once_their_refused_keys_are_settled(tmp_path):
    # alpha is refused whatever its value; the file without it (and with distillation off) resolves.
    text = ALBEF_RETRIEVAL.replace("alpha: 0.4\n", "").replace("True", "False")
    config = resolve_config("retrieval", albef_file(tmp_path, text, "r.yaml"), check_paths=False)
    assert config.schedular.warmup_steps == 100  # ALBEF: warmup_epochs x step_size 100
    assert config.schedular.decay_rate == 1 and config.k_test == 256 and config.queue_size == 65536
    nlvr = ALBEF_NLVR.replace("alpha: 0.4\n", "").replace("True", "False")
    config = resolve_config("nlvr", albef_file(tmp_path, nlvr, "NLVR.yaml"), check_paths=False)
    assert config.batch_size_train == 16 and config.schedular.warmup_steps == 100
    with pytest.raises(ConfigError, match="both 'batch_size' .* and 'batch_size_train'"):
        resolve_config("nlvr", albef_file(tmp_path, nlvr, "NLVR.yaml"), ["batch_size_train=8"],
                       check_paths=False)
    assert set(ALBEF_KEYS) >= {"schedular.warmup_epochs", "alpha", "distill", "warm_up"}


# ---------------------------------------------------------------- one global batch, start()


def test_check_global_batch():
    check_global_batch(16, 8, 2, ["a.json", "b.json"], "batch_size")  # exactly one global batch
    with pytest.raises(ConfigError) as err:
        check_global_batch(15, 8, 2, ["a.json", "b.json"], "batch_size")
    assert str(err.value) == ("the training data (a.json, b.json) has 15 entries, fewer than one global "
                              "batch: "
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
    return ["synthetic_root=null", "vision_init=null", f"image_root={tmp_path}", f"vocab_file={vocab}",
            f"train_file=[{train}]", f"val_file={evaluation}", f"test_file={evaluation}"]


def test_pretrain_too_small_for_a_batch_fails_before_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(Pretrain, "ALBEF_Base", _model_built)
    sets = [s for s in _small_data(tmp_path) if not s.startswith(("val_file", "test_file"))]
    with pytest.raises(ConfigError, match=r"has 3 entries, fewer than one global batch: batch_size 8 x world "
                                          r"size 1 = 8"):
        Pretrain.main(["--config", TINY["pretrain"], "--output_dir", str(tmp_path / "out"), "--device", "cpu",
                       "--set", *sets])
    assert not (tmp_path / "out").exists()


def test_finetune_too_small_for_a_batch_fails_before_the_model_unless_evaluating(tmp_path, monkeypatch):
    import training.finetune

    monkeypatch.setattr(training.finetune, "build_on_every_rank", _model_built)  # the scaffold builds it
    argv = ["--config", TINY["retrieval"], "--output_dir", str(tmp_path / "out"), "--device", "cpu",
            "--set", *_small_data(tmp_path)]
    with pytest.raises(ConfigError, match=r"has 3 entries, fewer than one global batch: batch_size_train 32"):
        Retrieval.main(argv)
    with pytest.raises(AssertionError, match="the model was built"):  # evaluation trains on nothing
        Retrieval.main([*argv, "--evaluate"])


@pytest.mark.parametrize("sets, text", [
    (["batching.serch_space=4"],
     "unknown config key 'batching.serch_space' (did you mean 'batching.search_space'?) in --set"),
    (["image_res=big"], "config key 'image_res' must be int, got 'big' (str) from --set"),
    (["batching.search_space=4"], "batching.search_space (4) must be >= batch_size (8)"),
    (["synthetic_root=null", "vision_init=null", "train_file=[nowhere.json]"],
     "train_file: nowhere.json (no such file; from --set)"),
])
def test_start_resolves_before_the_process_group_data_and_model(monkeypatch, sets, text):
    def started(*args, **kwargs):
        raise AssertionError("init_distributed ran")

    monkeypatch.setattr(training.cli, "init_distributed", started)
    with pytest.raises(ConfigError) as err:
        training.cli.start(["--config", TINY["pretrain"], "--output_dir", "unused", "--set", *sets],
                           Pretrain.PARSER, "pretrain")
    assert text in str(err.value)


@pytest.mark.parametrize("sets,says", [
    (["batching.b3.rank_skip=2"], "batching.b3.rank_skip is set (2) but this run's strategy is 'grit'"),
    (["batching.grit.rank_skip=2", "batching.strategy=random"], "batching.grit.rank_skip is set (2)"),
    (["batching.strategy=b3", "grit.enabled=false"],
     "batching.strategy 'b3' groups batches, but grit.enabled"),
    (["batching.strategy=b3", "batching.b3.rank_skip=200"],
     "batching.b3.rank_skip (200) passes over all the 119 others"),
    (["batching.grit.rank_skip=119"], "batching.grit.rank_skip (119) must be below"),
    (["itc_smoothing=0.2", "itc_smoothing_epoch=12"], "itc_smoothing_epoch (12) is not before the run's end"),
    (["batching.group_from_epoch=12"], "batching.group_from_epoch (12) is not before the run's end"),
    (["itc=false", "itm_negatives=random", "itc_hn_beta=0.5"], "itc_hn_beta is 0.5 but itc is false"),
    (["batching.gcbs.k=5"], "'batching.gcbs.k' (did you mean 'batching.gcbs.neighbours'?)"),
])
def test_settings_that_cannot_act_are_refused_naming_the_key(sets, says):
    """Issue 50: a setting that would not act is one error naming it, not a run that ignores it."""
    assert says in message("pretrain", TINY["pretrain"], *sets)


def test_settings_that_act_are_accepted():
    for sets in (["batching.strategy=b3", "batching.b3.rank_skip=2"], ["batching.strategy=random"],
                 ["batching.grit.rank_skip=2", "batching.group_from_epoch=11"], ["itc_smoothing=0.2",
                 "itc_smoothing_epoch=11"], ["batching.strategy=b3", "batching.b3.rank_skip=100"],
                 ["batching.strategy=gcbs", "batching.gcbs.neighbours=500"]):
        resolve_config("pretrain", TINY["pretrain"], sets, check_paths=False)
