"""BatchSampler-style grouping (BatchSampler, KDD 2023, arXiv 2306.03355), written from the paper: a
proximity graph of the examples (each linked to its k most similar), and each batch collected by a random
walk with restart from a random start: at every step the walker returns to the start with probability
`restart`, else moves to a random neighbour, and every example it reaches that no batch holds yet joins
this batch, until the batch has N. Hard negatives (neighbours of neighbours) that are rarely false ones
(the walk spreads beyond the nearest).

Where it departs from the paper (docs/batch-construction.md): the graph is built inside each sub-queue
of M of the collected queue (the paper also links each example to its top k among M random candidates)
from our model's ITC projections of the epoch being trained; an example never joins two batches of an
epoch; and a walk that finds no new example for 20 N steps (its part of the graph used up) completes its
batch with the unused examples most similar to its start.
"""

from __future__ import annotations

import numpy as np
import torch

from ._graph import GraphGrouping, knn_graph


class RandomWalkGrouping(GraphGrouping):
    """Random walks with restart on each sub-queue's k-nearest-neighbour graph, one batch per walk."""

    name = "rwr"

    def __init__(self, batch_size: int, neighbours: int = 10, restart: float = 0.1) -> None:
        super().__init__(batch_size)
        if neighbours < 1 or not 0.0 <= restart < 1.0:
            raise ValueError(f"batching.rwr: neighbours must be >= 1 and 0 <= restart < 1, got {neighbours}, "
                             f"{restart}")
        self.k, self.restart = int(neighbours), float(restart)

    def order_one(self, sim: torch.Tensor, seed: int) -> np.ndarray:
        """A sub-queue's examples batch by batch, in the order the walks (seeded by `seed`) reached them."""
        v, N = sim.shape[0], self.batch_size
        nb = knn_graph(sim, self.k)
        k = nb.shape[1]
        rng = np.random.default_rng(seed)
        used = np.zeros(v, dtype=bool)
        order = np.empty(v, dtype=np.int64)
        filled = 0
        patience = 20 * N
        # Random numbers drawn in blocks: one generator call per block, not per step.
        coins, picks, at = rng.random(4096), rng.integers(0, max(k, 1), 4096), 0
        while filled < v:
            unused = np.flatnonzero(~used)
            start = unused[rng.integers(unused.size)]
            used[start] = True
            order[filled] = start
            filled += 1
            need = min(N - 1, v - filled)
            cur, idle = start, 0
            while need and idle < patience and k:
                if at == coins.size:
                    coins, picks, at = rng.random(4096), rng.integers(0, k, 4096), 0
                cur = start if coins[at] < self.restart else nb[cur, picks[at]]
                at += 1
                if used[cur]:
                    idle += 1
                    continue
                used[cur] = True
                order[filled] = cur
                filled += 1
                need -= 1
                idle = 0
            if need:  # the walk's part of the graph is used up: the unused nearest to the start
                rest = np.flatnonzero(~used)
                near = rest[np.argsort(-sim[start, rest].numpy(), kind="stable")[:need]]
                used[near] = True
                order[filled:filled + near.size] = near
                filled += near.size
        return order

    def describe(self) -> str:
        return f"random walks with restart {self.restart:g} on each example's {self.k} nearest neighbours"


GROUPING = RandomWalkGrouping
