"""How an epoch's global index array is formed (phase 4): from the grouped order G of the last epoch
(unseen indices first, cut into per-rank batches, chunks dropped to whole global batches and shuffled), or,
for an epoch that is not grouped, DistributedSampler's permutation; and the random streams behind them.
Pure functions of their arguments, so that every rank forms the same array."""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["STREAM_COLLECT", "STREAM_COMPOSE", "STREAM_NAIVE", "as_ints", "compose_epoch", "plain_order",
           "stream_seed"]

# Independent random streams derived from (seed, epoch): example shuffle + chain starts, composition of
# the epoch (unseen order, dropped chunks, chunk order), and the naive mode's fresh permutation.
STREAM_COLLECT, STREAM_COMPOSE, STREAM_NAIVE = 1, 2, 3


def stream_seed(seed: int, epoch: int, stream: int) -> int:
    """A generator seed for (seed, epoch, stream), distinct from DistributedSampler's seed + epoch."""
    return (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB
            + 0x2545F4914F6CDD1D) % (2**63 - 1)


def as_ints(indices: torch.Tensor, chunk: int = 1 << 16) -> Iterator[int]:
    """The indices (n,) as Python ints, converted a chunk at a time: a rank's share of a 400M-example
    epoch as one Python list would take gigabytes."""
    for part in indices.split(chunk):
        yield from part.tolist()


def plain_order(dataset_len: int, length: int, seed: int, epoch: int, shuffle: bool,
                dtype: torch.dtype) -> torch.Tensor:
    """DistributedSampler's order (randperm seeded by seed + epoch; arange without shuffle) cut to
    `length` (whole global batches) -> (length,) of `dtype`."""
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=g)
    else:
        order = torch.arange(dataset_len)
    return order[:length].to(dtype)


def compose_epoch(G: torch.Tensor, dataset_len: int, batch_size: int, chunks_kept: int, batch_shuffle: bool,
                  seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Epoch array from the grouped order G (<= D,): the D - |G| unseen indices first (shuffled), then G, cut
    into chunks of N = batch_size; all but `chunks_kept` (T x W) chunks dropped, among chunks of G only
    where possible, the kept ones shuffled with batch_shuffle -> (chunks_kept * N,) of `dtype`. `seed`
    seeds the one generator (the epoch's compose stream)."""
    gen = torch.Generator().manual_seed(seed)
    D, N = dataset_len, batch_size
    # D-sized arrays stay in index_dtype (int32 below 2**31 examples): at web scale the transient int64
    # copies were most of the epoch end's memory (tools.grit_bench --scale, docs/speed-and-scale.md).
    G = G.cpu().to(dtype)
    seen = torch.zeros(D, dtype=torch.bool)
    seen[G] = True
    unseen = torch.nonzero(~seen).flatten()
    del seen
    unseen = unseen[torch.randperm(unseen.numel(), generator=gen)].to(dtype)
    # Unseen indices go first, so the D % N tail left over after cutting chunks comes from G and
    # the dropped chunks can be drawn among chunks made of G only: whenever fewer than B indices
    # were unseen, all of them are used this epoch and the left-out ones were seen last epoch.
    # The last k indices of G fill up the unseen ones' last chunk, so that G's chunks keep starting at
    # multiples of N from G's start and line up with its sub-queues (when N divides M and L).
    k = min((-unseen.numel()) % N, G.numel())
    head = torch.cat([unseen, G[G.numel() - k:]])
    full = torch.cat([head, G[:G.numel() - k]])  # every dataset index exactly once
    C = D // N
    chunks = full[:C * N].view(C, N)
    n_drop = C - chunks_kept
    first_pure = -(-head.numel() // N)  # first chunk holding no unseen index
    drop_from = first_pure if C - first_pure >= n_drop else 0
    drop = drop_from + torch.randperm(C - drop_from, generator=gen)[:n_drop]
    kept = torch.ones(C, dtype=torch.bool)
    kept[drop] = False
    kept = torch.nonzero(kept).flatten()
    if batch_shuffle:
        kept = kept[torch.randperm(kept.numel(), generator=gen)]
    return chunks[kept].reshape(-1)
