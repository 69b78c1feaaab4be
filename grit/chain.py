"""Phase 3 of GRIT: the greedy alternating chain, for many sub-queues at once."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["ChainWorkspace", "greedy_chain"]

_BLOCK = 64  # columns per block of the two-level row argmax in the step loop


class ChainWorkspace:
    """Reusable storage for greedy_chain's two (S, M, M) similarity tables, owned by a caller that groups
    many queue fills of the same size (the collector).

    Why: on CPU a fresh 369 MB table is returned to the OS when freed and page-faulted in again on the
    next fill, which costs about as much as writing it; a GPU's caching allocator already avoids this.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A float32 tensor of `shape` on `device`, reusing (a prefix of) the storage held under `name`."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.device != device or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, device=device)
        return buf[:numel].view(shape)

    def clear(self) -> None:
        """Release the storage."""
        self._buffers.clear()


def _transpose_last2(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous copy of x (S, M, M) transposed in its last two dims -> (S, M, M) (into `out` if given)."""
    if out is None:
        out = torch.empty_like(x)
    if x.device.type != "cpu":
        return out.copy_(x.transpose(1, 2))
    # On CPU a 2-D copy_ from a transposed matrix takes torch's cache-blocked transpose kernel, several
    # times faster than one strided copy of the 3-D tensor. That kernel runs on one core, so the
    # sub-queues are shared among as many threads as torch may use (copy_ releases the GIL).
    workers = max(1, min(torch.get_num_threads(), x.shape[0]))
    inference = torch.is_inference_mode_enabled()  # thread-local: the workers must share the caller's mode

    def copy(first: int) -> None:
        with torch.inference_mode(inference):
            for s in range(first, x.shape[0], workers):
                out[s].copy_(x[s].t())

    if workers == 1:
        copy(0)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(copy, range(workers)))
    return out


def greedy_chain(image_feats: torch.Tensor, text_feats: torch.Tensor, start: torch.Tensor | int,
                 valid: torch.Tensor | None = None, workspace: ChainWorkspace | None = None,
                 rank_skip: int = 0) -> torch.Tensor:
    """Greedy alternating chains: feats (S, M, d) or (M, d), start (S,) -> LongTensor (S, M) or (M,).

    Row s is a permutation of range(M) with p_0 = start[s] and, for i >= 1,
    p_i = argmax_{j not in {p_0..p_{i-1}}} of v_{p_{i-1}} . t_j (i odd, image -> text) or
    t_{p_{i-1}} . v_j (i even, text -> image); ties go to the lowest index.
    `valid` (S, M) bool, optional: invalid positions (padding, invalid samples) are visited only after
    every valid one of their row; `start` should then point at a valid position.
    rank_skip p > 0 (not in the paper; issue 49's remedy, as B3 passes over each example's p most similar
    as likely false negatives): p_i is the (p+1)-th most similar unvisited valid entry instead, or the
    least similar valid one when fewer than p+1 are left; 0 is the paper's chain, computed as before.
    All rows advance together on the features' device; the step loop never synchronises with the host.
    Features must be finite (the caller checks once); similarities are computed in float32 and held as
    two (S, M, M) tables (8*S*M^2 bytes: 737 MB for a queue of 48000 in sub-queues of 1920), kept in
    `workspace` between calls when one is given.
    """
    if image_feats.dim() not in (2, 3) or image_feats.shape != text_feats.shape:
        raise ValueError(
            f"greedy_chain: image_feats {tuple(image_feats.shape)} and text_feats {tuple(text_feats.shape)} "
            "must have the same shape (S, M, d) or (M, d)")
    squeeze = image_feats.dim() == 2
    v = image_feats.unsqueeze(0) if squeeze else image_feats
    t = text_feats.unsqueeze(0) if squeeze else text_feats
    S, M, _ = v.shape
    device = v.device
    start = torch.as_tensor(start, dtype=torch.long, device=device).reshape(-1)
    if start.shape != (S,):
        raise ValueError(f"greedy_chain: start must have shape ({S},), got {tuple(start.shape)}")
    if valid is not None and valid.shape != (S, M):
        raise ValueError(f"greedy_chain: valid must have shape ({S}, {M}), got {tuple(valid.shape)}")
    if isinstance(rank_skip, bool) or not isinstance(rank_skip, int) or rank_skip < 0:
        raise ValueError(f"greedy_chain: rank_skip must be a non-negative integer, got {rank_skip!r}")
    out = torch.empty(S, M, dtype=torch.long, device=device)
    if M > 0:
        with torch.inference_mode():
            _chain_into(out, v.float(), t.float(), start, valid, workspace or ChainWorkspace(), rank_skip)
    return out[0] if squeeze else out


def _chain_into(out: torch.Tensor, v: torch.Tensor, t: torch.Tensor, start: torch.Tensor,
                valid: torch.Tensor | None, workspace: ChainWorkspace, rank_skip: int = 0) -> None:
    """Fill out (S, M) with the chains of v, t (S, M, d) float32 from start (S,)."""
    S, M, _ = v.shape
    device = v.device
    # Step i reads row p_{i-1} of sim (odd i, image -> text) or of sim^T (even i, text -> image);
    # both are made row-contiguous once, so every step is one gather of S rows.
    sim = torch.bmm(v, t.transpose(1, 2), out=workspace.get("sim", (S, M, M), device))
    sim_t = _transpose_last2(sim, out=workspace.get("sim_t", (S, M, M), device))
    tables = (sim_t.view(S * M, M), sim.view(S * M, M))  # indexed by i % 2
    row_offset = torch.arange(S, device=device) * M

    # Additive mask: 0 = unvisited, -inf = visited. Invalid positions get a finite penalty below every
    # reachable similarity (|v.t| <= |v||t|), so they come last but the row stays a permutation.
    mask = torch.zeros(S, M, device=device)
    if valid is not None:
        bound = v.norm(dim=-1).amax(dim=-1) * t.norm(dim=-1).amax(dim=-1)  # (S,)
        penalty = -(2.0 * bound + 1.0)
        mask = torch.where(valid.to(device=device, dtype=torch.bool), mask, penalty[:, None])
    neg_inf = torch.full((S, 1), float("-inf"), device=device)

    # The row argmax is taken in two levels: the maximum of each block of _BLOCK columns (a vectorised
    # reduction), the first block holding the row maximum, then the first maximal column inside it. That
    # is exactly argmax's first-maximum rule, and on CPU about 3x faster than torch.argmax over the row,
    # whose kernel is not vectorised. Rows are padded with -inf to whole blocks.
    nb = -(-M // _BLOCK)
    row = torch.full((S, nb * _BLOCK), float("-inf"), device=device)
    gathered = row if nb * _BLOCK == M else torch.empty(S, M, device=device)
    blocks = row.view(S, nb, _BLOCK)
    block_rows = row.view(S * nb, _BLOCK)
    block_max = torch.empty(S, nb, device=device)
    block_offset = torch.arange(S, device=device) * nb
    flat = torch.empty(S, dtype=torch.long, device=device)

    cur = start.clone()
    steps = [cur]
    mask.scatter_(1, cur[:, None], neg_inf)
    if rank_skip:
        # Valid entries each row has left unvisited: where fewer than p+1 are, the last of them is taken,
        # so that invalid entries still come after every valid one.
        is_valid = (torch.ones(S, M, dtype=torch.long, device=device) if valid is None
                    else valid.to(device=device, dtype=torch.long))
        left = is_valid.sum(dim=1) - is_valid.gather(1, cur[:, None]).squeeze(1)
    # Each CPU step touches only S*M floats: one thread is faster than waking the intra-op pool M times
    # (and far faster when the cores are shared with other work).
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        for i in range(1, M):
            torch.add(cur, row_offset, out=flat)
            torch.index_select(tables[i & 1], 0, flat, out=gathered)
            if gathered is row:
                row.add_(mask)
            else:
                torch.add(gathered, mask, out=row[:, :M])
            if rank_skip:
                k = min(rank_skip + 1, M - i)  # M - i entries are unvisited: the top k are all unvisited
                top = torch.topk(row[:, :M], k, dim=1).indices  # (S, k), most similar first
                pick = (left - 1).clamp(min=0, max=k - 1)  # rank p, or the last valid one left
                cur = top.gather(1, pick[:, None]).squeeze(1)
                left = left - is_valid.gather(1, cur[:, None]).squeeze(1)
                mask.scatter_(1, cur[:, None], neg_inf)
                steps.append(cur)
                continue
            torch.amax(blocks, dim=2, out=block_max)
            block = torch.argmax(block_max, dim=1)  # first block holding the maximum
            torch.add(block, block_offset, out=flat)
            within = torch.argmax(torch.index_select(block_rows, 0, flat), dim=1)
            cur = torch.add(within, block, alpha=_BLOCK)
            mask.scatter_(1, cur[:, None], neg_inf)
            steps.append(cur)
    finally:
        if device.type == "cpu":
            torch.set_num_threads(threads)
    torch.stack(steps, dim=1, out=out)
