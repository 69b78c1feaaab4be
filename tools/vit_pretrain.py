"""Pre-train the configured ViT to name the synthetic world's objects: the tiny counterpart of the
ImageNet DeiT that GRIT-VLP starts from (paper Sec. 5.1), and a test of what the ViT can perceive.

    python -m tools.vit_pretrain --config configs/tiny/Pretrain.yaml --output data/vit_synthetic.pth \
        [--steps 600] [--batch_size 32] [--lr 1e-3] [--seed 0] [--threads T] [--set key=value ...]

What is trained, on which scenes, and how: models/vit_synthetic.py. Prints one JSON line: the held-out
accuracies (1,000 fresh scenes) of "shape present", "colour of a present shape" and "size of a present
shape", the steps and the seconds; writes the ViT's state dict under "model", which `vision_init` loads.
A config with `vision_init: synthetic` gets such a file generated with these defaults on first use, in
its `synthetic_root`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from dataset import ensure_synthetic
from models.vit_synthetic import DEFAULTS, pretrain_vit, save_synthetic_vit
from tools.checkpoint_tool import run_cli, write_record
from training.config import ConfigError, load_config, require_keys

__all__ = ["build_parser", "cli", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The tool's command line."""
    p = argparse.ArgumentParser(prog="python -m tools.vit_pretrain", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a config with synthetic_root and the ViT's keys")
    p.add_argument("--output", required=True, help="where to write the ViT state dict (.pth)")
    for key, value in DEFAULTS.items():
        p.add_argument(f"--{key}", type=type(value), default=value)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--set", dest="set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides, as in the training scripts")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the tool; returns the JSON record it prints."""
    args = build_parser().parse_args(argv)
    config = dict(load_config(args.config, args.set))
    require_keys(config, ("synthetic_root", "image_res", "vision_width"), args.config)
    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0:
        raise ConfigError("--steps and --batch_size must be >= 1 and --lr > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    root = str(config["synthetic_root"])
    ensure_synthetic(root)  # its image size and its eval scenes (not prepare_data: no vision_init needed)
    recipe = {key: getattr(args, key) for key in DEFAULTS}
    start = time.perf_counter()
    vit, accuracy = pretrain_vit(config, root, **recipe)
    seconds = round(time.perf_counter() - start, 1)
    save_synthetic_vit(vit, config, accuracy, args.output, recipe)
    record = {"output": args.output, "steps": args.steps, "batch_size": args.batch_size,
              "held_out_accuracy": accuracy, "seconds": seconds}
    write_record(record, None)
    return record


def cli(argv: Sequence[str] | None = None) -> None:
    """main(argv); a bad config or a missing file ends in a one-line error (exit 2)."""
    run_cli(main, (ConfigError, FileNotFoundError), argv)


if __name__ == "__main__":
    cli()
