"""Batching, with tokenization inside the loader's workers: one collate and one named batch per kind of item.

Every collate returns a Batch: a dataclass whose fields name what each tensor is, plus `valid` (B,) bool
and `reasons`, the bad samples' reasons (dataset.bad_samples). Alone, a collate marks every sample good;
wrapped in dataset.bad_samples.SkipBadCollate it marks the placeholders of bad entries. Tokenizing here
runs in the DataLoader workers, off the training loop's critical path.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:  # annotations only: the collates get their tokenizer from the caller
    from transformers import BatchEncoding

__all__ = ["Batch", "ImageBatch", "ImageCollate", "ImagePairBatch", "ImageTextBatch", "ImageTextCollate",
           "NLVRCollate", "QABatch", "QACollate", "QuestionBatch", "QuestionCollate"]


def _pinned(value: Any) -> Any:
    """`value` with its tensors in page-locked memory: a Tensor, or a mapping of them (a BatchEncoding)."""
    if isinstance(value, Tensor):
        return value.pin_memory()
    if isinstance(value, MutableMapping):
        # A copy keeps the mapping's type and extra state (a fast tokenizer's encodings), as torch's own
        # pin_memory does for mappings.
        clone = copy.copy(value)
        clone.update({k: _pinned(v) for k, v in value.items()})
        return clone
    return value


def _all_good(n: int) -> Tensor:
    return torch.ones(n, dtype=torch.bool)


# eq=False on every batch: compared by identity, since a field-wise == of tensors gives no bool.
@dataclass(kw_only=True, eq=False)
class Batch:
    """A batch of B samples; subclasses add the task's fields. valid (B,) bool is False for a bad sample's
    placeholder, which every loss and score leaves out; reasons lists the bad samples' reasons."""

    valid: Tensor
    reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.valid)

    def pin_memory(self) -> Batch:
        """A copy with every tensor and BatchEncoding in pinned memory (DataLoader(pin_memory=True) calls
        this on custom batch types); without an accelerator, a plain copy (pinning would fail there, and
        the DataLoader does not pin without one either)."""
        if not torch.accelerator.is_available():
            return dataclasses.replace(self)
        return dataclasses.replace(self, **{f.name: _pinned(getattr(self, f.name))
                                            for f in dataclasses.fields(self)})

    def valid_on(self, device: torch.device | str) -> Tensor | None:
        """valid (B,) on `device`, or None when every sample is good, so that the models then run the
        paper's computation exactly. Checking the CPU tensor costs no device synchronisation."""
        return None if bool(self.valid.all()) else self.valid.to(device, non_blocking=True)


@dataclass(eq=False)
class ImageTextBatch(Batch):
    """image (B,3,H,W) float; text: tokenized captions (B,L); ids (B,) long: the dataset index
    (pre-training: GRIT collects features under it) or the image id (retrieval fine-tuning)."""

    image: Tensor
    text: BatchEncoding
    ids: Tensor


@dataclass(eq=False)
class ImagePairBatch(Batch):
    """NLVR2: image0, image1 (B,3,H,W) float; text: tokenized sentences (B,L); label (B,) long, 1 = true."""

    image0: Tensor
    image1: Tensor
    text: BatchEncoding
    label: Tensor


@dataclass(eq=False)
class QABatch(Batch):
    """VQA training: image (B,3,H,W) float; question (B,Lq); answer (A,La), every question's answers in
    order; weights (A,) float, each answer's soft score; counts (B,) long, question b's number of answers."""

    image: Tensor
    question: BatchEncoding
    answer: BatchEncoding
    weights: Tensor
    counts: Tensor


@dataclass(eq=False)
class QuestionBatch(Batch):
    """VQA evaluation: image (B,3,H,W) float; question (B,Lq); question_ids [B], as the json has them."""

    image: Tensor
    question: BatchEncoding
    question_ids: list


@dataclass(eq=False)
class ImageBatch(Batch):
    """Retrieval evaluation images: image (B,3,H,W) float; index (B,) long, the image's dataset index."""

    image: Tensor
    index: Tensor


