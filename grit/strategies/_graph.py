"""What the graph strategies share: the teacher's similarity between the examples of a sub-queue and the
k-nearest-neighbour graph over it (GCBS and the random walk's proximity graph; B3 takes a rank window).

The teacher is the model being trained: its ITC projections from this epoch's steps, as GRIT uses them.
Example i ranks example j by s_ij = v_i . t_j, its image as the query and j's caption as the target (a
retrieval teacher's ranking, as B3's); the graphs built from the ranks are symmetrised, so a neighbour in
either direction is linked.
"""

from __future__ import annotations

import numpy as np
import torch

from . import Grouping

__all__ = ["GraphGrouping", "cross_similarity", "knn_graph", "order_each", "rank_window", "symmetric_csr"]


def cross_similarity(image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """image, text (v, d) of the valid entries of one sub-queue -> s (v, v) float32, s_ij = v_i . t_j,
    the diagonal (each example's own pair) -inf."""
    sim = image.float() @ text.float().T
    sim.fill_diagonal_(float("-inf"))
    return sim


def rank_window(sim: torch.Tensor, skip: int, width: int) -> np.ndarray:
    """Each row's examples ranked skip+1 .. skip+width by similarity -> (v, w) int64 with
    w = min(width, v - 1 - skip) (possibly 0): the top `skip` are passed over. topk, not a full sort:
    only skip + width of the M ranks are needed (exact ties, which continuous features do not produce,
    are broken by topk's own rule)."""
    v = sim.shape[0]
    take = min(skip + width, v - 1)
    if take <= skip:
        return np.zeros((v, 0), dtype=np.int64)
    top = torch.topk(sim, take, dim=1, sorted=True).indices
    return top[:, skip:].cpu().numpy().astype(np.int64)


def knn_graph(sim: torch.Tensor, k: int) -> np.ndarray:
    """Each example's k most similar others -> (v, min(k, v - 1)) int64 (B3's window with skip 0)."""
    return rank_window(sim, 0, k)


def symmetric_csr(neighbours: np.ndarray, v: int):
    """The undirected, unweighted graph of `neighbours` (v, w) -> scipy.sparse.csr_matrix (v, v) with
    sorted indices (an edge i - j when j is among i's neighbours or i among j's)."""
    from scipy.sparse import coo_matrix

    rows = np.repeat(np.arange(v, dtype=np.int64), neighbours.shape[1])
    cols = neighbours.reshape(-1)
    both = np.concatenate([np.stack([rows, cols]), np.stack([cols, rows])], axis=1)
    graph = coo_matrix((np.ones(both.shape[1], dtype=np.int32), (both[0], both[1])), shape=(v, v)).tocsr()
    graph.data[:] = 1  # duplicates (i - j listed both ways) were summed
    graph.sort_indices()
    return graph


def require(package: str, strategy: str):
    """Import `package` for `strategy`, or ImportError naming the pip package and the extra that holds it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        pip = {"scipy": "scipy", "pymetis": "pymetis"}.get(package, package)
        raise ImportError(f"batching.strategy '{strategy}' needs {package}: pip install {pip} (or the "
                          "strategies' extra: pip install 'grit-vlp[strategies]')") from None


def order_each(image: torch.Tensor, text: torch.Tensor, valid: torch.Tensor, seeds: torch.Tensor,
               order_valid) -> torch.Tensor:
    """Apply order_valid(sim (v, v), seed) -> permutation (v,) of range(v) to the valid entries of every
    sub-queue (image, text (S, M, d), valid (S, M), seeds (S,)) -> LongTensor (S, M) on the features'
    device: each row the valid positions in that order, then the invalid ones. A loop over sub-queues
    (at most L / M per queue fill), each on its own M x M similarity: the graph algorithms run on the CPU."""
    S, M = valid.shape
    out = torch.empty(S, M, dtype=torch.long)
    valid_cpu = valid.cpu()
    for s in range(S):
        ids = torch.nonzero(valid_cpu[s]).flatten()
        rest = torch.nonzero(~valid_cpu[s]).flatten()
        if ids.numel() > 1:
            rows = ids.to(image.device)
            sim = cross_similarity(image[s, rows], text[s, rows]).cpu()
            perm = torch.from_numpy(np.asarray(order_valid(sim, int(seeds[s])), dtype=np.int64))
            ids = ids[perm]
        out[s] = torch.cat([ids, rest])
    return out.to(image.device)


class GraphGrouping(Grouping):
    """A strategy that orders each sub-queue's valid examples on its own, from their similarities:
    subclasses write order_one(sim (v, v), seed) -> a permutation (v,) of range(v); draw gives each
    sub-queue a seed (override it for a strategy without randomness)."""

    def draw(self, S: int, M: int, generator: torch.Generator) -> torch.Tensor:
        """A seed per sub-queue for the strategy's own randomness -> (S,)."""
        return torch.randint(0, 2**31 - 1, (S,), generator=generator)

    def order(self, image: torch.Tensor, text: torch.Tensor, valid: torch.Tensor,
              draws: torch.Tensor) -> torch.Tensor:
        """Each sub-queue's valid entries in order_one's order, then its invalid ones (S, M)."""
        return order_each(image, text, valid, draws, self.order_one)

    def order_one(self, sim: torch.Tensor, seed: int) -> np.ndarray:
        """One sub-queue's order of its v valid examples."""
        raise NotImplementedError
