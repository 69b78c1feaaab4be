"""Phases 1-3 of GRIT: collect features into queues of size L, shuffle, split into sub-queues, group (by
GRIT's greedy chain, or by another batch-construction strategy: grit.strategies).

Queue fills are grouped as soon as they are full; a batch that overflows the queue spills into the next
fill. The only host synchronisation is one validity check per queue fill (finite features, indices in
range) and one per epoch in `finalize`; `add` itself never waits for the device.
"""

from __future__ import annotations

import math

import torch

from . import dist as gdist
from .strategies import Grouping
from .strategies.grit import GreedyChain

__all__ = ["GritCollector", "groups_per_batch"]


class GritCollector:
    """Queues of size L for (image feature, text feature, dataset index, valid) and the growing array G.

    `add` takes batches already gathered from every rank, so every rank holds the same queue and draws
    the same random numbers. shard (default, with torch.distributed initialised): rank r chains only the
    sub-queues r, r+W, r+2W, ... of a fill and the chains are all-gathered (one collective per fill), so
    the grouping work per rank falls as 1/W and every rank still ends up with the same G.
    """

    def __init__(self, queue_size: int, search_space: int, dim: int, dataset_len: int,
                 device: torch.device | str = "cpu", example_shuffle: bool = True,
                 shard: bool = True, index_dtype: torch.dtype = torch.int64,
                 grouping: Grouping | None = None) -> None:
        """grouping: how a sub-queue is ordered into groups (grit.strategies; default GRIT's chain)."""
        self.queue_size = int(queue_size)
        self.search_space = int(search_space)
        self.dim = int(dim)
        self.dataset_len = int(dataset_len)
        self.device = torch.device(device)
        self.example_shuffle = bool(example_shuffle)
        self.shard = bool(shard)
        self.index_dtype = index_dtype  # of G, which grows to the dataset's size over an epoch
        self.generator = torch.Generator()  # CPU: its state is a portable ByteTensor
        self._image: torch.Tensor | None = None  # (L, d) float32, allocated on first use
        self._text: torch.Tensor | None = None
        self._index: torch.Tensor | None = None  # (L,) int64
        self._valid: torch.Tensor | None = None  # (L,) bool
        self.ptr = 0
        self._groups: list[torch.Tensor] = []  # grouped dataset indices, -1 marks an invalid sample
        # Valid entries of every grouped sub-queue, in G's order (device tensors, read at epoch end): each
        # sub-queue's entries are one run of G, so these give how many groups a batch of G draws from.
        self._segments: list[torch.Tensor] = []
        self.segments = torch.zeros(0, dtype=torch.long)  # the last finalized G's, on the CPU
        # GRIT's chain needs no batch size: any N cuts its order into groups.
        self.grouping = grouping if grouping is not None else GreedyChain(batch_size=1)

    def reset(self, seed: int) -> None:
        """Empty the queues and G and re-seed the generator (start of an epoch)."""
        self.generator.manual_seed(int(seed))
        self.ptr = 0
        self._groups = []
        self._segments = []

    def _allocate(self) -> None:
        L, d = self.queue_size, self.dim
        self._image = torch.zeros(L, d, device=self.device)
        self._text = torch.zeros(L, d, device=self.device)
        self._index = torch.full((L,), -1, dtype=torch.long, device=self.device)
        self._valid = torch.zeros(L, dtype=torch.bool, device=self.device)

    @torch.no_grad()
    def add(self, image_feat: torch.Tensor, text_feat: torch.Tensor, index: torch.Tensor,
            valid: torch.Tensor | None = None) -> None:
        """Append a gathered batch: feats (B, d), index (B,), valid (B,) bool | None; group full queues."""
        if self._image is None:
            self._allocate()
        B = image_feat.shape[0]
        image_feat = image_feat.detach().to(self.device, torch.float32)
        text_feat = text_feat.detach().to(self.device, torch.float32)
        index = index.detach().to(self.device, torch.long)
        if valid is None:
            valid = torch.ones(B, dtype=torch.bool, device=self.device)
        else:
            valid = valid.detach().to(self.device, torch.bool)
            # Invalid samples may carry NaNs (e.g. a diverged loss); zero them so grouping stays finite.
            image_feat = torch.where(valid[:, None], image_feat, 0.0)
            text_feat = torch.where(valid[:, None], text_feat, 0.0)
        done = 0
        while done < B:
            k = min(self.queue_size - self.ptr, B - done)
            dst = slice(self.ptr, self.ptr + k)
            self._image[dst] = image_feat[done:done + k]
            self._text[dst] = text_feat[done:done + k]
            self._index[dst] = index[done:done + k]
            self._valid[dst] = valid[done:done + k]
            self.ptr += k
            done += k
            if self.ptr == self.queue_size:
                self._group(self.queue_size)
                self.ptr = 0

    def _check(self, n: int) -> None:
        """One host sync per fill: finite features and in-range indices, else a ValueError naming them."""
        valid = self._valid[:n]
        index = self._index[:n]
        in_range = (index >= 0) & (index < self.dataset_len)
        # A NaN/inf anywhere makes its row sum non-finite; reducing first is cheaper than isfinite(all).
        flags = torch.stack([
            torch.isfinite(self._image[:n].sum(dim=1)).all(), torch.isfinite(self._text[:n].sum(dim=1)).all(),
            (in_range | ~valid).all()]).tolist()
        for ok, name in zip(flags[:2], ("image_feat", "text_feat")):
            if not ok:
                raise ValueError(
                    f"GRIT: {name} passed to collect() contains NaN or inf (found when grouping a queue "
                    "fill); mark such samples with valid=False")
        if not flags[2]:
            bad = index[valid & ~in_range][:5].tolist()
            raise ValueError(
                f"GRIT: index passed to collect() must hold dataset positions in [0, {self.dataset_len}); "
                f"got e.g. {bad}")

    @torch.no_grad()
    def _group(self, n: int) -> None:
        """Phases 2-3 on the first n queue entries: shuffle, split into sub-queues of M, chain, extend G."""
        self._check(n)
        if self.example_shuffle:
            perm = torch.randperm(n, generator=self.generator).to(self.device, non_blocking=True)
        else:
            perm = torch.arange(n, device=self.device)
        M = min(self.search_space, n)
        S = math.ceil(n / M)
        pad = S * M - n  # only the last sub-queue can be short: pad it with invalid entries (position -1)
        pos = torch.cat([perm, perm.new_full((pad,), -1)]).view(S, M)  # queue position of each entry
        valid = (pos >= 0) & self._valid[pos.clamp(min=0)]
        # Every rank draws all sub-queues' random numbers (GRIT: a start key per entry), then orders its own.
        draws = self.grouping.draw(S, M, self.generator)
        order = self._chain(pos, draws, valid)
        grouped = torch.where(valid, self._index[pos.clamp(min=0)], -1).gather(1, order).reshape(-1)
        # Invalid and padding entries are chained last, so the `pad` trailing ones are all padding/invalid.
        self._groups.append(grouped[:n].to(self.index_dtype))
        self._segments.append(valid.sum(dim=1))

    def _features(self, pos: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue positions (k, M) -> image and text features (k, M, d); padding and invalid entries zero."""
        rows = pos.clamp(min=0)
        keep = valid[..., None]
        return (torch.where(keep, self._image[rows], 0.0), torch.where(keep, self._text[rows], 0.0))

    def _chain(self, pos: torch.Tensor, draws: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The grouping's order of every sub-queue (positions (S, M)) -> orders (S, M); sharded over ranks
        when asked, in which case a rank gathers the features of its own sub-queues only."""
        world, rank = gdist.world_info() if self.shard else (1, 0)
        S, M = valid.shape
        if world == 1 or S == 1:
            image, text = self._features(pos, valid)
            return self.grouping.order(image, text, valid, draws)
        mine = torch.arange(rank, S, world, device=pos.device)  # sub-queues r, r+W, ...
        per_rank = math.ceil(S / world)
        order = torch.zeros(per_rank, M, dtype=torch.long, device=pos.device)
        if mine.numel():
            image, text = self._features(pos[mine], valid[mine])
            order[:mine.numel()] = self.grouping.order(image, text, valid[mine], draws[mine.cpu()])
        # (W * per_rank, M) in rank order: row r * per_rank + p is sub-queue p * W + r.
        gathered = gdist.all_gather_cat(order).view(world, per_rank, M)
        return gathered.transpose(0, 1).reshape(world * per_rank, M)[:S]

    def partial_groups(self) -> torch.Tensor:
        """G so far (valid dataset indices of all grouped fills, in grouped order) -> LongTensor on CPU."""
        if not self._groups:
            return torch.empty(0, dtype=self.index_dtype)
        G = torch.cat(self._groups).cpu()
        invalid = G < 0
        return G[~invalid] if bool(invalid.any()) else G

    @torch.no_grad()
    def finalize(self) -> torch.Tensor:
        """Group the partial queue, return G (valid dataset indices in grouped order, CPU) and empty all."""
        if self.ptr > 0:
            self._group(self.ptr)
            self.ptr = 0
        G = self.partial_groups()
        self.segments = self._partial_segments()
        self._groups, self._segments = [], []
        if G.numel():
            # One byte per example, not bincount's eight: D is up to 400M (grit_bench --scale).
            seen = torch.zeros(self.dataset_len, dtype=torch.bool)
            seen[G] = True
            if int(seen.sum()) != G.numel():
                dup = torch.nonzero(torch.bincount(G, minlength=self.dataset_len) > 1).flatten()[:5].tolist()
                raise ValueError(
                    "GRIT: an index passed to collect() occurred more than once in one epoch (e.g. "
                    f"{dup}); index must be the dataset position of the sample (0..{self.dataset_len - 1}), "
                    "not an image or caption id")
        return G

    def state_dict(self) -> dict:
        """Queue contents up to the pointer, the pointer and the generator state (CPU tensors)."""
        n = self.ptr
        empty_f = torch.zeros(0, self.dim)
        return {
            "ptr": n,
            "image": self._image[:n].cpu().clone() if n else empty_f,
            "text": self._text[:n].cpu().clone() if n else empty_f,
            "index": self._index[:n].cpu().clone() if n else torch.zeros(0, dtype=torch.long),
            "valid": self._valid[:n].cpu().clone() if n else torch.zeros(0, dtype=torch.bool),
            "rng": self.generator.get_state(),
            "segments": self._partial_segments(),
        }

    def _partial_segments(self) -> torch.Tensor:
        """The valid counts of the sub-queues grouped so far (CPU LongTensor)."""
        return torch.cat(self._segments).cpu() if self._segments else torch.zeros(0, dtype=torch.long)

    def load_state_dict(self, state: dict, groups: torch.Tensor) -> None:
        """Restore queues, pointer and generator from `state_dict()`; groups: the partial G (LongTensor)."""
        n = int(state["ptr"])
        if not 0 <= n < self.queue_size or state["image"].shape != (n, self.dim):
            raise ValueError(
                f"GRIT sampler state: queue of {n} entries with image shape {tuple(state['image'].shape)} "
                f"does not fit queue_size={self.queue_size}, dim={self.dim}")
        if self._image is None:
            self._allocate()
        self.ptr = n
        if n:
            self._image[:n] = state["image"].to(self.device)
            self._text[:n] = state["text"].to(self.device)
            self._index[:n] = state["index"].to(self.device)
            self._valid[:n] = state["valid"].to(self.device)
        self.generator.set_state(state["rng"].cpu())
        self._groups = [groups.to(self.device, self.index_dtype)] if groups.numel() else []
        # States from before segments were kept: G so far as one run (its batch_groups undercounted).
        segments = state.get("segments", torch.tensor([groups.numel()]) if groups.numel() else None)
        self._segments = [segments.to(self.device)] if segments is not None and segments.numel() else []


def groups_per_batch(segments: torch.Tensor, batch_size: int) -> float | None:
    """Mean number of groups (sub-queues) a batch of N consecutive entries of G draws from: segments (K,)
    the valid entries of each grouped sub-queue in G's order -> 1.0 when every batch lies in one group;
    None when G holds no whole batch. A batch crosses a boundary between two groups unless the boundary
    falls on a multiple of N."""
    lengths = segments[segments > 0].long()
    chunks = int(lengths.sum()) // batch_size
    if chunks == 0:
        return None
    boundaries = torch.cumsum(lengths, 0)[:-1]
    inside = boundaries[(boundaries % batch_size != 0) & (boundaries < chunks * batch_size)]
    return 1.0 + inside.numel() / chunks
