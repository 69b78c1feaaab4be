"""ALBEF's own config keys that are not ours, and what becomes of each: read as one of our keys (Alias) or
refused with what to do instead. training.config_resolve applies them before the unknown-key check, so
ALBEF's config files keep working (docs/configuration.md, "ALBEF's config keys").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.config import TASK_CONFIGS

__all__ = ["ALBEF_KEYS", "Alias"]

# Keys only ALBEF's own config files carry: {key: (tasks, what becomes of it)}. An Alias is read as one of
# our keys; a callable(value) returns None to accept the value (it asks for nothing this code does not do)
# or the message refusing it. Momentum distillation: the paper uses it in no task (S.M. D), and pre-trains
# without ALBEF's momentum model and queues (Sec. 3, footnote 1).


@dataclass(frozen=True)
class Alias:
    """An ALBEF key read as our key `key`, its value multiplied by `scale`."""

    key: str
    scale: int = 1


_NO_DISTILLATION = ("ALBEF's momentum distillation is not part of GRIT-VLP (paper S.M. D: not used in any "
                    "downstream task); delete distill, alpha and warm_up (or set distill and warm_up false)")
_ONE_IMAGE_ROOT = ("is ALBEF's; here every json image path is relative to image_root (or absolute): set "
                   "image_root and write the paths from there")
_FINETUNE_TASKS = ("retrieval", "nlvr", "vqa")

ALBEF_KEYS: dict[str, tuple[tuple[str, ...], Any]] = {
    # ALBEF steps its warm-up every 100 iterations of epoch 0 (step_size 100): warmup_epochs x 100 steps.
    "schedular.warmup_epochs": (tuple(TASK_CONFIGS), Alias("schedular.warmup_steps", 100)),
    "batch_size": (("nlvr",), Alias("batch_size_train")),  # ALBEF's NLVR scripts train with batch_size
    "distill": (_FINETUNE_TASKS, lambda v: None if v is False else _NO_DISTILLATION),
    "warm_up": (_FINETUNE_TASKS, lambda v: None if v is False else _NO_DISTILLATION),
    "alpha": (tuple(TASK_CONFIGS), lambda v: "alpha weighs ALBEF's momentum distillation, which GRIT-VLP "
                                             "does not use (paper Sec. 3, S.M. D); delete alpha"),
    "eval_ema": (("nlvr",), lambda v: None if v is False else "eval_ema needs ALBEF's momentum model, "
                                                              "which NLVR fine-tuning here does not keep; "
                                                              "delete it"),
    "queue_size": (("pretrain",), lambda v: "GRIT-VLP pre-trains without ALBEF's momentum model and "
                                            "feature queue (paper Sec. 3); delete queue_size (GRIT's own "
                                            "queue is batching.queue_size)"),
    "momentum": (("pretrain",), lambda v: "GRIT-VLP pre-trains without ALBEF's momentum model (paper "
                                          "Sec. 3); delete momentum"),
    "vqa_root": (("vqa",), lambda v: f"vqa_root {_ONE_IMAGE_ROOT}"),
    "vg_root": (("vqa",), lambda v: f"vg_root {_ONE_IMAGE_ROOT}"),
    "eos": (("vqa",), lambda v: None if v == "[SEP]" else f"eos {v!r}: the answer decoder ends every answer "
                                                          "with [SEP] (ALBEF's eos); delete eos"),
}
