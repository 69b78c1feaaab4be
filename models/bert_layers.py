"""The layers of the compact BERT (models/bert.py): embeddings, self- and cross-attention,
feed-forward, the layer that chains them, and the MLM head.

Module and attribute names follow transformers' BertForMaskedLM, so that the state-dict keys
(`bert.embeddings...`, `bert.encoder.layer.N...`, `cls.predictions...`) load BERT and ALBEF / GRIT-VLP
checkpoints without key surgery. Attention runs through torch.nn.functional.scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig

__all__ = ["BertBackbone", "BertLayer", "BertLMPredictionHead", "BertOnlyMLMHead"]

class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids (B,L) -> (B,L,H); token type 0 everywhere, positions 0..L-1."""
        length = input_ids.shape[1]
        # Slicing the weights avoids building position / token-type id tensors.
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings.weight[:length]
            + self.token_type_embeddings.weight[0]
        )
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Multi-head attention projections; keys/values may come from another width (cross-attention)."""

    def __init__(self, config: BertConfig, kv_width: int):
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"bert config: hidden_size={config.hidden_size} is not a multiple of "
                f"num_attention_heads={config.num_attention_heads}"
            )
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.dropout_p = config.attention_probs_dropout_prob
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(kv_width, config.hidden_size)
        self.value = nn.Linear(kv_width, config.hidden_size)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        """x (B,L,H), context (B,N,Dk), mask bool broadcastable to (B,heads,L,N) -> (B,L,H)."""
        out = F.scaled_dot_product_attention(
            self._heads(self.query(x)),
            self._heads(self.key(context)),
            self._heads(self.value(context)),
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return out.transpose(1, 2).flatten(2)


class BertSelfOutput(nn.Module):
    """Output projection + dropout + residual LayerNorm (also used after the feed-forward)."""

    def __init__(self, config: BertConfig, in_width: int):
        super().__init__()
        self.dense = nn.Linear(in_width, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """x (B,L,in_width), residual (B,L,H) -> (B,L,H)."""
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    """Attention block: `.self` (q, k, v) and `.output` (dense, LayerNorm), as named by transformers."""

    def __init__(self, config: BertConfig, kv_width: int):
        super().__init__()
        self.self = BertSelfAttention(config, kv_width)
        self.output = BertSelfOutput(config, config.hidden_size)

    def forward(self, x: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        """x (B,L,H), context (B,N,Dk) -> (B,L,H)."""
        return self.output(self.self(x, context, mask), x)


class BertIntermediate(nn.Module):
    """Feed-forward expansion with the activation named in the config."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _activation(config.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        """(B,L,H) -> (B,L,I)."""
        return self.act(self.dense(x))


def _activation(name: str) -> nn.Module:
    # transformers' 'gelu' is the exact (erf) GELU; 'gelu_new' is the tanh approximation.
    table = {
        "gelu": lambda: nn.GELU(),
        "gelu_new": lambda: nn.GELU(approximate="tanh"),
        "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
        "relu": lambda: nn.ReLU(),
        "silu": lambda: nn.SiLU(),
    }
    if name not in table:
        raise ValueError(f"bert config: unsupported hidden_act {name!r} (one of {sorted(table)})")
    return table[name]()


class BertLayer(nn.Module):
    """Self-attention, optional cross-attention to the image tokens, feed-forward."""

    def __init__(self, config: BertConfig, has_cross: bool):
        super().__init__()
        self.attention = BertAttention(config, config.hidden_size)
        if has_cross:
            self.crossattention = BertAttention(config, config.encoder_width)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, config.intermediate_size)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
    ) -> Tensor:
        """x (B,L,H), context (B,N,Dv) or None -> (B,L,H)."""
        x = self.attention(x, x, mask)
        if context is not None:
            x = self.crossattention(x, context, context_mask)
        return self.output(self.intermediate(x), x)


class BertEncoderLayers(nn.Module):
    """Holds `layer` so that parameter names read `bert.encoder.layer.N...`."""

    def __init__(self, config: BertConfig, cross_from: int):
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(config, has_cross=i >= cross_from) for i in range(config.num_hidden_layers)
        )


class BertBackbone(nn.Module):
    """`bert`: embeddings and encoder layers (no pooler)."""

    def __init__(self, config: BertConfig, cross_from: int):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoderLayers(config, cross_from)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = _activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        # Shared as in transformers / ALBEF: the state dict holds both decoder.bias and bias.
        self.decoder.bias = self.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.transform(x))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
