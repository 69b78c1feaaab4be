"""The tiny ViT pre-trained to name the synthetic world's objects: the counterpart of the ImageNet DeiT
that GRIT-VLP starts from (paper Sec. 5.1). A config's `vision_init: synthetic` loads such a file
(models.vit.synthetic_vit_path names it, one per ViT shape, in synthetic_root); training.inputs.prepare_inputs
makes it with ensure_synthetic_vit before a script builds its model, tools.vit_pretrain on demand.

The ViT (built by the caller's `build_encoder`, so that this package needs no models/ import) is trained
from scratch with a linear head on its [CLS] token to answer, for every shape of the world, whether it is
in the image and, if so, its colour and its size (cross-entropy, AdamW, one-cycle schedule). The scenes
are fresh, drawn from their own random stream and rendered as the synthetic dataset renders them; scenes
of the dataset's val and test images are never used.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dataset.synthetic import MARKER, ensure_synthetic
from dataset.synthetic_world import COLOURS, SHAPES, SIZES, Scene, render, sample_scenes
from dataset.transforms import test_transform
from grit_io import read_json

__all__ = ["DEFAULTS", "attribute_targets", "ensure_synthetic_vit", "fresh_scenes", "pretrain_vit",
           "save_synthetic_vit"]

logger = logging.getLogger(__name__)

# The training recipe of a generated ViT (tools.vit_pretrain's defaults): about 20 s on one CPU thread
# for the tiny ViT, which then names shape, colour and size of held-out scenes at ~1.0.
DEFAULTS = {"steps": 600, "batch_size": 32, "lr": 1e-3, "seed": 0}

_COLOURS = list(COLOURS)
# Head layout: per shape, present (2 logits), colour (len(COLOURS)), size (len(SIZES)).
_HEAD = len(SHAPES) * (2 + len(COLOURS) + len(SIZES))
_HELD_OUT = 1000


def attribute_targets(scene: Scene) -> Tensor:
    """(3, S) long: per shape, present (0/1), colour index and size index (-100 where absent)."""
    y = torch.full((3, len(SHAPES)), -100, dtype=torch.long)
    y[0] = 0
    for colour, shape, size in scene.objects:
        s = SHAPES.index(shape)
        y[:, s] = torch.tensor([1, _COLOURS.index(colour), SIZES.index(size)])
    return y


def _split_logits(out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Head output (B, _HEAD) -> present (B,S,2), colour (B,S,C), size (B,S,Z)."""
    n = len(SHAPES)
    present, colour, size = out.split([2 * n, len(COLOURS) * n, len(SIZES) * n], dim=1)
    return present.view(-1, n, 2), colour.view(-1, n, len(COLOURS)), size.view(-1, n, len(SIZES))


def _eval_scene_keys(root: str) -> set[str]:
    """Keys of the scenes of the dataset's val and test images (never trained on)."""
    scenes = read_json(os.path.join(root, "scenes.json"), "synthetic scene list")
    return {key for path, key in scenes.items() if path.startswith(("images/val/", "images/test/"))}


def fresh_scenes(rng: np.random.Generator, n: int, exclude: set[str]) -> list[Scene]:
    """n random scenes whose keys are not in `exclude` (repeats among them are allowed)."""
    scenes: list[Scene] = []
    while len(scenes) < n:
        scenes += [sc for sc in sample_scenes(rng, n - len(scenes)) if sc.key() not in exclude]
    return scenes


def _batch(rng: np.random.Generator, n: int, exclude: set[str], image_size: int,
           transform: Callable[[Any], Tensor]) -> tuple[Tensor, Tensor]:
    """n fresh scenes not in `exclude` -> images (n,3,H,W), targets (n,3,S)."""
    scenes = fresh_scenes(rng, n, exclude)
    images = torch.stack([transform(render(sc, rng, image_size)) for sc in scenes])
    return images, torch.stack([attribute_targets(sc) for sc in scenes])


