"""Helpers and fixtures shared by the tests: typed tiny configs, tokenizers, the repo root as working dir."""

from __future__ import annotations

import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def word_tokenizer(folder, words: list[str]):
    """A BertTokenizerFast over the special tokens and `words`, its vocab.txt written into folder."""
    from transformers import BertTokenizerFast

    path = os.path.join(str(folder), "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(SPECIAL_TOKENS + list(words)) + "\n")
    return BertTokenizerFast(vocab_file=path, do_lower_case=True)


TINY_CONFIGS = {"pretrain": "configs/tiny/Pretrain.yaml", "retrieval": "configs/tiny/Retrieval.yaml",
                "nlvr": "configs/tiny/NLVR.yaml", "vqa": "configs/tiny/VQA.yaml"}


def tiny_config(task: str, path: str | None = None, **values):
    """The typed config (training.config) of configs/tiny/<Task>.yaml, or of `path` (repo-relative), with
    `values` laid over its keys: a dict value merges into a block (grit={"enabled": False}). Data paths
    are not checked to exist (nothing is read)."""
    from training.config_files import load_config, to_plain
    from training.config_resolve import config_from_mapping

    path = path or TINY_CONFIGS[task]
    raw = to_plain(dict(load_config(os.path.join(ROOT, path))))
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return config_from_mapping(task, raw, source=path)


def small_pretrain_sets(data: str, **values) -> list[str]:
    """--set KEY=VALUE strings that shrink configs/tiny/Pretrain.yaml for script tests: the synthetic set
    at `data`, 32 px, patch 16, one ViT block, batch 8, no synthetic ViT; `values` add or replace keys."""
    sets = {"train_file": f"[{data}/pretrain.json]", "image_root": data, "vocab_file": f"{data}/vocab.txt",
            "synthetic_root": "null", "vision_init": "null", "image_res": 32, "patch_size": 16,
            "vision_depth": 1, "batch_size": 8}
    sets.update(values)
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.fixture(scope="module")
def in_repo():
    """Run the module from the repo root with one intra-op thread, the synthetic data generated.

    Configs and the synthetic data use repo-relative paths. One thread: on a busy 2-core machine two
    OpenMP threads per process make these tiny steps 10-30x slower, not faster.
    """
    from dataset import ensure_synthetic

    cwd, threads = os.getcwd(), torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    os.chdir(ROOT)
    torch.set_num_threads(1)
    ensure_synthetic("data/synthetic")
    yield
    torch.use_deterministic_algorithms(deterministic)  # the scripts set it from their configs
    torch.set_num_threads(threads)
    os.chdir(cwd)


@pytest.fixture(scope="module")
def pretrain_checkpoint(tmp_path_factory, tokenizer) -> tuple[str, dict]:
    """A tiny ALBEF_Base (tiny Pretrain.yaml sizes, the module's tokenizer) saved as {'model': state_dict}."""
    from models.pretrain import ALBEF_Base

    torch.manual_seed(0)
    model = ALBEF_Base(tiny_config("pretrain", vision_init=None), tokenizer)
    path = str(tmp_path_factory.mktemp("pretrain") / "checkpoint.pth")
    state = model.state_dict()
    torch.save({"model": state}, path)
    return path, state


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: on a shared 2-core machine a second OpenMP thread only
    spin-waits on these tiny matrices (it made steps up to ~20x slower); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
