"""Throughput of the pre-training data pipeline per loader worker: decode, crop + RandAugment, tokenise.

    python -m tools.loader_bench [--config configs/Pretrain.yaml] [--images 64] [--size 640x480]
        [--step_samples_per_s R] [--output_dir DIR] [--set key=value ...]

Writes --images JPEGs of --size (smooth random colour fields with edges, about the size of a COCO or
CC3M image; the synthetic world's 64 px PNGs would flatter the decoder) to a temporary folder, then, in
this process with one thread (one worker = one process), times each stage over all images: PIL decode
+ RGB conversion (what dataset.utils.read_image does), the config's training transform (random resized
crop, flip, RandAugment, normalise), and tokenising batches of captions as the collate does. Prints
one JSON object (also written to DIR/loader_bench.json with --output_dir): images/s per worker for each
stage and for the whole pipeline, and, given a training step rate in samples/s per GPU, the number of
workers that rate needs.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from dataset.transforms import train_transform
from tools.cli import add_config_args, add_output_dir, emit_record, tool_config, tool_parser
from tools.launch import ROOT
from training.cli import Parser, run_main


def _write_images(folder: str, count: int, width: int, height: int, seed: int) -> list[str]:
    """count JPEGs (quality 90) of smooth random colour fields with a few hard edges."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        small = rng.integers(0, 256, size=(height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((width, height), Image.BICUBIC)
        pixels = np.asarray(image).copy()
        y, x = rng.integers(0, height), rng.integers(0, width)
        pixels[y:, x:] = 255 - pixels[y:, x:]  # an edge, so the JPEG is not unnaturally small
        path = os.path.join(folder, f'{i:05d}.jpg')
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


def _rate(count: int, seconds: float) -> float:
    return round(count / max(seconds, 1e-9), 1)


def build_parser() -> Parser:
    """The tool's command line."""
    p = tool_parser('tools.loader_bench', __doc__.splitlines()[0])
    add_config_args(p, 'the pre-training YAML config whose transform and tokenizer length are timed '
                       '(default: the repository\'s configs/Pretrain.yaml)', required=False)
    p.add_argument('--images', type=int, default=64, help='JPEGs to write and time (default: 64)')
    p.add_argument('--size', default='640x480', help='WIDTHxHEIGHT of the JPEGs (default: 640x480)')
    p.add_argument('--repeats', type=int, default=2, help='passes over the images, best kept (default: 2)')
    p.add_argument('--step_samples_per_s', type=float, default=None,
                   help='a training step rate (samples/s per GPU) to size the workers for')
    p.add_argument('--seed', type=int, default=0, help='seed of the images (default: 0)')
    add_output_dir(p, 'loader_bench.json (the printed record)')
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark and print one JSON object (also returned)."""
    p = build_parser()
    args = p.parse_args(argv)
    args.config = args.config or os.path.join(ROOT, 'configs', 'Pretrain.yaml')
    try:
        width, height = (int(v) for v in args.size.lower().split('x'))
    except ValueError:
        p.error(f'--size must be WIDTHxHEIGHT, got {args.size!r}')
    if args.images < 1:
        p.error('--images must be >= 1')
    # Only the transform's keys are read: the config's data need not exist here.
    config = tool_config('pretrain', args)
    res = config.image_res
    transform = train_transform(res, scale=tuple(config.crop_scale), hflip=config.hflip,
                                randaugment=config.randaugment)
    torch.set_num_threads(1)  # one loader worker is one single-threaded process
    torch.manual_seed(args.seed)
    captions = ['a man riding a wave on top of a surfboard in the ocean'] * args.images

    from transformers import BertTokenizerFast

    from dataset.synthetic import ensure_synthetic

    # The paper's bert-base-uncased cannot be fetched offline; a word-level vocab of the synthetic set
    # tokenises at the same fast-tokenizer speed per token.
    vocab = os.path.join(ensure_synthetic(os.path.join(ROOT, 'data', 'synthetic')), 'vocab.txt')
    tokenizer = BertTokenizerFast(vocab_file=vocab)
    best = {'decode': math.inf, 'transform': math.inf, 'tokenise': math.inf}
    with tempfile.TemporaryDirectory() as folder:
        paths = _write_images(folder, args.images, width, height, args.seed)
        mean_bytes = sum(os.path.getsize(q) for q in paths) / len(paths)
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            decoded = []
            for path in paths:  # one file at a time, as a worker does
                with Image.open(path) as im:
                    decoded.append(im.convert('RGB'))
            t1 = time.perf_counter()
            for image in decoded:
                transform(image)
            t2 = time.perf_counter()
            for start in range(0, len(captions), 64):
                tokenizer(captions[start:start + 64], padding='longest', truncation=True,
                          max_length=config.max_tokens, return_tensors='pt')
            t3 = time.perf_counter()
            for key, seconds in zip(best, (t1 - t0, t2 - t1, t3 - t2)):
                best[key] = min(best[key], seconds)
    total = sum(best.values())
    result = {
        'config': args.config, 'image_res': res, 'randaugment': config.randaugment,
        'jpeg': f'{width}x{height}', 'jpeg_mean_bytes': round(mean_bytes), 'images': args.images,
        'threads_per_worker': 1, 'timing': f'best of {max(1, args.repeats)} passes',
        'images_per_s_per_worker': {'decode': _rate(args.images, best['decode']),
                                    'transform': _rate(args.images, best['transform']),
                                    'tokenise': _rate(args.images, best['tokenise']),
                                    'pipeline': _rate(args.images, total)},
        'share_of_time': {k: round(v / total, 3) for k, v in best.items()},
    }
    if args.step_samples_per_s:
        result['step_samples_per_s'] = args.step_samples_per_s
        per_worker = result['images_per_s_per_worker']['pipeline']
        result['workers_needed'] = math.ceil(args.step_samples_per_s / per_worker)
    return emit_record(result, args.output_dir, 'loader_bench')


if __name__ == '__main__':
    run_main(main)
