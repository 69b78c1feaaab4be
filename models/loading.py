"""Loading ALBEF-style checkpoints into our models (pre-training -> fine-tuning, resume, evaluation)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from grit_io import InputFileError
from models.state_dicts import missing_after_tying, read_weights_file, summarise_keys
from models.vit import resample_pos_embed_report

logger = logging.getLogger(__name__)

# Checkpoint parts that are known and deliberately left unused: prefix -> the reason the load report
# gives. A key matches a prefix ending in "." when it starts with it, another one when it equals it
# (top-level tensors: "temp", the queues); two patterns are special: "*_m." matches any
# key under a top-level module whose name ends in "_m" (ALBEF's momentum copies: visual_encoder_m,
# text_encoder_m incl. its .cls MLM head, vision_proj_m, text_proj_m, cls_head_m, text_decoder_m, ...)
# and "*position_ids" any key ending in "position_ids" (buffers older transformers stored).
IGNORE_REASONS: dict[str, str] = {
    "*_m.": "momentum copy (ALBEF's momentum model / distillation; not used by this model)",
    "image_queue": "feature queue (state of one training run, never taken from a checkpoint)",
    "text_queue": "feature queue (state of one training run, never taken from a checkpoint)",
    "idx_queue": "feature queue (state of one training run, never taken from a checkpoint)",
    "valid_queue": "feature queue (state of one training run, never taken from a checkpoint)",
    "queue_ptr": "feature queue pointer (state of one training run, never taken from a checkpoint)",
    "*position_ids": "position_ids buffer (recomputed by our modules)",
    "text_encoder.cls.": "MLM head (pre-training only)",
    "itm_head.": "ITM head (pre-training / retrieval only)",
    "vision_proj.": "ITC projection (pre-training / retrieval only)",
    "text_proj.": "ITC projection (pre-training / retrieval only)",
    "temp": "ITC temperature (pre-training / retrieval only)",
    "ta_head.": "NLVR2 stage-1 text-assignment head (stage 1 only)",
    "cls_head.": "NLVR2 classifier head (stage 2 only)",
}
# Ignored by every load when the model has no such key (a model that has them loads them).
# objectives.: parameters a pre-training objective learnt (SigLIP's temperature and bias), of no use to a
# model that does not train that objective.
ALWAYS_IGNORED = ("*_m.", "image_queue", "text_queue", "idx_queue", "valid_queue", "queue_ptr",
                  "*position_ids", "objectives.")
_FALLBACK_REASON = "not used by this model"
_MOMENTUM = re.compile(r"^[^.]*_m\.")


def _matches(key: str, prefix: str) -> bool:
    if prefix == "*_m.":
        return _MOMENTUM.match(key) is not None
    if prefix.startswith("*"):
        return key.endswith(prefix[1:])
    return key.startswith(prefix) if prefix.endswith(".") else key == prefix


def _reasons(prefixes: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """prefix -> reason: a Mapping as given, a Sequence's reasons from IGNORE_REASONS."""
    if isinstance(prefixes, Mapping):
        return dict(prefixes)
    return {p: IGNORE_REASONS.get(p, _FALLBACK_REASON) for p in prefixes}


def ignore_reason(key: str, prefixes: Sequence[str] | Mapping[str, str] = ()) -> str | None:
    """Why `key` is deliberately unused: the first of `prefixes`, then of ALWAYS_IGNORED, that it matches."""
    return _first_reason(key, _reasons(prefixes)) or _first_reason(key, _reasons(ALWAYS_IGNORED))


def _first_reason(key: str, table: Mapping[str, str]) -> str | None:
    return next((reason for prefix, reason in table.items() if _matches(key, prefix)), None)


