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

--from_list times a corpus's own images instead (the first --images entries of a json list, read from
--image_root, default: the list's folder, with their first captions and the config's vocab_file): the
synthetic world's PNGs, or tools.make_real's drawings next to them (docs/real-corpora.md).

--locality also times whole samples (read + decode + transform, as a worker produces them) from the json
list of files and from the same images as tar shards (tools.make_shards, --shard_size samples each, read
with wids), in sequential order and in GRIT's order (a GritSampler epoch: a permutation that jumps across
shards) with the config's shard_lru_size open shards per worker, and with every read opening its shard
(what a worker does in GRIT's order when the corpus has far more shards than it keeps open), and the
milliseconds wids takes to open a shard (its memory map and header scan).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from dataset.transforms import train_transform
from grit_io import InputFileError
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


def listed_images(path: str, image_root: str | None, count: int) -> tuple[list[str], list[str]]:
    """The image files and first captions of a json list's first `count` entries (InputFileError naming the
    list or a missing image)."""
    from dataset.utils import load_json_list, resolve_image

    entries = load_json_list(path, ('image', 'caption'))[:count]
    root = image_root if image_root is not None else os.path.dirname(os.path.abspath(path))
    files = [resolve_image(root, e['image']) for e in entries]
    for f in files:
        if not os.path.isfile(f):
            raise InputFileError(f'{f}: image of {path} does not exist')
    return files, [e['caption'] if isinstance(e['caption'], str) else e['caption'][0] for e in entries]


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
    p.add_argument('--from_list', default=None, metavar='JSON',
                   help='time the images and captions of this json list (its first --images entries) '
                        'instead of generated JPEGs')
    p.add_argument('--image_root', default=None,
                   help='where --from_list\'s image paths start (default: the list\'s folder)')
    p.add_argument('--locality', action='store_true',
                   help='also time whole samples (read, decode, transform) from files and from tar shards, '
                        'in sequential and in GRIT order, and the cost of opening a shard')
    p.add_argument('--shard_size', type=int, default=100,
                   help='samples per shard with --locality (default: 100)')
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
    if args.from_list:
        listed_paths, captions = listed_images(args.from_list, args.image_root, args.images)
        vocab = config.vocab_file  # the corpus's own vocabulary
    else:
        vocab = os.path.join(ensure_synthetic(os.path.join(ROOT, 'data', 'synthetic')), 'vocab.txt')
    tokenizer = BertTokenizerFast(vocab_file=vocab)
    best = {'decode': math.inf, 'transform': math.inf, 'tokenise': math.inf}
    with tempfile.TemporaryDirectory() as folder:
        paths = (listed_paths if args.from_list else
                 _write_images(folder, args.images, width, height, args.seed))
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
        **({'from_list': args.from_list, 'image_mean_bytes': round(mean_bytes)} if args.from_list else
           {'jpeg': f'{width}x{height}', 'jpeg_mean_bytes': round(mean_bytes)}), 'images': len(paths),
        'threads_per_worker': 1, 'timing': f'best of {max(1, args.repeats)} passes',
        'images_per_s_per_worker': {'decode': _rate(args.images, best['decode']),
                                    'transform': _rate(args.images, best['transform']),
                                    'tokenise': _rate(args.images, best['tokenise']),
                                    'pipeline': _rate(args.images, total)},
        'share_of_time': {k: round(v / total, 3) for k, v in best.items()},
    }
    if args.locality:
        result['locality'] = locality(args, config, width, height)  # generated JPEGs, also with --from_list
    if args.step_samples_per_s:
        result['step_samples_per_s'] = args.step_samples_per_s
        per_worker = result['images_per_s_per_worker']['pipeline']
        result['workers_needed'] = math.ceil(args.step_samples_per_s / per_worker)
    return emit_record(result, args.output_dir, 'loader_bench')