class _TokenizingCollate:
    """Holds the tokenizer, the truncation length of a collate's texts and whether they are padded to it.

    static (config key static_text): every batch padded to max_tokens, so that a compiled step sees one
    shape (no recompilation, CUDA graphs); the padding is masked out of attention and never masked for
    MLM, so the losses do not change. Off: padded to the batch's longest text.
    """

    def __init__(self, tokenizer: Any, max_tokens: int, static: bool = False) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.padding = "max_length" if static else "longest"

    def tokenize(self, texts: Sequence[str]) -> BatchEncoding:
        """texts [B] -> input_ids, attention_mask (B,L): padded to the longest (static: to max_tokens), cut
        at max_tokens."""
        return self.tokenizer(list(texts), padding=self.padding, truncation=True, max_length=self.max_tokens,
                              return_tensors="pt")


class ImageTextCollate(_TokenizingCollate):
    """(image (3,H,W), caption, integer) items -> ImageTextBatch (PretrainDataset, RetrievalTrainDataset)."""

    def __call__(self, items: list[tuple[Tensor, str, int]]) -> ImageTextBatch:
        """items [B] -> image (B,3,H,W), text (B,L), ids (B,) long."""
        images, captions, ids = zip(*items)
        return ImageTextBatch(torch.stack(images), self.tokenize(captions),
                              torch.as_tensor(ids, dtype=torch.long), valid=_all_good(len(items)))


class NLVRCollate(_TokenizingCollate):
    """(image0, image1, sentence, label) items -> ImagePairBatch (NLVRDataset)."""

    def __call__(self, items: list[tuple[Tensor, Tensor, str, int]]) -> ImagePairBatch:
        """items [B] -> image0, image1 (B,3,H,W), text (B,L), label (B,) long."""
        image0, image1, sentences, labels = zip(*items)
        return ImagePairBatch(torch.stack(image0), torch.stack(image1), self.tokenize(sentences),
                              torch.as_tensor(labels, dtype=torch.long), valid=_all_good(len(items)))


class QACollate(_TokenizingCollate):
    """VQADataset 'train' items (image, question, answers [n], weights [n]) -> QABatch.

    Answers are tokenized as [CLS] answer [SEP]: [CLS] is the answer decoder's start token, [SEP] its end.
    """

    def __call__(self, items: list[tuple[Tensor, str, list[str], list[float]]]) -> QABatch:
        """items [B] -> image (B,3,H,W), question (B,Lq), answer (A,La), weights (A,), counts (B,);
        A = the items' answers in all."""
        images, questions, answers, weights, counts = [], [], [], [], []
        for image, question, answer, weight in items:
            images.append(image)
            questions.append(question)
            answers.extend(answer)
            weights.extend(weight)
            counts.append(len(answer))
        # Answers are a few words: max_tokens is the questions' limit, not theirs.
        answer_tokens = self.tokenizer(answers, padding="longest", return_tensors="pt")
        return QABatch(torch.stack(images), self.tokenize(questions), answer_tokens,
                       torch.tensor(weights, dtype=torch.float), torch.as_tensor(counts, dtype=torch.long),
                       valid=_all_good(len(items)))


class QuestionCollate(_TokenizingCollate):
    """VQADataset 'test' items (image, question, question_id) -> QuestionBatch."""

    def __call__(self, items: list[tuple[Tensor, str, Any]]) -> QuestionBatch:
        """items [B] -> image (B,3,H,W), question (B,Lq), question_ids [B]."""
        images, questions, question_ids = zip(*items)
        return QuestionBatch(torch.stack(images), self.tokenize(questions), list(question_ids),
                             valid=_all_good(len(items)))


class ImageCollate:
    """RetrievalEvalDataset items (image (3,H,W), index) -> ImageBatch."""

    def __call__(self, items: list[tuple[Tensor, int]]) -> ImageBatch:
        """items [B] -> image (B,3,H,W), index (B,) long."""
        images, index = zip(*items)
        return ImageBatch(torch.stack(images), torch.as_tensor(index, dtype=torch.long),
                          valid=_all_good(len(items)))
