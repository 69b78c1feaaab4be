"""LayerNorm in autocast's compute dtype (config key amp_layer_norm), for the ViT and the BERT layers.

torch's autocast lists layer_norm among its fp32 ops: under bf16 autocast a LayerNorm's output is fp32,
every following Linear casts it back to bf16, and BERT's post-LN residual stream stays fp32 (twice the
memory traffic, a cast per Linear). timm's fast_norm runs the LayerNorm in the autocast dtype instead, as
apex's fused LayerNorm does: input and affine in bf16, mean and variance still accumulated in fp32 inside
the kernel. Without autocast (fp32, fp64) both settings compute exactly F.layer_norm.
"""

from __future__ import annotations

from timm.layers import LayerNorm as TimmLayerNorm
from torch import nn

__all__ = ["AMP_LAYER_NORM", "LayerNorm", "set_amp_layer_norm"]

AMP_LAYER_NORM = ("compute", "float32")


class LayerNorm(TimmLayerNorm):
    """nn.LayerNorm (the same parameters and state-dict keys) that runs in autocast's dtype once switched
    to 'compute' by set_amp_layer_norm; (..., C) -> (..., C)."""

    def __init__(self, num_channels: int, eps: float = 1e-5, **kwargs) -> None:
        super().__init__(num_channels, eps=eps, **kwargs)
        self._fast_norm = False  # torch's default until the config says otherwise


def set_amp_layer_norm(model: nn.Module, mode: str) -> None:
    """Config key amp_layer_norm for every LayerNorm of `model` of this module's (or timm's) class:
    'compute' (the autocast dtype) or 'float32' (torch's autocast default)."""
    if mode not in AMP_LAYER_NORM:
        raise ValueError(f"amp_layer_norm must be one of {AMP_LAYER_NORM}, got {mode!r}")
    for module in model.modules():
        if isinstance(module, TimmLayerNorm):
            module._fast_norm = mode == "compute"
