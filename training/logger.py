"""Logging: TrainLogger (per-step metrics kept on the device, progress lines, the epoch means over all
ranks) and log.txt (one JSON line per record).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from training.config_files import to_plain
from training.distributed import is_main_process, reduce_sum, stack_values


def _fmt(name: str, value: float) -> str:
    return f'{value:.3e}' if name.startswith('lr') else f'{value:.4f}'


class TrainLogger:
    """Accumulates per-step metrics on device without host syncs; prints every `print_freq` steps.

    Usage: `for batch in log.log_every(loader): ...; log.update(loss_itc=loss, lr=lr)`, then
    `log.epoch_summary()` (collective: every rank calls it, with the same metric names).
    """

    def __init__(self, header: str = '', print_freq: int = 50, enabled: bool | None = None,
                 use_tqdm: bool | None = None, samples_per_step: int = 0,
                 on_log: Callable[[int, dict[str, float]], None] | None = None) -> None:
        """samples_per_step: the global batch (for samples/s); on_log(step, values): called at every
        printed step with the window's metric means and its timing (training.reporting)."""
        self.header = header
        self.print_freq = max(1, int(print_freq))
        self.enabled = is_main_process() if enabled is None else enabled
        self.use_tqdm = (sys.stderr.isatty() if use_tqdm is None else use_tqdm) and self.enabled
        self.samples_per_step = int(samples_per_step)
        self.on_log = on_log
        self._sum: dict[str, Any] = {}   # running sums: 0-dim tensors (device) or floats
        self._count: dict[str, int] = {}
        # The sums and counts at the last printed step (host floats, read then anyway): the window's means
        # are differences, so a step adds nothing for them.
        self._mark: dict[str, tuple[float, int]] = {}
        self._last: dict[str, Any] = {}
        self.step = 0
        self.start_time = time.time()

    def update(self, **metrics: torch.Tensor | float) -> None:
        """Add one value per metric (0-dim tensor kept on device, or a number); no host sync."""
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().float().reshape(())
            else:
                v = float(v)
            self._sum[k] = self._sum[k] + v if k in self._sum else v
            self._count[k] = self._count.get(k, 0) + 1
            self._last[k] = v

    def local_means(self) -> dict[str, float]:
        """This rank's means so far (one host sync)."""
        keys = sorted(self._sum)
        if not keys:
            return {}
        sums = stack_values([self._sum[k] for k in keys]).tolist()
        return {k: s / self._count[k] for k, s in zip(keys, sums)}

    def _line(self) -> tuple[str, dict[str, float]]:
        """The progress line's metrics ('name: last (epoch mean)') and the window's means (one host sync)."""
        keys = sorted(self._last)
        if not keys:
            return '', {}
        vals = stack_values([self._last[k] for k in keys] + [self._sum[k] for k in keys]).tolist()
        n = len(keys)
        window = {}
        for i, k in enumerate(keys):
            mark_sum, mark_count = self._mark.get(k, (0.0, 0))
            if self._count[k] > mark_count:
                window[k] = (vals[n + i] - mark_sum) / (self._count[k] - mark_count)
            self._mark[k] = (vals[n + i], self._count[k])
        line = '  '.join(f'{k}: {_fmt(k, vals[i])} ({_fmt(k, vals[n + i] / self._count[k])})'
                         for i, k in enumerate(keys))
        return line, window

    def log_every(self, iterable: Iterable, total: int | None = None, start: int = 0) -> Iterator:
        """Yield from `iterable`, counting steps and printing (rank 0) a progress line every print_freq."""
        if total is None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        end = None if total is None else start + total
        self.step = start
        bar = None
        if self.use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=end, initial=start, desc=self.header, dynamic_ncols=True, file=sys.stderr)
        width = len(str(end)) if end is not None else 0
        t_window, data_time, iter_time, n_window = time.time(), 0.0, 0.0, 0
        t_end = time.time()
        try:
            for obj in iterable:
                data_time += time.time() - t_end
                yield obj
                self.step += 1
                n_window += 1
                now = time.time()
                iter_time = now - t_window
                t_end = now
                if bar is not None:
                    bar.update(1)
                if self.enabled and (self.step % self.print_freq == 0 or self.step == end):
                    line, window = self._line()
                    rate = self.samples_per_step * n_window / max(iter_time, 1e-9)
                    speed = f'samples/s: {rate:.1f}  ' if self.samples_per_step else ''
                    if bar is not None:
                        bar.set_postfix_str(f'{speed}{line}', refresh=True)
                    else:
                        eta = ''
                        if end is not None:
                            left = (end - self.step) * iter_time / max(n_window, 1)
                            eta = f'eta: {datetime.timedelta(seconds=int(left))}  '
                        of = f'/{end}' if end is not None else ''
                        print(f'{self.header} [{self.step:>{width}}{of}]  {eta}{speed}{line}  '
                              f'time: {iter_time / n_window:.3f}s/it  data: {data_time / n_window:.3f}s/it',
                              flush=True)
                    if self.on_log is not None:
                        self.on_log(self.step, {**window, 'samples_per_s': rate,
                                                'data_wait_share': data_time / max(iter_time, 1e-9)})
                    t_window, data_time, n_window = time.time(), 0.0, 0
                    t_end = t_window
        finally:
            if bar is not None:
                bar.close()

    def epoch_summary(self) -> dict[str, float]:
        """Mean of each metric over all steps of all ranks (collective; one host sync)."""
        keys = sorted(self._sum)
        if not keys:
            return {}
        packed = stack_values([self._sum[k] for k in keys] + [float(self._count[k]) for k in keys])
        packed = reduce_sum(packed).tolist()
        n = len(keys)
        return {k: packed[i] / packed[n + i] for i, k in enumerate(keys)}

    @property
    def elapsed(self) -> float:
        """Seconds since the logger was created."""
        return time.time() - self.start_time


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


# Log names that said GRIT whatever the batching strategy, before they were made neutral: readers of old
# records (tools.runs.read_log, tools.report, the --merge readers) take them as the new ones.
RENAMED_METRICS = {"grit_hardness": "hardness", "grit_hardness_t2i": "hardness_t2i",
                   "grit_seconds": "sampler_seconds", "grit_share": "sampler_share"}


def current_names(record: Mapping) -> dict:
    """A log record or summary row with the names of RENAMED_METRICS replaced by the new ones."""
    return {RENAMED_METRICS.get(k, k): v for k, v in record.items()}


def append_log(output_dir: str | os.PathLike, record: Mapping) -> None:
    """Append `record` as one JSON line to output_dir/log.txt (main process only)."""
    if not is_main_process():
        return
    os.makedirs(str(output_dir), exist_ok=True)
    line = json.dumps(to_plain(dict(record)), default=_json_default)
    with open(os.path.join(str(output_dir), 'log.txt'), 'a', encoding='utf-8') as f:
        f.write(line + '\n')