@dataclass
class LoadReport:
    """What load_weights did: model keys left as initialised, checkpoint keys not used, resampled keys.

    missing and unexpected mean something is wrong; ignored are checkpoint keys known and deliberately
    unused, each with its reason in `reasons` (key -> reason, see IGNORE_REASONS); notes are what the
    model adapted to the checkpoint (e.g. ALBEF_NLVR's older MLP ta_head).
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    resampled: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def ignored_summary(self) -> str:
        """The ignored keys grouped by reason: 'visual_encoder_m, text_encoder_m [momentum copy ...]'."""
        by_reason: dict[str, list[str]] = {}
        for key in self.ignored:
            by_reason.setdefault(self.reasons.get(key, _FALLBACK_REASON), []).append(key)
        return "; ".join(f"{summarise_keys(keys)} [{reason}]" for reason, keys in by_reason.items())

    def summary(self) -> str:
        """One line, parameter groups collapsed ('text_encoder.bert.encoder.layer.{6-11}.crossattention')."""
        notes = "".join(f"; note: {note}" for note in self.notes)
        return (
            f"missing: {summarise_keys(self.missing) or 'none'}; "
            f"unexpected: {summarise_keys(self.unexpected) or 'none'}; "
            f"ignored: {self.ignored_summary() or 'none'}; "
            f"resampled: {', '.join(self.resampled) or 'none'}{notes}"
        )


def read_checkpoint(checkpoint: str | os.PathLike | dict) -> dict[str, Tensor]:
    """A path (.pth/.bin/.safetensors, raw or under 'model') or a dict -> flat state dict of tensors.

    A file that is missing raises FileNotFoundError; one that is not a torch / safetensors file, or holds
    something other than a state dict (e.g. a bare tensor), InputFileError naming it.
    """
    path = None
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint: no such file: {path!r}")
        checkpoint = read_weights_file(path, "checkpoint")
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("model"), dict):
        checkpoint = checkpoint["model"]
    if not isinstance(checkpoint, dict) or not all(isinstance(v, Tensor) for v in checkpoint.values()):
        what = f"checkpoint {path!r}" if path else "the checkpoint dict"
        # A file is the user's (one-line error in the scripts); a dict comes from code.
        error = InputFileError if path else ValueError
        raise error(f"{what} does not hold a state dict of tensors (or one under 'model'), but "
                    f"{_describe(checkpoint)}")
    # DistributedDataParallel-wrapped saves.
    return {k.removeprefix("module."): v for k, v in checkpoint.items()}


def _describe(obj: object) -> str:
    """'a Tensor', 'a dict with non-tensor values under ...': what a checkpoint holds instead."""
    if isinstance(obj, dict):
        odd = [str(k) for k, v in obj.items() if not isinstance(v, Tensor)]
        return f"a dict with non-tensor values under {odd[:4]}"
    return f"a {type(obj).__name__}"


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
    ignore: Sequence[str] | Mapping[str, str] = (),
    strict: bool = False,
    skip: Sequence[str] | Mapping[str, str] = (),
) -> LoadReport:
    """Load a checkpoint into model non-strictly, adapting ALBEF naming and ViT resolution; returns a report.

    key_map receives the state dict (already in the model's BERT naming) and returns a new one
    (e.g. NLVR layer duplication, VQA decoder). Checkpoint keys absent from the model are reported
    as `ignored` (with a reason) when they match one of `ignore` (prefixes, e.g. 'text_encoder.cls.'
    for retrieval, reasons from IGNORE_REASONS; or a mapping prefix -> reason) or ALWAYS_IGNORED
    (momentum copies, feature queues, position_ids), otherwise as `unexpected`. Keys matching `skip`
    are not loaded even where the model has them, and are reported as ignored too (e.g. Retrieval's
    queues). strict=True raises ValueError if anything is missing or unexpected.

    A model may define match_checkpoint_layout(state) -> str | None: called with the checkpoint's state
    dict before anything is matched, it may rebuild a part to the checkpoint's layout; the note it
    returns goes into the report (ALBEF_NLVR: the older MLP ta_head).
    """
    state = read_checkpoint(checkpoint)
    source = os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else None
    notes = []
    adapt = getattr(model, "match_checkpoint_layout", None)
    if adapt is not None:
        note = adapt(state)
        if note:
            notes.append(note)
    own = model.state_dict()
    own_keys = set(own)
    state = _match_bert_naming(state, own_keys)
    if key_map is not None:
        state = _match_bert_naming(key_map(state), own_keys)

    resampled = []
    for prefix in ("visual_encoder.", "visual_encoder_m."):
        state, done = resample_pos_embed_report(state, model, prefix)
        resampled += done

    report = LoadReport(resampled=resampled, notes=notes)
    usable = _sort_keys(state, own, report, _reasons(skip), ignore, source)
    model.load_state_dict(usable, strict=False)
    report.missing = missing_after_tying(model, set(usable))
    logger.info("loaded %s: %s", source or "state dict", report.summary())
    if strict and (report.missing or report.unexpected):
        raise ValueError(f"strict load of {source or 'state dict'} failed: {report.summary()}")
    return report


def _sort_keys(state: dict, own: dict, report: LoadReport, skip: Mapping[str, str],
               ignore: Sequence[str] | Mapping[str, str], source: str | None) -> dict:
    """The checkpoint keys the model takes -> {key: tensor}; the others go into the report as ignored
    (skip, ignore) or unexpected. A key whose shape differs from the model's raises, naming the file."""
    usable = {}
    for key, value in state.items():
        if (skipped := _first_reason(key, skip)) is not None:
            report.ignored.append(key)
            report.reasons[key] = skipped
        elif key in own:
            if value.shape != own[key].shape:
                where = f"checkpoint {source!r}" if source else "checkpoint"
                raise (InputFileError if source else ValueError)(
                    f"{where}: key {key!r} has shape {tuple(value.shape)} but the model expects "
                    f"{tuple(own[key].shape)} (does the config match the checkpoint?)"
                )
            usable[key] = value
        elif (reason := ignore_reason(key, ignore)) is not None:
            report.ignored.append(key)
            report.reasons[key] = reason
        else:
            report.unexpected.append(key)
    return usable


__all__ = ["ALWAYS_IGNORED", "IGNORE_REASONS", "LoadReport", "ignore_reason", "load_task_checkpoint",
           "load_weights", "read_checkpoint"]


def load_task_checkpoint(model: nn.Module, checkpoint: str | dict | None,
                         log: Callable[[str], None] = print) -> None:
    """--checkpoint into a task model that names its own key_map() and ignored_keys() (NLVR, VQA); a file
    that is no state dict, or does not fit the model, raises InputFileError naming it."""
    if not checkpoint:
        log("no --checkpoint: the model starts from random weights")
        return
    report = load_weights(model, checkpoint, key_map=model.key_map(), ignore=model.ignored_keys())
    log(f"loaded {checkpoint if isinstance(checkpoint, str) else 'state dict'}: {report.summary()}")
