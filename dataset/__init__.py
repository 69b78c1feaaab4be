"""Datasets per task over json lists (and, for pre-training, tar shards), ALBEF transforms, named batches
and their collates, and the built-in synthetic data.

create_dataset(task, config) and prepare_data(config) take the resolved task config
(training.config.*Config) and read its attributes; every key's type, default and meaning live there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from .corpus import PretrainCorpus
    from .pretrain import PretrainDataset

__all__ = [
    "Batch", "EmptyTextError", "ImageBatch", "ImageCaptionDataset", "ImageCollate", "ImagePairBatch",
    "ImageReadError", "ImageTextBatch", "ImageTextCollate", "NLVRCollate", "NLVRDataset", "PretrainCorpus",
    "PretrainDataset", "ShardDataset",
    "QABatch", "QACollate", "QuestionBatch", "QuestionCollate", "RetrievalEvalDataset",
    "RetrievalTrainDataset", "SkipBadCollate", "SkipBadSamples", "VQADataset", "create_dataset",
    "ensure_synthetic", "load_json_list", "pre_caption", "pre_question", "prepare_data", "read_image",
    "resolve_image", "test_transform", "train_transform",
]

# Public names are imported on first use (PEP 562), so that importing one part (the synthetic world's
# generator) does not pull in torch and the others.
_LAZY = {
    "NLVRDataset": "nlvr", "ImageCaptionDataset": "pretrain", "PretrainDataset": "pretrain",
    "PretrainCorpus": "corpus", "ShardDataset": "shards",
    "RetrievalEvalDataset": "retrieval", "RetrievalTrainDataset": "retrieval", "VQADataset": "vqa",
    "ensure_synthetic": "synthetic", "test_transform": "transforms", "train_transform": "transforms",
    **dict.fromkeys(("Batch", "ImageBatch", "ImageCollate", "ImagePairBatch", "ImageTextBatch",
                     "ImageTextCollate", "NLVRCollate", "QABatch", "QACollate", "QuestionBatch",
                     "QuestionCollate"), "collate"),
    "SkipBadCollate": "bad_samples", "SkipBadSamples": "bad_samples",
    "EmptyTextError": "utils", "ImageReadError": "utils", "load_json_list": "utils", "pre_caption": "utils",
    "pre_question": "utils", "read_image": "utils", "resolve_image": "utils",
}

TASKS = ("pretrain", "retrieval", "nlvr", "vqa")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_data(config: Any) -> None:
    """Generate the built-in synthetic dataset at config.synthetic_root if it names one and it is missing.

    config: the resolved task config, training.config.*Config; reads synthetic_root. Call it before
    anything reads the data (the tokenizer reads its vocab.txt). Every rank may call it at once:
    ensure_synthetic builds in a private folder and renames it into place atomically.
    """
    if config.synthetic_root:
        from .synthetic import ensure_synthetic

        ensure_synthetic(str(config.synthetic_root))


def create_dataset(task: str,
                   config: Any) -> PretrainCorpus | tuple[Dataset, Dataset | None, Dataset | None]:
    """The datasets of `task` ('pretrain', 'retrieval', 'nlvr' or 'vqa'), training sets with the training
    transform (image_res, crop_scale, hflip, randaugment) and evaluation sets with the test transform.

    config: the resolved task config, training.config.*Config; reads image_res, crop_scale, hflip,
    randaugment, image_root (null or '': the json paths as they are), max_words, train_file, and per task
    val_file, test_file, answer_list (vqa) and text_assignment (nlvr).

    'pretrain' also reads train_shards, train_repeat, shard_cache_dir and shard_lru_size.

    Returns 'pretrain' -> PretrainCorpus (json lists, then shards, in one index space); 'retrieval' ->
    (RetrievalTrainDataset, RetrievalEvalDataset x2);
    'nlvr' -> (train, val, test) NLVRDatasets, or with text_assignment true (PretrainDataset of train_file,
    None, None): stage 1 trains on pre-training captions and has no evaluation split, and a triple either
    way lets NLVR.py unpack both stages alike; 'vqa' -> (train, val or None when val_file is null, test)
    VQADatasets, val and test as split 'test' (question ids, the answer list).
    """
    from .nlvr import NLVRDataset
    from .pretrain import PretrainDataset
    from .retrieval import RetrievalEvalDataset, RetrievalTrainDataset
    from .transforms import test_transform, train_transform
    from .vqa import VQADataset

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    train_tf = train_transform(config.image_res, scale=tuple(config.crop_scale), hflip=config.hflip,
                               randaugment=config.randaugment)
    test_tf = test_transform(config.image_res)
    root = config.image_root or ""
    max_words = config.max_words
    if task == "pretrain":
        from .corpus import PretrainCorpus
        from .shards import ShardDataset

        sources = [(f, PretrainDataset(f, train_tf, root, max_words)) for f in config.train_files]
        sources += [(s, ShardDataset(s, train_tf, max_words, config.shard_cache_dir, config.shard_lru_size))
                    for s in config.train_shard_specs]
        return PretrainCorpus(sources, config.train_repeat)
    if task == "retrieval":
        return (RetrievalTrainDataset(config.train_file, train_tf, root, max_words),
                RetrievalEvalDataset(config.val_file, test_tf, root, max_words),
                RetrievalEvalDataset(config.test_file, test_tf, root, max_words))
    if task == "nlvr" and config.text_assignment:
        return PretrainDataset(config.train_file, train_tf, root, max_words), None, None
    if task == "nlvr":
        return (NLVRDataset(config.train_file, train_tf, root, max_words),
                NLVRDataset(config.val_file, test_tf, root, max_words),
                NLVRDataset(config.test_file, test_tf, root, max_words))

    def vqa_eval(files: str | list[str]) -> VQADataset:
        return VQADataset(files, test_tf, root, "test", answer_list=config.answer_list, max_words=max_words)

    return (VQADataset(config.train_file, train_tf, root, "train", max_words=max_words),
            vqa_eval(config.val_file) if config.val_file else None,
            vqa_eval(config.test_file))
