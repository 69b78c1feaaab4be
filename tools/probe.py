"""Compositional ITM probe: does the ITM head prefer an image's caption to captions with one thing changed?

    python -m tools.probe --config configs/tiny/Pretrain.yaml \
        --checkpoint output/demo/grit_vlp/pretrain/checkpoint_11.pth \
        [--probe_file data/synthetic/probe_test.json] [--output_dir DIR] [--device cpu] [--batch_size 256] \
        [--limit N] [--set key=value ...]

The synthetic counterpart of ARO / Winoground. A probe file is a json list of

    {"image": path, "caption": str, "negatives": [{"kind": "colour", "caption": str}, ...]}

(image paths relative to the config's image_root; kinds are free strings). Each image is encoded
once, and its true caption and all its negatives are scored together by the ITM match probability
softmax(itm_head(fusion CLS))[1] of ALBEF_Base. A (true, negative) pair counts 1 when the true
caption scores strictly higher, 0.5 on a tie, so a constant model sits exactly at chance (0.5).
Prints a table (kind, pairs, accuracy), then one JSON line; --output_dir writes that JSON to
DIR/probe.json too. The default probe file is <synthetic_root>/probe_test.json when the config names a
synthetic_root.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from dataset import prepare_data
from dataset.transforms import test_transform
from dataset.utils import ImageReadError, load_json_list, pre_caption, read_image, resolve_image
from grit_io import InputFileError, set_trust_checkpoint
from models.pretrain import ALBEF_Base
from tools.cli import checkpoint_parser, emit_record, resolve_device, tool_config
from tools.pretrain_checkpoint import load_pretrain_checkpoint
from training.cli import Parser, run_main
from training.config import TaskConfig
from training.config_files import ConfigError

__all__ = ["ImageScores", "ProbeFileError", "build_parser", "default_probe_file", "format_table",
           "itm_match_prob", "load_probe_file", "main", "probe_accuracy", "score_probe"]

PROBE_FILE_NAME = "probe_test.json"

# One image's result: (true caption's score, [(negative's kind, negative's score), ...] in file order).
ImageScores = tuple[float, list[tuple[str, float]]]


class ProbeFileError(InputFileError):
    """A probe file is malformed or names an image that cannot be read; the message names the file."""


# ----------------------------------------------------------------------------------------------
# The probe file
# ----------------------------------------------------------------------------------------------


def _check_entry(entry: dict, image_root: str | None) -> None:
    """ValueError for a bad value in one probe entry (load_json_list adds the file and entry index)."""
    if not isinstance(entry["image"], str) or not entry["image"]:
        raise ValueError(f"'image' must be a non-empty path string, got {entry['image']!r}")
    # pre_caption raises for non-strings and captions that are empty once cleaned.
    true = pre_caption(entry["caption"])
    negatives = entry["negatives"]
    if not isinstance(negatives, list) or not negatives:
        raise ValueError(f"'negatives' must be a non-empty list of {{'kind', 'caption'}} objects, "
                         f"got {negatives!r}")
    for j, neg in enumerate(negatives):
        if not isinstance(neg, dict) or "kind" not in neg or "caption" not in neg:
            raise ValueError(f"negative {j} must be an object with keys 'kind' and 'caption', got {neg!r}")
        if not isinstance(neg["kind"], str) or not neg["kind"]:
            raise ValueError(f"negative {j}: 'kind' must be a non-empty string, got {neg['kind']!r}")
        # An identical caption always ties: it would pull a kind's accuracy towards 0.5 by construction.
        if pre_caption(neg["caption"]) == true:
            raise ValueError(f"negative {j} ({neg['kind']}) is the true caption {entry['caption']!r} "
                             "once cleaned")
    if image_root is not None:
        path = resolve_image(image_root, entry["image"])
        if not os.path.isfile(path):
            raise ValueError(f"image not found: {path} (image_root {image_root!r})")


def load_probe_file(path: str, image_root: str | None = None) -> list[dict]:
    """Read and validate a probe json list; with image_root, every image file must exist too.

    Raises FileNotFoundError for a missing file and ProbeFileError, naming the file and the entry,
    for anything malformed, so that a bad probe fails before a model is built.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"probe file not found: {path}")
    try:
        entries = load_json_list(path, required=("image", "caption", "negatives"),
                                 check=lambda entry: _check_entry(entry, image_root))
    except ValueError as err:  # grit_io.InputFileError (a ValueError) naming the file and entry
        raise ProbeFileError(str(err)) from None
    if not entries:
        raise ProbeFileError(f"{path}: the probe file holds no entries")
    return entries


