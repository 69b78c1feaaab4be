"""Warm-start indices for GRIT's first epoch (paper S.M. C.3): group the data set with a trained model.

    python -m tools.warmstart --config configs/tiny/Pretrain.yaml --checkpoint CKPT --output_dir DIR \
        [--device cpu] [--batch_size 256] [--seed S] [--set key=value ...]

GRIT groups epoch e+1 by the features it collected in epoch e, so epoch 0 is random. With a model
that is already trained (the paper used ALBEF_Base50 after one epoch), one no-grad pass of its
uni-modal encoders over the whole pre-training set gives the features to group epoch 0 as well.
The pass feeds GRIT's own collector (grit.GritCollector: queues of batching.queue_size, example shuffle,
sub-queues of batching.search_space, greedy_chain) with the data set in a seeded random order, exactly as
training feeds it, and writes the resulting G to DIR/warmstart_indices.pt: a 1-D int64 tensor holding every
dataset index once, in grouped order. Point batching.warmstart_indices at the file; GritSampler composes epoch
0 from it as it composes any later epoch from the G of the one before (cut into chunks of batch_size,
shuffled). The config's batching block gives the sizes, as for a run with GRIT on, even where it is off.

The pass is deterministic for a seed: eval mode, the test transform (resize, no random crop), one
caption per entry drawn by a seeded `random`. --batch_size only sets the pass's throughput: the
collector's result depends on the order of the examples, not on how they are batched. Prints one JSON
line, also written to DIR/warmstart.json: the index file, the number of indices, the mean hardest in-batch
negative cosine similarity of the grouped batches of the config's batch_size and of the same indices in a
random order, and the seconds taken.

--image_token_drop R (issue 51) also measures what grouping by masked features costs: a run with
image_token_drop R groups by the CLS projections of its masked forward. The pass then encodes every image a
second time with R of its patch tokens dropped (timm's PatchDropout, seeded; the rest of the model in eval
mode) and groups the data set twice from the kept (float16) features, in the same arrival order and seed:
by the unmasked and by the masked image features. Under "image_token_drop" the record gives each grouping's
hardness measured on the unmasked features (the pairs' similarity as evaluation sees it) and the masked
grouping's hardness on the masked features (what training's hardness logs). The index file stays the
unmasked grouping's.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from dataset import ImageTextCollate, PretrainDataset, create_dataset, prepare_data
from dataset.transforms import test_transform
from grit import GritCollector, option_problems
from grit_io import set_trust_checkpoint
from models.false_negatives import caption_keys, false_negative_mask
from models.negatives import hardest_negative_similarity
from models.pretrain import ALBEF_Base
from models.tokenization import build_tokenizer
from models.vit import patch_dropout
from tools.cli import checkpoint_parser, emit_record, resolve_device, tool_config
from tools.pretrain_checkpoint import load_pretrain_checkpoint
from training.cli import Parser, run_main
from training.config import PretrainConfig
from training.config_files import ConfigError

__all__ = ["INDICES_FILE", "batch_hardness", "build_parser", "encode_batches", "grit_config",
           "group_features", "main"]

INDICES_FILE = "warmstart_indices.pt"

# One batch of the pass: image_feat (B, d), text_feat (B, d), dataset index (B,), caption key (B,).
Batch = tuple[Tensor, Tensor, Tensor, Tensor]

# Chunks of batch_size scored at once by batch_hardness: bounds the (chunks, N, N) similarity tensor.
_HARDNESS_CHUNKS = 4096


@torch.no_grad()
def encode_batches(model: ALBEF_Base, dataset: PretrainDataset, collate: ImageTextCollate,
                   order: Sequence[int], batch_size: int, device: torch.device | str,
                   num_workers: int = 0, seed: int = 0, image_token_drop: float = 0.0) -> Iterator[Batch]:
    """Uni-modal ITC projections of dataset[order] in order -> batches (image (B,d), text (B,d), idx (B,),
    caption key (B,)), all on `device`; model in eval mode for the pass. image_token_drop > 0: each batch
    also carries the image projections of a second pass that drops that share of each image's patch tokens
    (B,d), as training with image_token_drop sees them (seeded by `seed`)."""
    loader = DataLoader(dataset, batch_size=batch_size, sampler=list(order), num_workers=num_workers,
                        collate_fn=collate, generator=torch.Generator().manual_seed(seed))
    was_training = model.training
    vit = model.visual_encoder
    kept_drop = vit.patch_drop
    model.eval()
    if image_token_drop:
        vit.patch_drop = patch_dropout(vit, image_token_drop).train()
        torch.manual_seed(seed)
    try:
        for batch in loader:
            text, idx = batch.text.to(device), batch.ids
            image = batch.image.to(device)
            vit.patch_drop.eval()
            image_feat, text_feat = model.unimodal_features(image, text)
            # The training guard's caption key (padding zeroed), so the hardness skips the same pairs.
            keys = caption_keys(text.input_ids.masked_fill(text.attention_mask == 0, 0))
            masked = ()
            if image_token_drop:
                vit.patch_drop.train()  # only the dropout: the rest of the model stays in eval mode
                masked = (model.image_feat(model.encode_image(image)).float(),)
            yield image_feat, text_feat, idx.to(device), keys, *masked
    finally:
        vit.patch_drop = kept_drop
        model.train(was_training)


@torch.no_grad()
def group_features(batches: Iterable[tuple[Tensor, ...]], dataset_len: int, dim: int, *, queue_size: int,
                   search_space: int, example_shuffle: bool = True, seed: int = 0,
                   device: torch.device | str = "cpu") -> Tensor:
    """Batches (image (B,d), text (B,d), index (B,), ...) -> G: LongTensor (n,) on CPU, the collected
    dataset indices in GRIT's grouped order (GritCollector phases 1-3, partial last queue included)."""
    collector = GritCollector(queue_size, search_space, dim, dataset_len, device, example_shuffle)
    collector.reset(seed)
    for image_feat, text_feat, index, *_ in batches:
        collector.add(image_feat, text_feat, index)
    return collector.finalize()


