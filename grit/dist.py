"""Tiny no-grad torch.distributed helpers for GRIT: gather a batch, compare an index array across ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["is_distributed", "world_info", "all_gather_cat", "index_checksum", "assert_same_on_all_ranks"]

_HASH_PRIME = 2_147_483_647  # 2**31 - 1: every product below stays inside int64


def is_distributed() -> bool:
    """True when a torch.distributed process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def world_info() -> tuple[int, int]:
    """(world_size, rank) of the default group, (1, 0) when not distributed."""
    if is_distributed():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@torch.no_grad()
def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenate x (B, ...) from every rank in rank order -> (W*B, ...); identity when not distributed.

    All ranks must pass the same shape. No gradient flows (GRIT only stores detached features).
    """
    world, _ = world_info()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=0)


@torch.no_grad()
def index_checksum(indices: torch.Tensor) -> torch.Tensor:
    """Order-sensitive checksum of a 1-D integer array -> int64 tensor (3,): length, sum, weighted hash."""
    x = indices.reshape(-1).long()
    pos = torch.arange(x.numel(), device=x.device, dtype=torch.long)
    weight = (pos * 48_271) % _HASH_PRIME + 1
    hashed = ((x % _HASH_PRIME) * weight % _HASH_PRIME).sum()
    length = torch.tensor(x.numel(), device=x.device, dtype=torch.long)
    return torch.stack([length, x.sum(), hashed])


@torch.no_grad()
def assert_same_on_all_ranks(indices: torch.Tensor, what: str,
                             device: torch.device | str | None = None) -> None:
    """Raise RuntimeError unless every rank holds the same 1-D index array (one all_reduce pair, one sync).

    device: where the collective runs (must suit the backend: CUDA for NCCL); default: indices' device.
    """
    if world_info()[0] == 1:
        return
    local = index_checksum(indices).to(device if device is not None else indices.device)
    hi, lo = local.clone(), local.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    if not torch.equal(hi, lo):
        raise RuntimeError(
            f"GRIT: {what} differs between ranks (checksum [length, sum, hash] on rank "
            f"{dist.get_rank()}: {local.tolist()}, max over ranks {hi.tolist()}, min {lo.tolist()}). "
            "Every rank must call collect() with the same number of batches and all ranks must load the same "
            "sampler state.")
