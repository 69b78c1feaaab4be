"""GRIT-VLP's grouping (paper Sec. 3.1, phase 3): the greedy alternating chain of each sub-queue, started at
a random valid entry (grit.chain.greedy_chain)."""

from __future__ import annotations

import torch

from ..chain import ChainWorkspace, greedy_chain
from . import Grouping


class GreedyChain(Grouping):
    """p_0 a uniformly random valid entry; p_i the most similar unvisited entry to p_{i-1}, alternating
    image -> text and text -> image; invalid entries last. rank_skip p > 0 (not in the paper): the
    (p+1)-th most similar instead (grit.chain.greedy_chain)."""

    name = "grit"

    def __init__(self, batch_size: int, rank_skip: int = 0) -> None:
        super().__init__(batch_size)
        self.rank_skip = int(rank_skip)
        # On CPU the similarity tables are kept between fills: freeing them means page-faulting them in
        # again next fill; on a GPU the caching allocator reuses the memory and training may use it.
        self._workspace = ChainWorkspace()

    def draw(self, S: int, M: int, generator: torch.Generator) -> torch.Tensor:
        """One uniform key per entry: the start is the valid entry with the largest key -> (S, M)."""
        return torch.rand(S, M, generator=generator)

    def order(self, image: torch.Tensor, text: torch.Tensor, valid: torch.Tensor,
              draws: torch.Tensor) -> torch.Tensor:
        """The chains (S, M) from each row's random valid start."""
        keys = draws.to(image.device, non_blocking=True)
        start = torch.where(valid, keys, -1.0).argmax(dim=1)
        workspace = self._workspace if image.device.type == "cpu" else None
        return greedy_chain(image, text, start, valid=valid, workspace=workspace, rank_skip=self.rank_skip)

    def describe(self) -> str:
        skip = f", skipping the {self.rank_skip} most similar" if self.rank_skip else ""
        return f"GRIT's greedy alternating chain{skip}"


GROUPING = GreedyChain
