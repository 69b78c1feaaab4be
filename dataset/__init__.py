"""Json-list datasets per task, ALBEF transforms, and the built-in synthetic data.

Config keys read by create_dataset: image_res, image_root, max_words, train_file, val_file,
test_file, answer_list (VQA), and optionally hflip / randaugment (default true, as in ALBEF; set
``hflip: false`` for data whose captions say left/right, e.g. the synthetic set) and crop_scale.
"""

from __future__ import annotations

import importlib

__all__ = [
    "ImageReadError", "ImageTextCollate", "NLVRDataset", "PretrainDataset", "RetrievalEvalDataset",
    "RetrievalTrainDataset",
    "VQADataset", "create_dataset", "ensure_synthetic", "prepare_data", "load_json_list", "pre_caption",
    "pre_question", "read_image", "resolve_image", "test_transform",
    "train_transform", "vqa_collate",
]

# Public names are imported on first use (PEP 562), so `python -m dataset.synthetic` stays light
# (no torch import) and does not import its own module twice.
_LAZY = {
    "NLVRDataset": "nlvr", "PretrainDataset": "pretrain", "RetrievalEvalDataset": "retrieval",
    "RetrievalTrainDataset": "retrieval", "VQADataset": "vqa", "vqa_collate": "vqa",
    "ensure_synthetic": "synthetic", "ImageTextCollate": "collate", "test_transform": "transforms",
    "train_transform": "transforms",
    "ImageReadError": "utils", "load_json_list": "utils", "pre_caption": "utils", "pre_question": "utils",
    "read_image": "utils", "resolve_image": "utils",
}

TASKS = ("pretrain", "retrieval", "nlvr", "vqa")


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_data(config: dict) -> None:
    """Generate the built-in synthetic dataset at config['synthetic_root'] if it names one and it is missing.

    Call it before anything reads the data (the tokenizer reads its vocab.txt). Every rank may call it at
    once: ensure_synthetic builds in a private folder and renames it into place atomically.
    """
    if config.get("synthetic_root"):
        from .synthetic import ensure_synthetic

        ensure_synthetic(str(config["synthetic_root"]))


def _require(config: dict, key: str, task: str):
    if config.get(key) in (None, "", []):
        raise ValueError(f"config key '{key}' is required for task '{task}'")
    return config[key]


def create_dataset(task: str, config: dict):
    """Build the datasets of a task from a config.

    'pretrain' -> PretrainDataset; 'retrieval' -> (train, val, test); 'nlvr' -> (train, val, test);
    'vqa' -> (train, test). Pre-training crops with scale (0.2, 1), fine-tuning with (0.5, 1).
    """
    from .nlvr import NLVRDataset
    from .pretrain import PretrainDataset
    from .retrieval import RetrievalEvalDataset, RetrievalTrainDataset
    from .transforms import test_transform, train_transform
    from .vqa import VQADataset

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    res = int(_require(config, "image_res", task))
    scale = tuple(config.get("crop_scale") or ((0.2, 1.0) if task == "pretrain" else (0.5, 1.0)))
    train_tf = train_transform(res, scale=scale, hflip=config.get("hflip", True),
                               randaugment=config.get("randaugment", True))
    test_tf = test_transform(res)
    root = config.get("image_root", "") or ""
    max_words = int(config.get("max_words", 30))
    train_file = _require(config, "train_file", task)
    if task == "pretrain":
        return PretrainDataset(train_file, train_tf, root, max_words)
    if task == "retrieval":
        return (RetrievalTrainDataset(train_file, train_tf, root, max_words),
                RetrievalEvalDataset(_require(config, "val_file", task), test_tf, root, max_words),
                RetrievalEvalDataset(_require(config, "test_file", task), test_tf, root, max_words))
    if task == "nlvr":
        return (NLVRDataset(train_file, train_tf, root, max_words),
                NLVRDataset(_require(config, "val_file", task), test_tf, root, max_words),
                NLVRDataset(_require(config, "test_file", task), test_tf, root, max_words))
    return (VQADataset(train_file, train_tf, root, "train", max_words=max_words),
            VQADataset(_require(config, "test_file", task), test_tf, root, "test",
                       answer_list=_require(config, "answer_list", task), max_words=max_words))
