"""VQA v2 (+ Visual Genome QA) data in ALBEF's json format."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

from grit_io import InputFileError, read_json

from .bad_samples import blank_image
from .pretrain import PLACEHOLDER_CAPTION
from .utils import load_json_list, pre_question, read_image, resolve_image

__all__ = ["VQADataset", "answer_weights", "load_answer_list"]

VG_WEIGHT = 0.5  # ALBEF's fixed score for a Visual Genome answer (one annotator)


def _check_answer(entry: dict) -> None:
    answer = entry.get("answer")
    is_list = isinstance(answer, list) and answer and all(isinstance(a, str) for a in answer)
    if not (isinstance(answer, str) or is_list):
        raise ValueError(f"'answer' must be a string or a non-empty list of strings, got {answer!r}")
    if entry.get("dataset", "vqa") not in ("vqa", "vg"):
        raise ValueError(f"'dataset' must be 'vqa' or 'vg', got {entry['dataset']!r}")


def _check_question(entry: dict) -> None:
    if not isinstance(entry["question"], str):
        raise ValueError(f"'question' must be a string, got {entry['question']!r}")


def answer_weights(answer: str | list[str], dataset: str = "vqa") -> tuple[list[str], list[float]]:
    """Unique answers and soft scores: count/len(answers) for VQA, 0.5 each for VG."""
    answers = [answer] if isinstance(answer, str) else list(answer)
    if dataset == "vg":
        unique = list(dict.fromkeys(answers))
        return unique, [VG_WEIGHT] * len(unique)
    counts = Counter(answers)
    unique = list(dict.fromkeys(answers))  # first-seen order keeps the output deterministic
    return unique, [counts[a] / len(answers) for a in unique]


def load_answer_list(path: str) -> list[str]:
    """The json list of candidate answers; grit_io.InputFileError naming the file when it is missing, not
    JSON or not a non-empty list of strings."""
    answers = read_json(path, "answer list")
    if not (isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers)):
        raise InputFileError(f"answer list {path}: expected a non-empty JSON list of answer strings")
    return answers


class VQADataset(Dataset):
    """VQA json list -> train: (image, question, answers list[str], weights list[float]);
    test: (image, question, question_id).

    Answers are returned raw (the VQA model appends its end token). For split 'test',
    ``answer_list`` (path) is loaded into ``.answer_list``, the candidates ranked at inference.
    """

    def __init__(self, files: str | Sequence[str], transform: Callable, image_root: str = "",
                 split: str = "train", answer_list: str | None = None, max_words: int = 30):
        if split not in ("train", "test"):
            raise ValueError(f"VQADataset split must be 'train' or 'test', got {split!r}")
        if split == "train":
            required, check = ("image", "question", "answer"), _both(_check_question, _check_answer)
        else:
            required, check = ("image", "question", "question_id"), _check_question
        self.ann = load_json_list(files, required=required, check=check)
        self.transform = transform
        self.image_root = image_root
        self.split = split
        self.max_words = max_words
        self.answer_list = load_answer_list(answer_list) if answer_list is not None else None

    def __len__(self) -> int:
        return len(self.ann)

    def __getitem__(self, index: int) -> tuple[Tensor, str, Any] | tuple[Tensor, str, list[str], list[float]]:
        ann = self.ann[index]
        image = self.transform(read_image(resolve_image(self.image_root, ann["image"])))
        question = pre_question(ann["question"], self.max_words)
        if self.split == "test":
            return image, question, ann["question_id"]
        answers, weights = answer_weights(ann["answer"], ann.get("dataset", "vqa"))
        return image, question, answers, weights

    def placeholder(self, index: int) -> tuple[Tensor, str, Any] | tuple[Tensor, str, list[str], list[float]]:
        """An item of the right shapes standing in for bad entry `index` (masked out of every loss).

        train: one answer of weight 1.0, so that QACollate's per-question answer counts stay
        well-formed; test: the entry's own question_id (the json's, read without the image).
        """
        image = blank_image(self.transform)
        if self.split == "test":
            return image, PLACEHOLDER_CAPTION, self.ann[index]["question_id"]
        return image, PLACEHOLDER_CAPTION, [PLACEHOLDER_CAPTION], [1.0]


def _both(*checks: Callable[[dict], None]) -> Callable[[dict], None]:
    def check(entry: dict) -> None:
        for c in checks:
            c(entry)
    return check
