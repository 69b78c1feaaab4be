"""Pre-train the configured ViT to name the synthetic world's objects: the tiny counterpart of the
ImageNet DeiT that GRIT-VLP starts from (paper Sec. 5.1), and a test of what the ViT can perceive.

    python -m tools.vit_pretrain --config configs/tiny/Pretrain.yaml [--output_dir DIR] \
        [--steps 600] [--batch_size 32] [--lr 1e-3] [--seed 0] [--threads T] [--set key=value ...]

What is trained, on which scenes, and how: dataset/synthetic_vit.py. Prints one JSON line: the held-out
accuracies (1,000 fresh scenes) of "shape present", "colour of a present shape" and "size of a present
shape", the steps and the seconds; writes the ViT's state dict under "model", which `vision_init` loads.
The file is named as the one `vision_init: synthetic` loads for this config's ViT shape
(models.vit.synthetic_vit_path), vit_r{res}_p{patch}_w{width}_d{depth}_h{heads}_{stem}.pth, in --output_dir
(with vit_pretrain.json, the record) or, without it, in synthetic_root, where the task scripts look for it
(and make it with the default recipe when it is missing).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from dataset import ensure_synthetic
from dataset.synthetic_vit import DEFAULTS, pretrain_vit, save_synthetic_vit
from models.vit import synthetic_vit_path, vit_shape
from tools.cli import add_config_args, add_output_dir, emit_record, tool_config, tool_parser
from training.cli import Parser, run_main
from training.config_files import ConfigError
from training.inputs import bare_vision_encoder

__all__ = ["build_parser", "main"]


def build_parser() -> Parser:
    """The tool's command line."""
    p = tool_parser("tools.vit_pretrain", "Pre-train the configured ViT to name the synthetic world's "
                                          "objects (the weights `vision_init: synthetic` loads); prints "
                                          "held-out accuracies as one JSON line.")
    add_config_args(p, "a pre-training config (its synthetic_root and ViT keys are read)")
    add_output_dir(p, "the ViT (vit_r{res}_p{patch}_w{width}_d{depth}_h{heads}_{stem}.pth, the name "
                      "`vision_init: synthetic` loads) and vit_pretrain.json",
                   without="the ViT goes to synthetic_root, where the task scripts look for it")
    for key, value in DEFAULTS.items():
        p.add_argument(f"--{key}", type=type(value), default=value, help=f"training recipe (default {value})")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the tool; returns the JSON record it prints."""
    args = build_parser().parse_args(argv)
    # No data is read (only the synthetic world, made here): its paths need not exist.
    config = tool_config("pretrain", args)
    if not config.synthetic_root:
        raise ConfigError(f"config key 'synthetic_root' is null in {args.config}: the ViT is trained on the "
                          "synthetic world generated there; set it (--set synthetic_root=data/synthetic)")
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0:
        raise ConfigError("--steps and --batch_size must be >= 1 and --lr > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    output = synthetic_vit_path(config)
    if args.output_dir:
        output = os.path.join(args.output_dir, os.path.basename(output))
    # Its image size and its eval scenes (not prepare_inputs: this tool makes the ViT itself).
    ensure_synthetic(config.synthetic_root)
    recipe = {key: getattr(args, key) for key in DEFAULTS}
    start = time.perf_counter()
    vit, accuracy = pretrain_vit(bare_vision_encoder(config), config.vision_width, config.synthetic_root,
                                 image_res=config.image_res, **recipe)
    seconds = round(time.perf_counter() - start, 1)
    save_synthetic_vit(vit, vit_shape(config), accuracy, output, recipe)
    record = {"output": output, "steps": args.steps, "batch_size": args.batch_size,
              "held_out_accuracy": accuracy, "seconds": seconds}
    return dict(emit_record(record, args.output_dir, "vit_pretrain"))


if __name__ == "__main__":
    run_main(main)
