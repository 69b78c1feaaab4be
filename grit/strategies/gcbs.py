"""GCBS-style grouping (Global Contrastive Batch Sampling, arXiv 2210.12874), written from the paper's
description: order the examples so that similar ones sit together, by a bandwidth-minimising permutation
of their nearest-neighbour graph (reverse Cuthill-McKee), then cut the order into batches.

Where it departs from the paper (docs/batch-construction.md): the paper orders the whole dataset once per
epoch; here each sub-queue of M of the collected queue is ordered, as GRIT's search is bounded (a D-node
graph of the whole dataset would need its D x D similarities), with our model's ITC projections from the
epoch being trained as the features (grit.strategies.graph).
"""

from __future__ import annotations

import numpy as np
import torch

from ._graph import GraphGrouping, knn_graph, require, symmetric_csr


class GCBSGrouping(GraphGrouping):
    """Reverse Cuthill-McKee order of each sub-queue's k-nearest-neighbour graph."""

    name = "gcbs"

    def __init__(self, batch_size: int, neighbours: int = 10) -> None:
        super().__init__(batch_size)
        if neighbours < 1:
            raise ValueError(f"batching.gcbs.neighbours must be >= 1, got {neighbours}")
        self.k = int(neighbours)
        self.csgraph = require("scipy.sparse.csgraph", "gcbs")

    def draw(self, S: int, M: int, generator: torch.Generator) -> torch.Tensor:
        """Nothing random: the order follows from the graph (S, 0)."""
        return torch.zeros(S, dtype=torch.long)

    def order_one(self, sim: torch.Tensor, seed: int) -> np.ndarray:
        """A sub-queue's examples in reverse Cuthill-McKee order of their k-NN graph (no seed used)."""
        graph = symmetric_csr(knn_graph(sim, self.k), sim.shape[0])
        return np.asarray(self.csgraph.reverse_cuthill_mckee(graph, symmetric_mode=True), dtype=np.int64)

    def describe(self) -> str:
        return f"GCBS order (reverse Cuthill-McKee) of each example's {self.k} nearest neighbours"


GROUPING = GCBSGrouping
