"""B3-style grouping (Breaking the Batch Barrier, arXiv 2505.11293), written from the paper's description.

A teacher ranks the examples against each other; each example is linked to those it ranks p + 1 .. p + m
(the top p are passed over as likely false negatives: near-duplicates, other captions of the same scene);
the graph is partitioned by METIS into communities of the batch size, and each community is one batch.

Where it departs from the paper (docs/batch-construction.md): the teacher is our own model's ITC
projections from the epoch being trained (grit.strategies.graph), not a separately trained embedding
model; and the ranking and the partition run inside each sub-queue of M of the collected queue, as GRIT's
search does, not over the whole dataset (a D x D ranking is out of reach at 100 M examples). METIS is
asked for ceil(v / N) parts; its parts are then made exactly N (one of v mod N when N does not divide the
v valid entries) by moving the entries least linked to their own part to the parts most linked to them.
Without pymetis, the parts are cut from the graph's reverse Cuthill-McKee order instead, with a warning.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ._graph import GraphGrouping, rank_window, require, symmetric_csr

_warned = False


def exact_parts(member: np.ndarray, graph, batch_size: int) -> np.ndarray:
    """Part labels (v,) made exactly balanced: parts 0 .. q-1 of batch_size and, if v mod batch_size, a
    last one of that size; returns labels in 0 .. ceil(v / batch_size) - 1, ordered by part size (largest
    first) so that the short part is the last label."""
    from scipy.sparse import csr_matrix

    v = member.shape[0]
    P = -(-v // batch_size)
    sizes = np.bincount(member, minlength=P)[:P] if member.size else np.zeros(P, dtype=np.int64)
    relabel = np.empty(P, dtype=np.int64)
    relabel[np.argsort(-sizes, kind="stable")] = np.arange(P)
    member = relabel[np.minimum(member, P - 1)]
    target = np.full(P, batch_size, dtype=np.int64)
    if v % batch_size:
        target[-1] = v % batch_size
    onehot = csr_matrix((np.ones(v), (np.arange(v), member)), shape=(v, P))
    links = np.asarray((graph @ onehot).todense())  # (v, P): edges from each entry into each part
    pool = []
    for q in range(P):
        nodes = np.flatnonzero(member == q)
        excess = nodes.size - target[q]
        if excess > 0:  # release the entries least linked to their own part
            pool.append(nodes[np.argsort(links[nodes, q], kind="stable")[:excess]])
    if pool:
        pool = np.concatenate(pool)
        member[pool] = -1
        room = target - np.bincount(member[member >= 0], minlength=P)
        for _ in range(pool.size):  # each released entry to the open part it is most linked to
            score = np.where(room[None, :] > 0, links[pool], -1)
            i, q = np.unravel_index(np.argmax(score), score.shape)
            member[pool[i]] = q
            room[q] -= 1
            pool = np.delete(pool, i)
    return member


class B3Grouping(GraphGrouping):
    """Rank window [rank_skip + 1, rank_skip + rank_window] of every example, METIS communities of N."""

    name = "b3"

    def __init__(self, batch_size: int, rank_skip: int = 10, rank_window: int = 30,
                 recursive: bool = True) -> None:
        super().__init__(batch_size)
        if rank_skip < 0 or rank_window < 1:
            raise ValueError(f"batching.b3: rank_skip must be >= 0 and rank_window >= 1, got {rank_skip}, "
                             f"{rank_window}")
        self.skip, self.width = int(rank_skip), int(rank_window)
        # METIS's recursive bisection: about 2.5x faster than its k-way partition on a sub-queue of the
        # paper's size, for ~2 % more edges cut (tools.strategy_bench; docs/batch-construction.md).
        self.recursive = bool(recursive)
        require("scipy", "b3")
        try:
            self.metis = require("pymetis", "b3")
        except ImportError as e:
            global _warned
            if not _warned:
                warnings.warn(f"{e}; until then B3 cuts its communities from the graph's reverse "
                              "Cuthill-McKee order instead of METIS's partition", stacklevel=2)
                _warned = True
            self.metis = None

    def order_one(self, sim: torch.Tensor, seed: int) -> np.ndarray:
        """A sub-queue's examples community by community (seed: METIS's), the short community last."""
        return np.argsort(self.communities(sim, seed), kind="stable")

    def communities(self, sim: torch.Tensor, seed: int) -> np.ndarray:
        """Community labels (v,) of the examples of one sub-queue (similarities sim (v, v)): exactly
        batch_size each, but the last, of v mod batch_size when that is not 0."""
        v, N = sim.shape[0], self.batch_size
        graph = symmetric_csr(rank_window(sim, self.skip, self.width), v)
        parts = -(-v // N)
        if parts == 1:
            member = np.zeros(v, dtype=np.int64)
        elif self.metis is not None and graph.nnz:
            options = self.metis.Options(seed=seed)
            starts, adjacent = graph.indptr.astype(np.int64), graph.indices.astype(np.int64)
            if hasattr(self.metis, "CSRAdjacency"):  # pymetis >= 2025.2; xadj/adjncy are deprecated there
                adjacency = self.metis.CSRAdjacency(adj_starts=starts, adjacent=adjacent)
                _, member = self.metis.part_graph(parts, adjacency=adjacency, options=options,
                                                  recursive=self.recursive)
            else:
                _, member = self.metis.part_graph(parts, xadj=starts, adjncy=adjacent, options=options,
                                                  recursive=self.recursive)
            member = np.asarray(member, dtype=np.int64)
        else:
            from scipy.sparse.csgraph import reverse_cuthill_mckee

            member = np.empty(v, dtype=np.int64)
            member[reverse_cuthill_mckee(graph, symmetric_mode=True)] = np.arange(v) // N
        return exact_parts(member, graph, N)

    def describe(self) -> str:
        how = ("reverse Cuthill-McKee (pymetis missing)" if self.metis is None else
               "METIS recursive bisection" if self.recursive else "METIS k-way")
        return f"B3 communities ({how}) of each example's ranks {self.skip + 1}-{self.skip + self.width}"


GROUPING = B3Grouping
