"""Reproducibility: seeds per rank, deterministic kernels, the reseed at checkpoints and on resume
(a resumed run draws the same random numbers as an unbroken one), and DataLoader worker seeds.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (all devices) with seed + rank, as ALBEF; returns the seed used."""
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


def use_deterministic_kernels(enabled: bool) -> None:
    """Config key `deterministic`: torch's deterministic kernels (or not), so a run repeats bitwise.

    Without them, the backward of indexing with repeated indices (CPU index_put with accumulate, as in
    NLVR text assignment's `tokens[first]`) sums in a thread-dependent order: two identical tiny text-
    assignment runs differed by up to 1.5e-4 in a weight. Off by default, as ALBEF: on GPUs the
    deterministic kernels are slower; ops that have none only warn (warn_only).
    """
    # Set both ways: the flag is process-wide, and one process may run several configs (tests).
    torch.use_deterministic_algorithms(bool(enabled), warn_only=True)
    if enabled:
        # cuBLAS repeats its results only with a fixed workspace, read when CUDA's handle is first made;
        # without it torch only warns under warn_only (a user's own setting is kept).
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
        torch.backends.cudnn.benchmark = False


def build_on_every_rank(build: Any, seed: int, rank: int) -> Any:
    """build() under the same seed on every rank (so un-loaded weights agree), then reseed for this rank."""
    seed_everything(seed, 0)
    try:
        return build()
    finally:
        seed_everything(seed, rank)


def reseed(seed: int, rank: int, step: int) -> None:
    """Reseed python, numpy and torch from (seed, rank, step): called at every checkpoint and on resume,
    so a resumed run draws the same random numbers (MLM masks, augmentation, dropout) as an unbroken one."""
    value = (int(seed) * 1_000_003 + int(rank) * 7_919 + int(step)) % (2**31 - 1)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def rng_state() -> dict:
    """This process's python, numpy and torch (CPU and initialised CUDA) generator states, in types that
    torch.load(weights_only=True) reads back."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    return {'python': random.getstate(), 'numpy': numpy_state, 'torch': torch.get_rng_state(), 'cuda': cuda}


def set_rng_state(state: Mapping) -> None:
    """Restore generator states saved by rng_state()."""
    random.setstate(tuple(s if not isinstance(s, list) else tuple(s) for s in state['python']))
    name, keys, pos, has_gauss, cached = state['numpy']
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state['torch'])
    if state['cuda'] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


def worker_init_fn(worker_id: int) -> None:
    """Seed python and numpy in a DataLoader worker from its torch seed (base seed + worker id)."""
    s = torch.initial_seed() % 2**32
    np.random.seed(s)
    random.seed(s)


def make_generator(seed: int) -> torch.Generator:
    """CPU torch.Generator for a DataLoader, so worker base seeds follow `seed`."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g
