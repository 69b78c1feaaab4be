"""The tiny ViT pre-trained to name the synthetic world's objects: the counterpart of the ImageNet DeiT
that GRIT-VLP starts from (paper Sec. 5.1). `vision_init: synthetic` in a config names it; it is
generated on first use, like the synthetic data, once per ViT shape, into synthetic_root.

The config's ViT (image_res, patch_size, vision_width/depth/heads, vision_stem) is trained from scratch
with a linear head on its [CLS] token to answer, for every shape of the world, whether it is in the
image and, if so, its colour and its size (cross-entropy, AdamW, one-cycle schedule). The scenes are
fresh, drawn from their own random stream and rendered as the synthetic dataset renders them; scenes
of the dataset's val and test images are never used. `tools.vit_pretrain` is the command line.
"""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dataset.synthetic import MARKER, ensure_synthetic
from dataset.synthetic_world import COLOURS, SHAPES, SIZES, Scene, render, sample_scenes
from dataset.transforms import test_transform
from models.vit import VIT_DEFAULTS, build_vision_encoder

__all__ = ["DEFAULTS", "VIT_KEYS", "attribute_targets", "ensure_synthetic_vit", "fresh_scenes",
           "pretrain_vit", "save_synthetic_vit", "synthetic_vit_path", "vit_shape"]

logger = logging.getLogger(__name__)

# The training recipe of a generated ViT (tools.vit_pretrain's defaults): about 20 s on one CPU thread
# for the tiny ViT, which then names shape, colour and size of held-out scenes at ~1.0.
DEFAULTS = {"steps": 600, "batch_size": 32, "lr": 1e-3, "seed": 0}
# The config keys that shape the ViT; a generated file records them and must match them to be used.
VIT_KEYS = ("image_res", "patch_size", "vision_width", "vision_depth", "vision_heads", "vision_stem")


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
    with open(os.path.join(root, "scenes.json"), encoding="utf-8") as f:
        scenes = json.load(f)
    return {key for path, key in scenes.items() if path.startswith(("images/val/", "images/test/"))}


def fresh_scenes(rng: np.random.Generator, n: int, exclude: set[str]) -> list[Scene]:
    """n random scenes whose keys are not in `exclude` (repeats among them are allowed)."""
    scenes: list[Scene] = []
    while len(scenes) < n:
        scenes += [sc for sc in sample_scenes(rng, n - len(scenes)) if sc.key() not in exclude]
    return scenes


def _batch(rng: np.random.Generator, n: int, exclude: set[str], image_size: int,
           transform) -> tuple[Tensor, Tensor]:
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


def pretrain_vit(config: dict, root: str, steps: int, batch_size: int, lr: float, seed: int
                 ) -> tuple[nn.Module, dict]:
    """Train the config's ViT + a linear head on attribute naming -> (ViT, held-out accuracies)."""
    with open(os.path.join(root, MARKER), encoding="utf-8") as f:
        image_size = int(json.load(f)["image_size"])
    exclude = _eval_scene_keys(root)
    transform = test_transform(int(config["image_res"]))
    torch.manual_seed(seed)
    vit = build_vision_encoder({**config, "vision_init": None, "grad_checkpointing": False})
    head = nn.Linear(int(config["vision_width"]), _HEAD)
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


def vit_shape(config: dict) -> dict:
    """The config's ViT-shaping keys (VIT_KEYS) with build_vision_encoder's defaults filled in."""
    # Plain ints and str: YAML scalars would make the saved file need unpickling.
    return {k: (str if k == "vision_stem" else int)(config.get(k, VIT_DEFAULTS.get(k))) for k in VIT_KEYS}


def save_synthetic_vit(vit: nn.Module, config: dict, accuracy: dict, path: str, recipe: dict) -> None:
    """Write {'model': state dict, 'vit': its shape, 'recipe', 'held_out_accuracy'} atomically to path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save({"model": vit.state_dict(), "vit": vit_shape(config), "recipe": dict(recipe),
                "held_out_accuracy": dict(accuracy)}, tmp)
    os.replace(tmp, path)  # concurrent ranks write the same content; the last rename wins


def synthetic_vit_path(config: dict) -> str:
    """Where the synthetic ViT of the config's shape lives: <synthetic_root>/vit_<shape>.pth."""
    root = config.get("synthetic_root")
    if not (isinstance(root, str) and root):
        raise ValueError("config key 'vision_init' is 'synthetic' (the ViT pre-trained on the synthetic "
                         "world), which needs 'synthetic_root'; set vision_init to null or to a weights file")
    shape = vit_shape(config)
    tag = "r{image_res}_p{patch_size}_w{vision_width}_d{vision_depth}_h{vision_heads}_{vision_stem}"
    tag = tag.format(**shape)
    return os.path.join(root, f"vit_{tag}.pth")


def ensure_synthetic_vit(config: dict) -> str:
    """The weights file of `vision_init: synthetic` for the config's ViT shape, generated on first use.

    Generating takes about 20 s for the tiny ViT (DEFAULTS), on one thread so that the file is bitwise
    the same whoever makes it; it records the shape and the recipe. Concurrent callers (ranks) each
    write a private file and rename it into place.
    """
    path = synthetic_vit_path(config)
    if os.path.isfile(path):
        return path
    root = str(config["synthetic_root"])
    ensure_synthetic(root)
    logger.info("generating the pre-trained synthetic ViT %s (once)", path)
    start = time.perf_counter()
    # One intra-op thread: CPU kernels sum in another order with more threads, and the file (so every
    # run that starts from it) would depend on the thread count of whichever process made it first.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        vit, accuracy = pretrain_vit(config, root, **DEFAULTS)
    finally:
        torch.set_num_threads(threads)
    save_synthetic_vit(vit, config, accuracy, path, DEFAULTS)
    logger.info("wrote %s in %.0f s; held-out accuracy %s", path, time.perf_counter() - start, accuracy)
    return path