def default_probe_file(config: TaskConfig, config_path: str = "config") -> str:
    """<synthetic_root>/probe_test.json for a config that names synthetic_root; else ConfigError."""
    root = config.synthetic_root
    if not root:
        raise ConfigError(f"--probe_file is required: {config_path} names no synthetic_root "
                          f"(whose {PROBE_FILE_NAME} would be the default)")
    return os.path.join(str(root), PROBE_FILE_NAME)


# ----------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------


def probe_accuracy(scores: Sequence[ImageScores]) -> dict:
    """Per image (true score, [(kind, negative score), ...]) -> accuracy per kind, overall and image_all.

    A pair scores 1 when the true caption's score is strictly greater than the negative's, 0.5 on a
    tie and 0 otherwise. per_kind: {kind: {"pairs", "accuracy"}} in order of first appearance;
    overall: mean over all pairs; image_all: share of images whose true caption strictly beats every
    one of its negatives (0 for a constant model).
    """
    if not scores:
        raise ValueError("probe_accuracy: no images to score")
    n_neg = torch.tensor([len(negatives) for _, negatives in scores], dtype=torch.long)
    if bool((n_neg == 0).any()):
        raise ValueError(f"probe_accuracy: image {int((n_neg == 0).nonzero()[0])} has no negatives")
    kind_ids: dict[str, int] = {}
    pair_kind = torch.tensor([kind_ids.setdefault(kind, len(kind_ids))
                              for _, negatives in scores for kind, _ in negatives], dtype=torch.long)
    # float64: model scores are float32, so the comparisons below are exactly theirs.
    negative = torch.tensor([float(s) for _, negatives in scores for _, s in negatives], dtype=torch.float64)
    true = torch.tensor([float(t) for t, _ in scores], dtype=torch.float64)
    pair_image = torch.repeat_interleave(torch.arange(len(scores)), n_neg)  # (P,)

    true_per_pair = true[pair_image]
    wins = (true_per_pair > negative).double()
    credit = wins + 0.5 * (true_per_pair == negative).double()  # (P,)
    n_kinds = len(kind_ids)
    kind_pairs = torch.bincount(pair_kind, minlength=n_kinds)
    kind_acc = torch.bincount(pair_kind, weights=credit, minlength=n_kinds) / kind_pairs
    image_wins = torch.bincount(pair_image, weights=wins, minlength=len(scores))
    return {
        "overall": float(credit.mean()),
        "pairs": int(credit.numel()),
        "images": len(scores),
        "image_all": float((image_wins == n_neg).double().mean()),
        "per_kind": {kind: {"pairs": int(kind_pairs[k]), "accuracy": float(kind_acc[k])}
                     for kind, k in kind_ids.items()},
    }


def itm_match_prob(model: ALBEF_Base, image_embeds: Tensor, input_ids: Tensor, attention_mask: Tensor,
                   counts: Tensor) -> Tensor:
    """Image tokens (I,1+P,Dv), captions (T,L) with counts (I,) captions per image, in image order
    -> ITM match probabilities (T,) fp32."""
    # Each image was encoded once; its tokens are repeated for its true caption and negatives.
    logits = model.itm_logits(model.encode_text(input_ids, attention_mask), attention_mask,
                              image_embeds.repeat_interleave(counts, dim=0))
    return logits.float().softmax(dim=-1)[:, 1]


def _chunks(entries: Sequence[dict], max_captions: int) -> Iterator[Sequence[dict]]:
    """Consecutive runs of entries with at most max_captions captions in all (at least one entry each)."""
    start, size = 0, 0
    for i, entry in enumerate(entries):
        n = 1 + len(entry["negatives"])
        if i > start and size + n > max_captions:
            yield entries[start:i]
            start, size = i, 0
        size += n
    if start < len(entries):
        yield entries[start:]


