"""Loading ALBEF-style checkpoints into our models (pre-training -> fine-tuning, resume, evaluation)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from models.state_dicts import missing_after_tying, summarise_keys
from models.vit import resample_pos_embed_report
from torch_files import load_torch_file

logger = logging.getLogger(__name__)

# Buffers that older transformers / ALBEF checkpoints stored and our modules recompute.
_OBSOLETE_SUFFIXES = ("embeddings.position_ids",)


@dataclass
class LoadReport:
    """What load_weights did: model keys left as initialised, checkpoint keys not used, resampled keys."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    resampled: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line, parameter groups collapsed ('text_encoder.bert.encoder.layer.{6-11}.crossattention')."""
        return (
            f"missing: {summarise_keys(self.missing) or 'none'}; "
            f"unexpected: {summarise_keys(self.unexpected) or 'none'}; "
            f"ignored: {summarise_keys(self.ignored) or 'none'}; "
            f"resampled: {', '.join(self.resampled) or 'none'}"
        )


def read_checkpoint(checkpoint: str | dict) -> dict[str, Tensor]:
    """A path (.pth/.bin/.safetensors, raw or under 'model') or a dict -> flat state dict of tensors."""
    source = checkpoint if isinstance(checkpoint, str) else "<state dict>"
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint: no such file: {path!r}")
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            checkpoint = load_file(path)
        else:
            checkpoint = load_torch_file(path)
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("model"), dict):
        checkpoint = checkpoint["model"]
    if not isinstance(checkpoint, dict) or not all(isinstance(v, Tensor) for v in checkpoint.values()):
        raise ValueError(
            f"checkpoint {source!r} does not hold a state dict of tensors (or one under 'model')"
        )
    # DistributedDataParallel-wrapped saves.
    return {k.removeprefix("module."): v for k, v in checkpoint.items()}


def _match_bert_naming(state: dict[str, Tensor], own_keys: set[str]) -> dict[str, Tensor]:
    """ALBEF fine-tuned models name 'text_encoder.embeddings...' what pre-training names
    'text_encoder.bert.embeddings...'; rename a key to the other form when only that one exists here."""
    out = {}
    for key, value in state.items():
        if key not in own_keys:
            head, _, rest = key.partition(".")
            alternative = (
                f"{head}.{rest[len('bert.') :]}" if rest.startswith("bert.") else f"{head}.bert.{rest}"
            )
            if alternative in own_keys:
                key = alternative
        out[key] = value
    return out


def load_weights(
    model: nn.Module,
    checkpoint: str | dict,
    key_map: Callable[[dict], dict] | None = None,
    ignore: Sequence[str] = (),
    strict: bool = False,
) -> LoadReport:
    """Load a checkpoint into model non-strictly, adapting ALBEF naming and ViT resolution; returns a report.

    key_map receives the state dict (already in the model's BERT naming) and returns a new one
    (e.g. NLVR layer duplication, VQA decoder). Checkpoint keys absent from the model are reported
    as `ignored` when they start with one of `ignore` (e.g. 'text_encoder.cls.' for retrieval),
    otherwise as `unexpected`. strict=True raises ValueError if anything is missing or unexpected.
    """
    state = read_checkpoint(checkpoint)
    own = model.state_dict()
    own_keys = set(own)
    state = _match_bert_naming(state, own_keys)
    if key_map is not None:
        state = _match_bert_naming(key_map(state), own_keys)

    resampled = []
    for prefix in ("visual_encoder.", "visual_encoder_m."):
        state, done = resample_pos_embed_report(state, model, prefix)
        resampled += done

    report = LoadReport(resampled=resampled)
    usable = {}
    for key, value in state.items():
        if key in own_keys:
            if value.shape != own[key].shape:
                raise ValueError(
                    f"checkpoint key {key!r} has shape {tuple(value.shape)} but the model expects "
                    f"{tuple(own[key].shape)} (does the config match the checkpoint?)"
                )
            usable[key] = value
        elif key.endswith(_OBSOLETE_SUFFIXES) or key.startswith(tuple(ignore)):
            report.ignored.append(key)
        else:
            report.unexpected.append(key)
    model.load_state_dict(usable, strict=False)
    report.missing = missing_after_tying(model, set(usable))
    logger.info(
        "loaded %s: %s", checkpoint if isinstance(checkpoint, str) else "state dict", report.summary()
    )
    if strict and (report.missing or report.unexpected):
        source = checkpoint if isinstance(checkpoint, str) else "state dict"
        raise ValueError(f"strict load of {source} failed: {report.summary()}")
    return report


__all__ = ["LoadReport", "load_weights", "read_checkpoint"]


def load_task_checkpoint(model: nn.Module, checkpoint: str | None,
                         log: Callable[[str], None] = print) -> None:
    """--checkpoint into a task model that names its own key_map() and ignored_keys() (NLVR, VQA)."""
    if not checkpoint:
        log("no --checkpoint: the model starts from random weights")
        return
    report = load_weights(model, checkpoint, key_map=model.key_map(), ignore=model.ignored_keys())
    log(f"loaded {checkpoint}: {report.summary()}")
