"""The pre-training model of a checkpoint, as the checkpoint tools (probe, uov, warmstart) load it."""

from __future__ import annotations

import sys
from typing import TextIO

import torch
from transformers import BertTokenizerFast

from models.loading import load_weights
from models.pretrain import ALBEF_Base
from models.tokenization import build_tokenizer
from tools.step_measure import random_model
from training.config import PretrainConfig

__all__ = ["load_pretrain_checkpoint"]


def load_pretrain_checkpoint(config: PretrainConfig, checkpoint: str, device: torch.device,
                             seed: int | None = None, log: TextIO | None = None,
                             ) -> tuple[ALBEF_Base, BertTokenizerFast]:
    """ALBEF_Base of the config with `checkpoint` loaded, on `device`, and its tokenizer.

    The model starts from random weights (vision_init and text_encoder weights would only be
    overwritten, and the synthetic ViT would be trained first when it is missing): the seed (default:
    config.seed) makes the weights the checkpoint lacks at least repeatable. The load summary goes to
    `log` (stdout by default).
    """
    tokenizer = build_tokenizer(config)  # text_encoder may still name the tokenizer
    torch.manual_seed(config.seed if seed is None else seed)
    model = random_model(config, tokenizer)
    print(f"loaded {checkpoint}: {load_weights(model, checkpoint).summary()}", file=log or sys.stdout,
          flush=True)
    return model.to(device), tokenizer