@torch.no_grad()
def score_probe(model: ALBEF_Base, entries: Sequence[dict], tokenizer, *, image_root: str, image_res: int,
                max_words: int = 30, max_tokens: int = 40, device: torch.device | str = "cpu",
                batch_size: int = 256) -> list[ImageScores]:
    """ITM match probability of each entry's true caption and of each of its negatives (eval mode).

    Images go through the test transform and captions through pre_caption and the tokenizer exactly as
    in pre-training. batch_size bounds the captions per fusion pass; an image's captions share a pass.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    transform = test_transform(int(image_res))
    was_training = model.training
    model.eval()
    results: list[ImageScores] = []
    try:
        for chunk in _chunks(entries, batch_size):
            images = torch.stack([transform(read_image(resolve_image(image_root, e["image"])))
                                  for e in chunk])
            captions = [pre_caption(c, max_words) for e in chunk
                        for c in (e["caption"], *(neg["caption"] for neg in e["negatives"]))]
            counts = [1 + len(e["negatives"]) for e in chunk]
            # The collate's tokenizer call (dataset/collate.py), so tokens match pre-training's.
            text = tokenizer(captions, padding="longest", truncation=True, max_length=max_tokens,
                             return_tensors="pt").to(device)
            probs = itm_match_prob(model, model.encode_image(images.to(device)), text.input_ids,
                                   text.attention_mask, torch.tensor(counts, device=device))
            per_image = torch.split(probs.cpu(), counts)
            results += [(float(p[0]), [(neg["kind"], s) for neg, s in zip(e["negatives"], p[1:].tolist())])
                        for e, p in zip(chunk, per_image)]
    finally:
        model.train(was_training)
    return results


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def format_table(result: dict) -> str:
    """The probe result as a plain-text table: one row per kind, then overall and image_all."""
    width = max([len("image_all"), *(len(k) for k in result["per_kind"])])
    rows = [f"{'kind':<{width}}  {'pairs':>7}  {'accuracy':>8}"]
    rows += [f"{kind:<{width}}  {v['pairs']:>7d}  {v['accuracy']:>8.4f}"
             for kind, v in result["per_kind"].items()]
    rows.append(f"{'overall':<{width}}  {result['pairs']:>7d}  {result['overall']:>8.4f}")
    rows.append(f"{'image_all':<{width}}  {result['images']:>7d}  {result['image_all']:>8.4f}")
    return "\n".join(rows)


def build_parser() -> Parser:
    """The probe's command line."""
    p = checkpoint_parser("tools.probe", __doc__.splitlines()[0],
                          "the pre-training YAML config the checkpoint was trained with",
                          "weights to probe (.pth, raw or under 'model')", "probe.json (the printed record)")
    p.add_argument("--probe_file", default=None,
                   help=f"probe json list (default: <synthetic_root>/{PROBE_FILE_NAME})")
    p.add_argument("--batch_size", type=int, default=256, help="captions per fusion pass (default: 256)")
    p.add_argument("--limit", type=int, default=None, help="probe only the first N images (default: all)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the probe from the command line; returns the result record that is printed as JSON."""
    args = build_parser().parse_args(argv)
    set_trust_checkpoint(args.trust_checkpoint)  # set on every call: no leak between in-process runs
    # The probe reads no training data: the config's data paths need not exist.
    config = tool_config("pretrain", args)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise ConfigError("--batch_size and --limit must be >= 1")
    device = resolve_device(args.device)

    prepare_data(config)  # generates the synthetic data, whose folder holds the default probe file
    probe_file = args.probe_file or default_probe_file(config, args.config)
    image_root = config.image_root or ""
    entries = load_probe_file(probe_file, image_root=image_root)[: args.limit]

    model, tokenizer = load_pretrain_checkpoint(config, args.checkpoint, device)
    try:
        scores = score_probe(model, entries, tokenizer, image_root=image_root, image_res=config.image_res,
                             max_words=config.max_words, max_tokens=config.max_tokens, device=device,
                             batch_size=args.batch_size)
    except ImageReadError as err:  # an image that exists but does not decode
        raise ProbeFileError(f"{probe_file}: {err}") from None
    accuracy = probe_accuracy(scores)
    record = {"probe_file": probe_file, "checkpoint": args.checkpoint,
              **{k: accuracy[k] for k in ("overall", "per_kind", "image_all", "pairs", "images")}}
    print(format_table(accuracy))
    return emit_record(record, args.output_dir, "probe")


if __name__ == "__main__":
    run_main(main)