def _loss(head_out: Tensor, y: Tensor) -> Tensor:
    """Head output (B, _HEAD), targets (B,3,S) -> summed cross-entropies of the three answers (0-dim)."""
    present, colour, size = _split_logits(head_out)
    return (F.cross_entropy(present.flatten(0, 1), y[:, 0].flatten())
            + F.cross_entropy(colour.flatten(0, 1), y[:, 1].flatten(), ignore_index=-100)
            + F.cross_entropy(size.flatten(0, 1), y[:, 2].flatten(), ignore_index=-100))


def _accuracies(head_out: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Head output (B, _HEAD), targets (B,3,S) -> accuracy per answer (colour, size: of present shapes)."""
    present, colour, size = _split_logits(head_out)
    there = y[:, 0] == 1
    return {"shape_present": (present.argmax(-1) == y[:, 0]).float().mean(),
            "colour": (colour.argmax(-1) == y[:, 1])[there].float().mean(),
            "size": (size.argmax(-1) == y[:, 2])[there].float().mean()}


def pretrain_vit(build_encoder: Callable[[], nn.Module], width: int, root: str, *, steps: int,
                 batch_size: int, lr: float, seed: int, image_res: int) -> tuple[nn.Module, dict[str, float]]:
    """Train build_encoder()'s ViT (forward_features: (B,3,image_res,image_res) -> (B,1+P,width)) and a
    linear head on attribute naming, on fresh scenes of the synthetic dataset at `root` -> (the ViT in
    eval mode, its held-out accuracies).

    The encoder is built right after torch.manual_seed(seed), so its initial weights are the seed's.
    """
    image_size = int(read_json(os.path.join(root, MARKER), "synthetic dataset marker")["image_size"])
    exclude = _eval_scene_keys(root)
    transform = test_transform(image_res)
    torch.manual_seed(seed)
    vit = build_encoder()
    head = nn.Linear(width, _HEAD)
    params = list(vit.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    held_images, held_y = _batch(np.random.default_rng([seed, 1]), _HELD_OUT, exclude, image_size, transform)
    rng = np.random.default_rng([seed, 0])
    vit.train()
    for _ in range(steps):
        images, y = _batch(rng, batch_size, exclude, image_size, transform)
        loss = _loss(head(vit.forward_features(images)[:, 0]), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    vit.eval()
    with torch.no_grad():
        hits = _accuracies(head(vit.forward_features(held_images)[:, 0]), held_y)
    return vit, {k: round(float(v), 4) for k, v in hits.items()}


def save_synthetic_vit(vit: nn.Module, shape: dict, accuracy: dict, path: str, recipe: dict) -> None:
    """Write {'model': state dict, 'vit': its shape record, 'recipe', 'held_out_accuracy'} atomically to
    path (shape: models.vit.vit_shape of the config, plain ints and str so a weights-only load reads it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save({"model": vit.state_dict(), "vit": dict(shape), "recipe": dict(recipe),
                "held_out_accuracy": dict(accuracy)}, tmp)
    os.replace(tmp, path)  # concurrent ranks write the same content; the last rename wins


def ensure_synthetic_vit(path: str, build_encoder: Callable[[], nn.Module], width: int, root: str,
                         shape: dict, image_res: int) -> str:
    """The synthetic ViT file at `path`, trained with the DEFAULTS recipe (pretrain_vit) unless it exists;
    returns path.

    build_encoder() makes the ViT to train (random init, of width `width` at image_res pixels); shape is
    the record saved with it under 'vit'; root holds the synthetic dataset (generated if missing).
    Generating takes about 20 s for the tiny ViT, on one intra-op thread so that the file is bitwise the
    same whoever makes it. Concurrent callers (ranks) each write a private file and rename it into place.
    """
    if os.path.isfile(path):
        return path
    ensure_synthetic(root)
    logger.info("generating the pre-trained synthetic ViT %s (once)", path)
    start = time.perf_counter()
    # One intra-op thread: CPU kernels sum in another order with more threads, and the file (so every
    # run that starts from it) would depend on the thread count of whichever process made it first.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        vit, accuracy = pretrain_vit(build_encoder, width, root, image_res=image_res, **DEFAULTS)
    finally:
        torch.set_num_threads(threads)
    save_synthetic_vit(vit, shape, accuracy, path, DEFAULTS)
    logger.info("wrote %s in %.0f s; held-out accuracy %s", path, time.perf_counter() - start, accuracy)
    return path
