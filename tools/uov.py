"""Usage of Vision (UoV, paper §5.6): MLM accuracy of ALBEF_Base with the image minus without it.

    python -m tools.uov --config configs/tiny/Pretrain.yaml \
        --checkpoint output/demo/grit_vlp/pretrain/checkpoint_11.pth --probs 0.15 0.35 0.5 0.75 \
        [--captions data/synthetic/retrieval_test.json] [--output_dir DIR] [--device cpu] \
        [--batch_size 256] [--limit N] [--seed 0] [--set key=value ...]

Held-out captions come from a json list in ALBEF's retrieval val/test format,
``[{"image": path, "caption": str | [str, ...]}, ...]`` (image paths relative to the config's
image_root); every caption is one (image, caption) pair. The default is
<synthetic_root>/retrieval_test.json when the config names a synthetic_root. Captions are cleaned
and tokenized exactly as in pre-training (pre_caption, max_words, max_tokens).

For each masking probability p the same tokens are masked in both passes (the paper: "exactly the
same tokens are masked for a fair comparison"): a token is selected when its uniform draw from a
torch.Generator seeded with --seed (drawn on the CPU, so the selection is the same on every device)
is < p; [PAD] and [CLS] are never selected and [SEP] is, as in training (models.objectives.
mask_tokens). Unlike training, every selected token becomes [MASK] (no 80/10/10 replacement): the
metric asks how well the model recovers a hidden word, not how it copes with corrupted input. Every
p thresholds the same draws, so the masks of the smaller probabilities are subsets of the larger
ones and a p's numbers do not depend on which other probabilities were asked for. p must lie in
(0, 1]: p = 0 masks nothing and is rejected; a p > 0 that happens to select no token (a handful of
captions) reports masked_tokens 0 and null accuracies.

The fusion encoder then predicts the masked tokens (multimodal MLM path of ALBEF_Base) once with
the real image and once with a blank image: a constant image of the normalisation mean colour
(dataset.transforms.ALBEF_MEAN, about RGB (123, 117, 104)), which after ALBEF's normalisation is
the all-zero tensor. The blank image keeps the input shape and the cross-attention of a normal
forward pass while carrying no information about any caption. Accuracies are micro-averaged over
masked tokens: acc@k is the share whose true id is among the k highest logits;
UoV@k = acc@k (with image) - acc@k (without image). Prints a table (one row per p), then one JSON
line; --output_dir writes that JSON to DIR/uov.json too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from dataset import prepare_data
from dataset.retrieval import RetrievalEvalDataset
from dataset.transforms import test_transform
from dataset.utils import ImageReadError, resolve_image
from grit_io import InputFileError, set_trust_checkpoint
from models.pretrain import ALBEF_Base
from tools.cli import checkpoint_parser, emit_record, resolve_device, tool_config
from tools.pretrain_checkpoint import load_pretrain_checkpoint
from training.cli import Parser, run_main
from training.config import TaskConfig
from training.config_files import ConfigError

__all__ = ["CaptionFileError", "blank_image", "build_parser", "default_captions_file", "format_table",
           "load_captions", "main", "masked_positions", "usage_of_vision"]

CAPTIONS_FILE_NAME = "retrieval_test.json"
TOP_K = (1, 5)
BLANK_IMAGE = "constant image of the ALBEF_MEAN colour (all zeros after normalisation)"


class CaptionFileError(InputFileError):
    """A caption file is malformed or names an image that cannot be read; the message names the file."""


# ----------------------------------------------------------------------------------------------
# Masking and scoring
# ----------------------------------------------------------------------------------------------


def masked_positions(input_ids: Tensor, attention_mask: Tensor, probability: float,
                     special_ids: Sequence[int], generator: torch.Generator | None = None) -> Tensor:
    """ids, mask (N,L) -> bool (N,L): each real token not in special_ids, selected with `probability`.

    One uniform draw per position from `generator` (on its device, CPU when None): the selection
    depends only on the generator's state and the shape, never on the image, so the with- and
    without-image passes share it. Pass special_ids=(pad, cls) as training does ([SEP] maskable).
    """
    if not 0.0 < probability <= 1.0:
        raise ValueError(f"masking probability must be in (0, 1], got {probability} "
                         "(0 masks nothing, so there is no accuracy to compare)")
    device = generator.device if generator is not None else torch.device("cpu")
    draw = torch.rand(input_ids.shape, generator=generator, device=device).to(input_ids.device)
    maskable = attention_mask != 0  # a new tensor: the caller's mask is never written to
    for special in special_ids:  # a handful of ids, not the tokens
        maskable &= input_ids != special
    return (draw < probability) & maskable


def blank_image(image_res: int | tuple[int, int]) -> Tensor:
    """The "without image" input (1,3,H,W): the ALBEF_MEAN colour, i.e. zeros after normalisation."""
    h, w = (image_res, image_res) if isinstance(image_res, int) else image_res
    return torch.zeros(1, 3, int(h), int(w))


def _accuracy(hits: int, total: int) -> float | None:
    return hits / total if total else None


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


@torch.no_grad()
def usage_of_vision(model: ALBEF_Base, images: Tensor | Sequence[Tensor], input_ids: Tensor,
                    attention_mask: Tensor, probs: Sequence[float], generator_seed: int = 0,
                    batch_size: int = 256, image_index: Tensor | None = None) -> dict:
    """Images (I,3,H,W) (or a sequence of (3,H,W)), captions ids/mask (N,L), image_index (N,) -> UoV.

    image_index[n] is caption n's image (None: I == N, one image per caption); captions of one image
    should be adjacent so that a batch encodes each image once. batch_size bounds the captions per
    fusion pass (each pass holds them twice: with and without image). Runs on the model's device in
    eval mode. Returns {"pairs", "seed", "results": [{"prob", "masked_tokens", "acc1",
    "acc1_no_image", "uov1", "acc5", "acc5_no_image", "uov5"}, ...]} (accuracies None when nothing
    was masked).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not probs:
        raise ValueError("usage_of_vision: no masking probabilities given")
    n_pairs = input_ids.shape[0]
    if n_pairs == 0:
        raise ValueError("usage_of_vision: no captions given")
    if image_index is None:
        if len(images) != n_pairs:
            raise ValueError(f"usage_of_vision: {len(images)} images for {n_pairs} captions "
                             "(pass image_index to share images between captions)")
        image_index = torch.arange(n_pairs)
    image_index = torch.as_tensor(image_index, dtype=torch.long).cpu()
    input_ids, attention_mask = input_ids.cpu(), attention_mask.cpu()
    # All selections are drawn up front over the whole set, so they do not depend on batch_size;
    # re-seeding for every p makes the masks nested and each p independent of the others asked for.
    selections = torch.stack([
        masked_positions(input_ids, attention_mask, float(p), model.special_ids,
                         torch.Generator().manual_seed(int(generator_seed)))
        for p in probs
    ])  # (P,N,L)

    device = next(model.parameters()).device
    k_max = min(max(TOP_K), int(model.vocab_size))
    # Column of the (2,M,k_max) cumulative hits that answers "within the top k" (k_max if V < k).
    k_columns = torch.tensor([min(k, k_max) - 1 for k in TOP_K], device=device)
    # Per p: hits at each k with image, then at each k without.
    hits = torch.zeros(len(probs), 2 * len(TOP_K), dtype=torch.long, device=device)
    blank_embeds = None
    was_training = model.training
    model.eval()
    try:
        for start in range(0, n_pairs, batch_size):
            stop = min(start + batch_size, n_pairs)
            mask = attention_mask[start:stop]
            # Columns past the batch's last real token are padding in every row: not worth a forward.
            length = int(mask.any(dim=0).nonzero().max()) + 1
            ids, mask = input_ids[start:stop, :length].to(device), mask[:, :length].to(device)
            unique, inverse = torch.unique(image_index[start:stop], return_inverse=True)
            pixels = (images[unique] if isinstance(images, Tensor)
                      else torch.stack([images[i] for i in unique.tolist()]))
            image_embeds = model.encode_image(pixels.to(device))[inverse.to(device)]
            if blank_embeds is None:  # the same for every caption: encoded once, at the images' size
                blank_embeds = model.encode_image(blank_image(tuple(pixels.shape[-2:])).to(device))
            # One fusion pass over [with image; blank image] per p: both halves see the same masked ids.
            context = torch.cat([image_embeds, blank_embeds.expand(len(ids), -1, -1)])
            for j in range(len(probs)):
                selected = selections[j, start:stop, :length].to(device)
                masked_ids = ids.masked_fill(selected, model.mask_token_id)
                hidden = model.text_encoder(masked_ids.repeat(2, 1), mask.repeat(2, 1), mode="multimodal",
                                            encoder_hidden_states=context)
                # Logits at the masked positions only (row-major: the with-image ones first).
                logits = model.text_encoder.mlm_logits(hidden[selected.repeat(2, 1)])  # (2M,V)
                labels = ids[selected].repeat(2)  # (2M,)
                top = logits.topk(k_max, dim=-1).indices == labels[:, None]  # (2M,k_max), <= one True a row
                # A row's cumulative sum is 1 from the label's rank on: column k-1 says "in the top k".
                within = top.view(2, labels.numel() // 2, k_max).cumsum(dim=-1)[..., k_columns]  # (2,M,K)
                hits[j] += within.sum(dim=1).flatten()
    finally:
        model.train(was_training)

    hits = hits.cpu().tolist()
    masked = selections.flatten(1).sum(dim=1).tolist()
    results = []
    for j, p in enumerate(probs):
        entry: dict = {"prob": float(p), "masked_tokens": int(masked[j])}
        for i, k in enumerate(TOP_K):
            with_image = _accuracy(hits[j][i], masked[j])
            without_image = _accuracy(hits[j][len(TOP_K) + i], masked[j])
            entry.update({f"acc{k}": with_image, f"acc{k}_no_image": without_image,
                          f"uov{k}": _difference(with_image, without_image)})
        results.append(entry)
    return {"pairs": n_pairs, "seed": int(generator_seed), "results": results}


# ----------------------------------------------------------------------------------------------
# The caption file
# ----------------------------------------------------------------------------------------------


class _ImageFiles(Sequence):
    """The first n images of a RetrievalEvalDataset, read and transformed when indexed (memory: a batch)."""

    def __init__(self, dataset: RetrievalEvalDataset, n: int):
        self.dataset, self.n = dataset, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Tensor:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return self.dataset[index][0]


def load_captions(path: str, image_root: str, image_res: int, max_words: int = 30,
                  limit: int | None = None) -> tuple[Sequence[Tensor], list[str], Tensor]:
    """A retrieval-format json list -> (lazily read images (I,), cleaned captions (N,), image_index (N,)).

    limit keeps the first `limit` images and all of their captions. Every image file must exist;
    FileNotFoundError for a missing json file, CaptionFileError (naming the file) for anything else.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"caption file not found: {path}")
    try:
        dataset = RetrievalEvalDataset(path, test_transform(int(image_res)), image_root, max_words)
    except ValueError as err:  # grit_io.InputFileError (a ValueError) naming the file and entry
        raise CaptionFileError(str(err)) from None
    n_images = len(dataset) if limit is None else min(limit, len(dataset))
    if n_images == 0:
        raise CaptionFileError(f"{path}: the caption file holds no entries")
    for i, image in enumerate(dataset.image[:n_images]):
        if not isinstance(image, str) or not image:
            raise CaptionFileError(f"{path}: entry {i}: 'image' must be a non-empty path string, "
                                   f"got {image!r}")
        file = resolve_image(image_root, image)
        if not os.path.isfile(file):
            raise CaptionFileError(f"{path}: entry {i}: image not found: {file} (image_root {image_root!r})")
    # Texts are stored image by image, so the first images' captions are a prefix.
    n_texts = sum(len(dataset.img2txt[i]) for i in range(n_images))
    image_index = torch.tensor([dataset.txt2img[t] for t in range(n_texts)], dtype=torch.long)
    return _ImageFiles(dataset, n_images), dataset.text[:n_texts], image_index


def default_captions_file(config: TaskConfig, config_path: str = "config") -> str:
    """<synthetic_root>/retrieval_test.json for a config that names synthetic_root; else ConfigError."""
    root = config.synthetic_root
    if not root:
        raise ConfigError(f"--captions is required: {config_path} names no synthetic_root "
                          f"(whose {CAPTIONS_FILE_NAME} would be the default)")
    return os.path.join(str(root), CAPTIONS_FILE_NAME)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

_COLUMNS = [("acc1", "acc@1"), ("acc1_no_image", "acc@1 w/o image"), ("uov1", "UoV@1"),
            ("acc5", "acc@5"), ("acc5_no_image", "acc@5 w/o image"), ("uov5", "UoV@5")]


def format_table(result: dict) -> str:
    """The UoV result as a plain-text table: one row per masking probability."""
    head = ["prob", *(h for _, h in _COLUMNS), "masked tokens"]
    rows = [[f"{e['prob']:g}", *("–" if e[k] is None else f"{e[k]:.4f}" for k, _ in _COLUMNS),
             str(e["masked_tokens"])] for e in result["results"]]
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [head, *rows])


def build_parser() -> Parser:
    """The UoV command line."""
    p = checkpoint_parser("tools.uov", __doc__.splitlines()[0],
                          "the pre-training YAML config the checkpoint was trained with",
                          "weights to evaluate (.pth, raw or under 'model')", "uov.json (the printed record)")
    p.add_argument("--probs", type=float, nargs="+", default=[0.15, 0.35, 0.5, 0.75],
                   help="masking probabilities in (0, 1] (default: 0.15 0.35 0.5 0.75)")
    p.add_argument("--captions", default=None,
                   help=f"retrieval-format json list (default: <synthetic_root>/{CAPTIONS_FILE_NAME})")
    p.add_argument("--batch_size", type=int, default=256, help="captions per fusion pass (default: 256)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N images, all their captions (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the masked-position draws (default: 0)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run UoV from the command line; returns the result record that is printed as JSON."""
    args = build_parser().parse_args(argv)
    set_trust_checkpoint(args.trust_checkpoint)  # set on every call: no leak between in-process runs
    # UoV reads no training data: the config's data paths need not exist.
    config = tool_config("pretrain", args)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise ConfigError("--batch_size and --limit must be >= 1")
    bad = [p for p in args.probs if not (math.isfinite(p) and 0.0 < p <= 1.0)]
    if bad:
        raise ConfigError(f"--probs must lie in (0, 1], got {bad} (0 masks nothing: no accuracy to compare)")
    device = resolve_device(args.device)

    prepare_data(config)  # generates the synthetic data, whose folder holds the default caption file
    captions_file = args.captions or default_captions_file(config, args.config)
    image_root = config.image_root or ""
    images, captions, image_index = load_captions(captions_file, image_root, config.image_res,
                                                  config.max_words, args.limit)

    model, tokenizer = load_pretrain_checkpoint(config, args.checkpoint, device)
    # The collate's tokenizer call (dataset/collate.py), so tokens match pre-training's.
    text = tokenizer(captions, padding="longest", truncation=True, max_length=config.max_tokens,
                     return_tensors="pt")

    try:
        result = usage_of_vision(model, images, text.input_ids, text.attention_mask, args.probs,
                                 generator_seed=args.seed, batch_size=args.batch_size,
                                 image_index=image_index)
    except ImageReadError as err:  # an image that exists but does not decode
        raise CaptionFileError(f"{captions_file}: {err}") from None
    record = {"captions_file": captions_file, "checkpoint": args.checkpoint, "images": len(images),
              "blank_image": BLANK_IMAGE, **result}
    print(format_table(result))
    return emit_record(record, args.output_dir, "uov")


if __name__ == "__main__":
    run_main(main)
