"""Counting the bad samples a training epoch skipped (dataset.bad_samples), naming the first few,
listing all of them in output_dir/bad_samples_rank{R}.jsonl, and stopping the run when too many of an
epoch's samples are bad (config key max_bad_fraction).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from training.distributed import get_rank, reduce_sum

__all__ = ['BadSampleLog', 'TooManyBadSamples']


class TooManyBadSamples(RuntimeError):
    """More than max_bad_fraction of an epoch's samples were bad."""


class BadSampleLog:
    """Per-epoch count of skipped samples on this rank (host-side: the reasons come with the batch)."""

    def __init__(self, max_bad_fraction: float = 0.01, show: int = 5, output_dir: str | None = None) -> None:
        if not 0.0 <= float(max_bad_fraction) <= 1.0:
            raise ValueError(f"config key 'max_bad_fraction' must be in [0, 1], got {max_bad_fraction}")
        self.max_bad_fraction = float(max_bad_fraction)
        self.show = show
        self.count = 0
        self.epoch = 0  # set by the training loop; written with each listed sample
        # One file per rank: ranks never append to one file at once (not atomic on network filesystems).
        self.path = None if output_dir is None else os.path.join(output_dir,
                                                                 f'bad_samples_rank{get_rank()}.jsonl')

    def start_epoch(self) -> None:
        """Reset the count for a new epoch."""
        self.count = 0

    def record(self, reasons: list[str]) -> None:
        """Count a batch's bad samples, list them in the rank's jsonl file, print the first `show` of the
        epoch on this rank (stderr)."""
        if not reasons:
            return
        for reason in reasons:
            if self.count < self.show:
                print(f'[rank {get_rank()}] skipped bad sample: {reason}', file=sys.stderr, flush=True)
            self.count += 1
        if self.path is not None:
            os.makedirs(os.path.dirname(self.path) or '.', exist_ok=True)
            with open(self.path, 'a', encoding='utf-8') as f:
                f.writelines(json.dumps({'epoch': self.epoch, 'reason': r}) + '\n' for r in reasons)

    def epoch_total(self) -> int:
        """Bad samples of this epoch summed over ranks (a collective: every rank calls it)."""
        return int(reduce_sum(torch.tensor([float(self.count)], dtype=torch.float64)).item())

    def check(self, total: int, samples: int, what: str = 'epoch') -> None:
        """Raise TooManyBadSamples when total bad samples exceed max_bad_fraction of `samples`."""
        if samples > 0 and total > self.max_bad_fraction * samples:
            raise TooManyBadSamples(
                f'{total} of the {samples} samples of this {what} were bad (missing or undecodable images, '
                f'empty or missing texts, unreadable shard samples), more than max_bad_fraction='
                f'{self.max_bad_fraction:g}; the first ones are named above, all of them in '
                'bad_samples_rank*.jsonl. Fix or drop those entries of the json list or shards (or raise '
                'max_bad_fraction).')