@torch.no_grad()
def batch_hardness(image_feat: Tensor, text_feat: Tensor, order: Tensor, batch_size: int,
                   image_keys: Tensor | None = None, text_keys: Tensor | None = None) -> float:
    """Features (D, d) indexed by dataset index, order (n,) -> mean over the n // batch_size consecutive
    batches of hardest_negative_similarity of each batch's image-text cosine matrix (N, N).

    With image_keys and text_keys (D,) int64, pairs that share an image or a caption are not negatives
    (the false-negative guard of training). The n % batch_size trailing indices are left out, as the
    sampler leaves them out of an epoch.
    """
    n_chunks = order.numel() // batch_size
    if n_chunks == 0:
        raise ValueError(f"batch_hardness: {order.numel()} indices make no batch of {batch_size}")
    chunks = order[:n_chunks * batch_size].view(n_chunks, batch_size).to(image_feat.device)
    per_batch = []
    # vmap runs the training diagnostic on all batches of a slice at once, without a Python loop.
    hardness = torch.vmap(hardest_negative_similarity)
    for part in chunks.split(_HARDNESS_CHUNKS):
        sim = torch.bmm(image_feat[part].float(), text_feat[part].float().transpose(1, 2))  # (C, N, N)
        if image_keys is not None and text_keys is not None:
            positive = torch.vmap(false_negative_mask)(image_keys[part], text_keys[part])
            per_batch.append(hardness(sim, positive))
        else:
            per_batch.append(hardness(sim))
    # A batch whose pairs are all positives has no negative (NaN): left out, as in the diagnostic.
    return float(torch.cat(per_batch).nanmean())


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def build_parser() -> Parser:
    """The tool's command line."""
    p = checkpoint_parser("tools.warmstart", __doc__.splitlines()[0],
                          "the pre-training YAML config (data, model, batching block)",
                          "trained weights (.pth, raw or under 'model')",
                          f"{INDICES_FILE} (point batching.warmstart_indices at it) and warmstart.json (the "
                          "printed record)", output_required=True)
    p.add_argument("--batch_size", type=int, default=256,
                   help="examples per encoder pass, throughput only (default: 256)")
    p.add_argument("--seed", type=int, default=None, help="sets config key seed")
    p.add_argument("--image_token_drop", type=float, default=0.0,
                   help="also group by the image features of a forward that drops this share of each image's "
                        "patch tokens, and report both groupings' hardness (default: 0, not measured)")
    return p


