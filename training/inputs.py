"""Inputs a run makes on first use, before it reads data or builds a model: the built-in synthetic dataset
and the ViT pre-trained on it (`vision_init: synthetic`).

models/ only loads the synthetic ViT and dataset/ only trains one it is handed a builder for (neither
imports the other); this is where the two meet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

import dataset
from dataset.synthetic_vit import ensure_synthetic_vit
from models.vit import SYNTHETIC, build_vision_encoder, synthetic_vit_path, vit_shape
from training.config import TaskConfig

__all__ = ["bare_vision_encoder", "prepare_inputs"]


def bare_vision_encoder(config: TaskConfig) -> Callable[[], nn.Module]:
    """A builder of the config's ViT (images (B,3,H,W) -> tokens (B,1+P,D)) from random weights and without
    gradient checkpointing: what the synthetic ViT pre-training trains."""
    # No vision_init: the ViT being made must not start from itself (or from any other file).
    plain = dataclasses.replace(config, vision_init=None, grad_checkpointing=False)
    return lambda: build_vision_encoder(plain)


def prepare_inputs(config: TaskConfig) -> None:
    """Generate the synthetic dataset at config.synthetic_root (if the config names one and it is missing)
    and, for vision_init 'synthetic', the pre-trained synthetic ViT of the config's shape (if missing).

    Every rank may call it at once: both are written to private files or folders and renamed into place.
    """
    dataset.prepare_data(config)
    if config.vision_init != SYNTHETIC:
        return
    ensure_synthetic_vit(synthetic_vit_path(config), bare_vision_encoder(config), config.vision_width,
                         config.synthetic_root, vit_shape(config), config.image_res)
