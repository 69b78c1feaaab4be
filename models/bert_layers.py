"""The layers of the compact BERT (models/bert.py): embeddings, self- and cross-attention,
feed-forward, the layer that chains them, and the MLM head.

Module and attribute names follow transformers' BertForMaskedLM, so that the state-dict keys
(`bert.embeddings...`, `bert.encoder.layer.N...`, `cls.predictions...`) load BERT and ALBEF / GRIT-VLP
checkpoints without key surgery. Attention runs through torch.nn.functional.scaled_dot_product_attention.

Two speed-ups keep those keys (config keys fused_qkv and amp_layer_norm, docs/speed-and-scale.md): the
query/key/value Linears are applied as one product over their concatenated weights, and the LayerNorms
are models.layer_norm's, which under autocast can run in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig

from models.layer_norm import LayerNorm

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
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
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
    """Multi-head attention projections; keys/values may come from another width (cross-attention).

    fused (config key fused_qkv): query, key and value (or, for cross-attention, key and value) are one
    product with the concatenated weights: the input is read (and under autocast cast) once, and the
    parameters keep transformers' names. Off: three separate Linears (the same numbers up to rounding).
    """

    def __init__(self, config: BertConfig, kv_width: int, cross: bool = False):
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"bert config: hidden_size={config.hidden_size} is not a multiple of "
                f"num_attention_heads={config.num_attention_heads}"
            )
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.dropout_p = config.attention_probs_dropout_prob
        self.cross = cross
        self.fused = True
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(kv_width, config.hidden_size)
        self.value = nn.Linear(kv_width, config.hidden_size)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _project(self, x: Tensor, linears: tuple[nn.Linear, ...]) -> list[Tensor]:
        """x (B,L,D) -> one (B,heads,L,head_dim) tensor per Linear; fused: one product."""
        if not self.fused or len(linears) == 1:
            return [self._heads(linear(x)) for linear in linears]
        weight = torch.cat([linear.weight for linear in linears])
        bias = torch.cat([linear.bias for linear in linears])
        out = F.linear(x, weight, bias).unflatten(-1, (len(linears), self.num_heads, self.head_dim))
        return list(out.permute(2, 0, 3, 1, 4).unbind(0))

    def context_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """context (Bc,N,Dk) -> its keys and values (Bc,heads,N,head_dim) each (computed once, shared)."""
        key, value = self._project(context, (self.key, self.value))
        return key, value

    def forward(self, x: Tensor, context: Tensor, mask: Tensor | None,
                context_index: Tensor | None = None,
                kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """x (B,Lq,H) queries, context (B,N,Dk) keys/values -> (B,Lq,H); mask bool or additive, broadcastable
        to (B,heads,Lq,N).

        Self-attention: context is x, or the full rows (B,N,H) of which x holds the first Lq positions (the
        last fusion layer at [CLS] only: queries there, keys and values everywhere).
        context_index (B,) long (cross-attention only): context holds Bc distinct contexts (Bc,N,Dk) and
        row b attends to context[context_index[b]]. Keys and values are then computed once per context
        and gathered, not once per row: ITM and MLM pair the same B images with 4B texts. kv: those keys
        and values already computed (context_kv), for row groups that share them.
        """
        if self.cross:
            query, = self._project(x, (self.query,))
            key, value = self.context_kv(context) if kv is None else kv
            if context_index is not None:  # index_select: its backward (index_add_) is ~8x a scatter's
                key, value = key.index_select(0, context_index), value.index_select(0, context_index)
        elif context is x:
            query, key, value = self._project(x, (self.query, self.key, self.value))
        else:
            query, = self._project(x, (self.query,))
            key, value = self._project(context, (self.key, self.value))
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
        )
        return out.transpose(1, 2).flatten(2)


class BertSelfOutput(nn.Module):
    """Output projection + dropout + residual LayerNorm (also used after the feed-forward)."""

    def __init__(self, config: BertConfig, in_width: int):
        super().__init__()
        self.dense = nn.Linear(in_width, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """x (B,L,in_width), residual (B,L,H) -> (B,L,H)."""
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    """Attention block: `.self` (q, k, v) and `.output` (dense, LayerNorm), as named by transformers."""

    def __init__(self, config: BertConfig, kv_width: int, cross: bool = False):
        super().__init__()
        self.self = BertSelfAttention(config, kv_width, cross)
        self.output = BertSelfOutput(config, config.hidden_size)

    def forward(self, x: Tensor, context: Tensor, mask: Tensor | None,
                context_index: Tensor | None = None,
                kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """x (B,Lq,H), context (B,N,Dk) (or (Bc,N,Dk) with context_index (B,); kv its keys and values)
        -> (B,Lq,H)."""
        return self.output(self.self(x, context, mask, context_index, kv), x)


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
            self.crossattention = BertAttention(config, config.encoder_width, cross=True)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, config.intermediate_size)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        context_index: Tensor | None = None,
        *,
        queries: int | None = None,
        context_kv: tuple[Tensor, Tensor] | None = None,
        rows: Tensor | None = None,
    ) -> Tensor:
        """x (B,L,H), context (B,N,Dv) (or (Bc,N,Dv) with context_index (B,) long) or None -> (B,Lq,H).

        queries: compute only the first Lq = queries positions (the ITM head reads [CLS] alone), whose
        self-attention still reads every position; None: all L. context_kv: the cross-attention's keys
        and values of `context`, already computed (BertSelfAttention.context_kv). rows (R,) long: x holds
        U distinct texts (U,L,H) (mask (U,..)) and the output's row r continues text rows[r]: the
        self-attention, which reads the text alone, runs once per text, and cross-attention and
        feed-forward once per row -> (R,Lq,H).
        """
        q = x if queries is None else x[:, :queries]
        x = self.attention(q, x, mask)
        if rows is not None:  # index_select: its backward (index_add_) sums the rows' gradients per text
            x = x.index_select(0, rows)
        if context is not None:
            x = self.crossattention(x, context, context_mask, context_index, context_kv)
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
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

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
