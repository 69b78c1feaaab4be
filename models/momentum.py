"""Momentum (EMA) copies of encoders and the feature queues used by retrieval fine-tuning.

One implementation for every task model (ALBEF repeats both in each model file). The paper's
pre-training uses neither; retrieval fine-tuning follows ALBEF (momentum 0.995, queue 65,280).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.objectives import concat_all_gather

__all__ = ["FeatureQueue", "MomentumPairs"]


class MomentumPairs:
    """EMA bookkeeping for (model, model_m) pairs: model_m <- m * model_m + (1 - m) * model.

    Only parameters are tracked (ViT and BERT have no running buffers). The momentum parameters
    get requires_grad=False. The class holds references, not modules, so it adds nothing to the
    owner's state_dict; the lists are rebuilt per call, which keeps them valid after .to(device).
    """

    def __init__(self, model_pairs: Iterable[tuple[nn.Module, nn.Module]]) -> None:
        """Register the pairs (no copy; see build / copy_)."""
        self.model_pairs = list(model_pairs)
        _, momentum = self._params()
        for p in momentum:
            p.requires_grad_(False)
        for (name, p), q in zip(self._named_online(), momentum):
            if p.shape != q.shape:
                raise ValueError(
                    f"MomentumPairs: parameter {name} has shape {tuple(p.shape)} online but "
                    f"{tuple(q.shape)} in the momentum copy"
                )

    @classmethod
    def build(cls, model_pairs: Iterable[tuple[nn.Module, nn.Module]]) -> MomentumPairs:
        """Register the pairs and copy every online parameter into its momentum twin."""
        pairs = cls(model_pairs)
        pairs.copy_()
        return pairs

    def _named_online(self) -> list[tuple[str, Tensor]]:
        return [(n, p) for model, _ in self.model_pairs for n, p in model.named_parameters()]

    def _params(self) -> tuple[list[Tensor], list[Tensor]]:
        online = [p for model, _ in self.model_pairs for p in model.parameters()]
        momentum = [p for _, model_m in self.model_pairs for p in model_m.parameters()]
        if len(online) != len(momentum):
            raise ValueError(
                f"MomentumPairs: the online models have {len(online)} parameters but the momentum "
                f"copies have {len(momentum)}; each pair must share one architecture"
            )
        return online, momentum

    @torch.no_grad()
    def copy_(self) -> None:
        """model_m <- model (e.g. at init, or after loading a checkpoint without momentum weights)."""
        online, momentum = self._params()
        torch._foreach_copy_(momentum, online)

    @torch.no_grad()
    def update(self, m: float) -> None:
        """One EMA step: p_m = m * p_m + (1 - m) * p, fused over all tensors."""
        online, momentum = self._params()
        torch._foreach_mul_(momentum, m)
        torch._foreach_add_(momentum, online, alpha=1.0 - m)


class FeatureQueue(nn.Module):
    """MoCo/ALBEF queues of past features: image_queue, text_queue (dim, K), idx_queue (1, K).

    Starts with random unit columns (ALBEF) and idx -100, an id no real image has, so the initial
    columns are never positives. queue_ptr (1,) is the next column to write. It stays on the
    device: enqueue writes the columns (ptr + arange(n)) % K with one index_copy_, so a batch that
    runs past the end wraps to the front (K need not be a multiple of B*W, unlike ALBEF's assert)
    and the step needs no host sync. All buffers are saved in the owner's state_dict.
    """

    image_queue: Tensor
    text_queue: Tensor
    idx_queue: Tensor
    queue_ptr: Tensor

    def __init__(self, dim: int, size: int) -> None:
        """Random unit features in (dim, size) queues, idx -100, pointer 0."""
        super().__init__()
        if dim <= 0 or size <= 0:
            raise ValueError(f"FeatureQueue: dim and size (queue_size) must be positive, got {dim}, {size}")
        self.register_buffer("image_queue", F.normalize(torch.randn(dim, size), dim=0))
        self.register_buffer("text_queue", F.normalize(torch.randn(dim, size), dim=0))
        self.register_buffer("idx_queue", torch.full((1, size), -100, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @property
    def size(self) -> int:
        """K, the number of queued columns."""
        return self.image_queue.shape[1]

    @torch.no_grad()
    def enqueue(self, image_feat: Tensor, text_feat: Tensor, idx: Tensor) -> None:
        """Append all ranks' (B, d) features and (B,) image ids; the oldest columns are overwritten."""
        if image_feat.shape != text_feat.shape or image_feat.shape[1:] != self.image_queue.shape[:1]:
            raise ValueError(
                f"FeatureQueue.enqueue: features must both be (B, {self.image_queue.shape[0]}), got "
                f"{tuple(image_feat.shape)} and {tuple(text_feat.shape)}"
            )
        if idx.shape != image_feat.shape[:1]:
            raise ValueError(
                f"FeatureQueue.enqueue: idx must be ({image_feat.shape[0]},), got {tuple(idx.shape)}"
            )
        image_all = concat_all_gather(image_feat)
        text_all = concat_all_gather(text_feat)
        idx_all = concat_all_gather(idx)
        n, k = image_all.shape[0], self.size
        if n > k:
            raise ValueError(
                f"FeatureQueue.enqueue: {n} gathered rows (batch x world size) exceed queue_size {k}"
            )
        cols = (self.queue_ptr + torch.arange(n, device=self.queue_ptr.device)) % k
        self.image_queue.index_copy_(1, cols, image_all.t().to(self.image_queue.dtype))
        self.text_queue.index_copy_(1, cols, text_all.t().to(self.text_queue.dtype))
        self.idx_queue.index_copy_(1, cols, idx_all.view(1, n).to(self.idx_queue.dtype))
        self.queue_ptr.add_(n).remainder_(k)

    @torch.no_grad()
    def bank(self, image_feat: Tensor, text_feat: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Batch (B, d) + queue -> image_bank, text_bank (B+K, d) and positive (B, B+K) bool by image id.

        The inputs are usually the momentum features; the result feeds itc_loss(image_bank=...,
        text_bank=..., positive=...). Call before enqueue(), as ALBEF does.
        """
        image_bank = torch.cat([image_feat, self.image_queue.t().to(image_feat.dtype)], dim=0)
        text_bank = torch.cat([text_feat, self.text_queue.t().to(text_feat.dtype)], dim=0)
        idx = idx.view(-1, 1)
        idx_all = torch.cat([idx.t(), self.idx_queue.to(idx.dtype)], dim=1)
        return image_bank, text_bank, idx == idx_all