def grit_config(config: PretrainConfig) -> PretrainConfig:
    """The config with GRIT on (the grouping needs its sizes even where the config turns it off);
    ConfigError when its sizes break GRIT's rules."""
    config = dataclasses.replace(config, batching=dataclasses.replace(config.batching, strategy="grit"))
    sizes = config.batching  # the size rules only: the strategy's own options do not matter here
    problems = option_problems(batch_size=config.batch_size, enabled=True, queue_size=sizes.queue_size,
                               search_space=sizes.search_space, mode=sizes.mode, prefix="batching.")
    if problems:
        raise ConfigError("the batching block cannot group (tools.warmstart groups as with GRIT on): "
                          + "; ".join(problems))
    return config


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the tool from the command line; returns the record that is printed as JSON."""
    args = build_parser().parse_args(argv)
    set_trust_checkpoint(args.trust_checkpoint)  # set on every call: no leak between in-process runs
    # Fail on a bad path before minutes of data loading and model building.
    if not os.path.isfile(args.checkpoint):
        raise FileNotFoundError(f"--checkpoint: no such file: {args.checkpoint}")
    if args.batch_size < 1:
        raise ConfigError("--batch_size must be >= 1")
    if not 0 <= args.image_token_drop < 1:
        raise ConfigError(f"--image_token_drop must be in [0, 1), got {args.image_token_drop}")
    # The pass reads the training data: its paths must exist (or be the synthetic world, made below).
    config = grit_config(tool_config("pretrain", args, {"seed": args.seed}, check_paths=True))
    seed, batch_size = config.seed, config.batch_size
    device = resolve_device(args.device)
    t0 = time.perf_counter()

    prepare_data(config)
    tokenizer = build_tokenizer(config)
    dataset = create_dataset("pretrain", config)
    # The features should describe the example, not one random crop of it.
    dataset.transform = test_transform(config.image_res)
    collate = ImageTextCollate(tokenizer, config.max_tokens)
    D, dim = len(dataset), config.embed_dim
    if D < batch_size:
        raise ConfigError(f"the data set has {D} examples, fewer than one batch of {batch_size}")

    model, _ = load_pretrain_checkpoint(config, args.checkpoint, device, log=sys.stderr)

    random.seed(seed)  # list captions: one seeded draw per entry (num_workers 0; workers seed from it)
    gen = torch.Generator().manual_seed(seed)
    # A random arrival order, as in a training epoch: queue fills must not follow the files' order.
    order = torch.randperm(D, generator=gen)
    # float16 on CPU: 4 bytes per (image, text) dimension pair keep a 4M-pair set at 4 GB for d=256;
    # the hardness is a diagnostic, and cosines in [-1, 1] lose < 1e-3.
    image_all = torch.zeros(D, dim, dtype=torch.float16)
    text_all = torch.zeros(D, dim, dtype=torch.float16)
    text_keys = torch.zeros(D, dtype=torch.long)
    masked_all = torch.zeros(D, dim, dtype=torch.float16) if args.image_token_drop else None

    def recorded(batches: Iterable[Batch]) -> Iterator[Batch]:
        for image_feat, text_feat, idx, keys, *masked in batches:
            cpu_idx = idx.cpu()
            image_all[cpu_idx] = image_feat.cpu().half()
            text_all[cpu_idx] = text_feat.cpu().half()
            text_keys[cpu_idx] = keys.cpu()
            if masked:
                masked_all[cpu_idx] = masked[0].cpu().half()
            yield image_feat, text_feat, idx, keys

    batches = encode_batches(model, dataset, collate, order.tolist(), args.batch_size, device,
                             num_workers=config.num_workers, seed=seed,
                             image_token_drop=args.image_token_drop)
    sizes = config.batching
    G = group_features(recorded(batches), D, dim, queue_size=sizes.queue_size,
                       search_space=sizes.search_space,
                       example_shuffle=sizes.example_shuffle, seed=seed, device=device)
    seconds = time.perf_counter() - t0

    os.makedirs(args.output_dir, exist_ok=True)
    indices_file = os.path.join(args.output_dir, INDICES_FILE)
    torch.save(G.long().contiguous(), indices_file)

    guard = config.guard_false_negatives
    keys = (torch.as_tensor(dataset.image_keys, dtype=torch.long), text_keys) if guard else (None, None)
    random_order = G[torch.randperm(G.numel(), generator=gen)]
    record = {
        "warmstart_indices": indices_file,
        "checkpoint": args.checkpoint,
        "indices": int(G.numel()),
        "dataset_len": D,
        "batch_size": batch_size,
        "hardness_grouped": batch_hardness(image_all, text_all, G, batch_size, *keys),
        "hardness_random": batch_hardness(image_all, text_all, random_order, batch_size, *keys),
        "guard_false_negatives": guard,
        "seconds": round(seconds, 3),
    }
    if masked_all is not None:
        record["image_token_drop"] = masked_hardness(image_all, masked_all, text_all, order, config,
                                                     args.image_token_drop, args.batch_size, keys)
    return emit_record(record, args.output_dir, "warmstart")


def masked_hardness(image_all: Tensor, masked_all: Tensor, text_all: Tensor, order: Tensor,
                    config: PretrainConfig, rate: float, batch_size: int,
                    keys: tuple[Tensor | None, Tensor | None]) -> dict:
    """Stored features (D,d), the pass's arrival order (D,) -> the hardness of grouping by the unmasked and by
    the masked image features (both regrouped from the float16 copies, in the same order and seed)."""
    sizes = config.batching

    def grouped(image: Tensor) -> Tensor:
        batches = ((image[i].float(), text_all[i].float(), i) for i in order.split(batch_size))
        return group_features(batches, len(order), image.shape[1], queue_size=sizes.queue_size,
                              search_space=sizes.search_space, example_shuffle=sizes.example_shuffle,
                              seed=config.seed)

    by_unmasked, by_masked = grouped(image_all), grouped(masked_all)
    N = config.batch_size
    return {"rate": rate,
            "hardness_grouped_by_unmasked": batch_hardness(image_all, text_all, by_unmasked, N, *keys),
            "hardness_grouped_by_masked": batch_hardness(image_all, text_all, by_masked, N, *keys),
            "hardness_grouped_by_masked_on_masked": batch_hardness(masked_all, text_all, by_masked, N, *keys),
            "cosine_masked_to_unmasked": float((masked_all.float() * image_all.float()).sum(1).mean())}


if __name__ == "__main__":
    run_main(main)
