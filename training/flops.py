"""Counting executed FLOPs: torch's FlopCounterMode with the CPU attention kernel added (torch counts the
CUDA attention kernels but not the CPU one; it is added with torch's own formulas, as for flash attention
on CUDA: the backward includes the recomputed scores). Pretrain.py counts online selection's scoring with
it, tools.step_measure the training step."""

from __future__ import annotations

import torch
from torch.utils import flop_counter

__all__ = ["flop_counter_mode"]


def flop_counter_mode() -> flop_counter.FlopCounterMode:
    """A FlopCounterMode (display off) that also counts the CPU scaled-dot-product attention kernels."""
    aten = torch.ops.aten  # FlopCounterMode passes shapes
    cpu_attention = {
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, **kwargs: flop_counter.sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda grad, q, k, v, *args, **kwargs: flop_counter.sdpa_backward_flop_count(grad, q, k, v)}
    return flop_counter.FlopCounterMode(display=False, custom_mapping=cpu_attention)