def grit_order(n: int, seed: int) -> list[int]:
    """A GRIT epoch's order over n examples: GritSampler's second epoch, grouped from random features.
    To storage it is as good as a random permutation: groups follow similarity, not where samples lie."""
    import torch.nn.functional as F

    from grit import GritSampler

    N = 8
    L = max(N, min(n, 480)) // N * N
    sampler = GritSampler(n, num_replicas=1, rank=0, seed=seed, batch_size=N, enabled=True, queue_size=L,
                          search_space=min(L, 120), example_shuffle=True, batch_shuffle=True,
                          mode='concurrent', warmstart_indices=None, shard_grouping=True, dim=16)
    g = torch.Generator().manual_seed(seed)
    features = F.normalize(torch.randn(n, 16, generator=g), dim=-1)
    sampler.set_epoch(0)
    first = list(iter(sampler))
    for k in range(0, len(first), N):
        idx = torch.tensor(first[k:k + N])
        sampler.collect(features[idx], features[idx], idx)
    sampler.end_epoch()
    sampler.set_epoch(1)
    return list(iter(sampler))


def _time_reads(dataset, order: list[int], repeats: int, reopen: bool = False) -> float:
    """Best images/s over `repeats` passes of dataset[i] for i in order (read, decode, transform); reopen:
    a shard dataset closes its open shards before every read, so that every read opens its shard."""
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        for i in order:
            if reopen:
                dataset.reader().cache.clear()  # wids' LRU of open shards
            dataset[i]
        best = min(best, time.perf_counter() - t0)
    return _rate(len(order), best)


def _open_ms(index: str, transform, shards: int) -> float:
    """Mean milliseconds to open and index one shard (wids' memory map and header scan), fresh readers."""
    from dataset.shards import ShardDataset

    ds = ShardDataset(index, transform, lru_size=1)
    sizes = [s['nsamples'] for s in ds.shards][:shards]
    t0 = time.perf_counter()
    for k in range(len(sizes)):
        ds._reader = None
        ds.reader().get_shard(sum(sizes[:k]))
    return round(1000 * (time.perf_counter() - t0) / len(sizes), 3)


def locality(args, config, width: int, height: int) -> dict:
    """Whole samples per second per worker: json list of files against tar shards (with the config's
    shard_lru_size open shards; and opening its shard on every read, as a worker does whose corpus has far
    more shards than it keeps open), each in sequential and in GRIT order; and what opening a shard costs."""
    import json as _json

    from dataset.pretrain import PretrainDataset
    from dataset.shards import ShardDataset
    from tools.make_shards import convert

    transform = train_transform(config.image_res, scale=tuple(config.crop_scale), hflip=config.hflip,
                                randaugment=config.randaugment)
    out = {'shard_size': args.shard_size, 'shard_lru_size': config.shard_lru_size,
           'timing': f'best of {max(1, args.repeats)} passes, one thread, local disk (page cache warm)'}
    with tempfile.TemporaryDirectory() as folder:
        paths = _write_images(folder, args.images, width, height, args.seed)
        listed = os.path.join(folder, 'list.json')
        with open(listed, 'w') as f:
            _json.dump([{'image': os.path.basename(q), 'caption': 'a photo'} for q in paths], f)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            index = convert([listed], folder, os.path.join(folder, 'shards'), args.shard_size)['index']
        orders = {'sequential': list(range(args.images)), 'grit': grit_order(args.images, args.seed)}
        sources = {
            'files': PretrainDataset(listed, transform, folder),
            f'shards_lru{config.shard_lru_size}': ShardDataset(index, transform,
                                                               lru_size=config.shard_lru_size),
        }
        out['images_per_s_per_worker'] = {f'{name}_{order}': _time_reads(ds, orders[order], args.repeats)
                                          for name, ds in sources.items() for order in orders}
        # The order no longer matters when every read opens its shard.
        out['images_per_s_per_worker']['shards_open_every_read'] = _time_reads(
            ShardDataset(index, transform, lru_size=1), orders['grit'], args.repeats, reopen=True)
        out['shards'] = len(ShardDataset(index, transform).shards)
        out['open_ms_per_shard'] = _open_ms(index, transform, out['shards'])
        # Opening cost grows with the members a shard holds (wids scans every tar header): a 10,000-sample
        # shard (img2dataset's default) of 1x1 images measures that scan alone.
        big = os.path.join(folder, 'big')
        tiny = os.path.join(folder, 'tiny.json')
        Image.new('RGB', (1, 1)).save(os.path.join(folder, 'dot.png'))
        with open(tiny, 'w') as f:
            _json.dump([{'image': 'dot.png', 'caption': 'x'}] * 10000, f)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            big_index = convert([tiny], folder, big, 10000)['index']
        out['open_ms_per_10000_sample_shard'] = _open_ms(big_index, transform, 1)
    return out


if __name__ == '__main__':
    run_main(main)
