"""Compact BERT split at `fusion_layer` into a text encoder and a fusion (multi-modal) encoder: the
config, the encoder (modes, attention masks, per-layer activation checkpointing, init) and loading.

Its layers are in models/bert_layers.py. Parameter names follow transformers' BertForMaskedLM
(without the pooler) so that BERT checkpoints and ALBEF / GRIT-VLP checkpoints load without key
surgery; the attention masks are built once per forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import BertConfig

from grit_io import InputFileError, read_json
from models.bert_layers import (
    BertBackbone,
    BertLayer,
    BertLMPredictionHead,
    BertOnlyMLMHead,
    BertSelfAttention,
)
from models.bert_weights import normalise_bert_keys, read_bert_weights, resolve_bert_weights
from models.layer_norm import set_amp_layer_norm
from models.state_dicts import check_shapes, missing_after_tying, summarise_keys

logger = logging.getLogger(__name__)

_MODES = ("text", "fusion", "multimodal")


def load_bert_config(path: str) -> BertConfig:
    """Read a BERT json config that also carries the ALBEF keys fusion_layer and encoder_width;
    InputFileError naming the file when it is missing, not json, or lacks or misplaces those keys."""
    values = read_json(path, "bert_config")
    if not isinstance(values, dict):
        raise InputFileError(f"bert_config {path}: expected a json object of BERT settings, got "
                             f"{type(values).__name__}")
    missing = [k for k in ("fusion_layer", "encoder_width") if k not in values]
    if missing:
        raise InputFileError(f"bert_config {path} lacks the key(s) {missing} (needed to split BERT for "
                             "fusion)")
    config = BertConfig(**values)
    if not 0 <= config.fusion_layer <= config.num_hidden_layers:
        raise InputFileError(
            f"bert_config {path}: fusion_layer={config.fusion_layer} must lie in "
            f"[0, num_hidden_layers={config.num_hidden_layers}]"
        )
    return config


def _contexts(mode: str, encoder_hidden_states: Tensor | Sequence[Tensor] | None,
              encoder_attention_mask: Tensor | Sequence[Tensor] | None, context_index: Tensor | None,
              dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor | None]]:
    """The cross-attention layers' image tokens and their additive masks, as lists (one per context)."""
    if encoder_hidden_states is None:
        raise ValueError(f"BertEncoder mode {mode!r} needs encoder_hidden_states (image tokens)")
    contexts = ([encoder_hidden_states] if isinstance(encoder_hidden_states, Tensor)
                else list(encoder_hidden_states))
    if encoder_attention_mask is None or isinstance(encoder_attention_mask, Tensor):
        masks = [encoder_attention_mask] * len(contexts)
    else:
        masks = list(encoder_attention_mask)
    if len(masks) != len(contexts):
        raise ValueError("encoder_attention_mask list must match encoder_hidden_states list")
    if context_index is not None and (len(contexts) != 1 or masks[0] is not None):
        raise ValueError("context_index needs one encoder_hidden_states tensor and no "
                         "encoder_attention_mask")
    return contexts, [_attention_mask(m, dtype) for m in masks]


def _attention_mask(
    attention_mask: Tensor | None, dtype: torch.dtype, causal_len: int | None = None,
    device: torch.device | None = None,
) -> Tensor | None:
    """attention_mask (B,N) 1=keep -> additive (B,1,1,N) in `dtype`, 0 where a token may be attended and
    -inf where not; with causal_len L (B|1,1,L,L). None when nothing is masked.

    Additive in the compute dtype, built once per forward: a bool mask would be converted to this inside
    every attention call of every layer (and under autocast cast again).
    """
    keep = None if attention_mask is None else attention_mask[:, None, None, :].bool()
    if causal_len is not None:
        causal = torch.ones(causal_len, causal_len, dtype=torch.bool, device=device).tril()
        keep = causal if keep is None else keep & causal
    if keep is None:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the matrix products of a forward on x run in: autocast's when it is on, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class BertEncoder(nn.Module):
    """BERT text encoder (layers < fusion_layer) + fusion encoder (layers >= fusion_layer) + MLM head.

    Layers i >= cross_from (default fusion_layer) cross-attend to `encoder_hidden_states`
    (width config.encoder_width). is_decoder=True makes self-attention causal (VQA answer decoder,
    built with fusion_layer=0 so that every layer cross-attends). set_grad_checkpointing(True):
    each layer's activations are recomputed in backward instead of stored (training with grad only).
    set_fused_qkv(False): separate query/key/value products (models.bert_layers.BertSelfAttention).
    """

    def __init__(
        self,
        config: BertConfig,
        mlm_head: bool = True,
        is_decoder: bool = False,
        cross_from: int | None = None,
    ):
        super().__init__()
        for key in ("fusion_layer", "encoder_width"):
            if not hasattr(config, key):
                raise ValueError(f"bert config lacks {key!r} (needed to split BERT for fusion)")
        self.config = config
        self.fusion_layer = config.fusion_layer
        self.cross_from = config.fusion_layer if cross_from is None else cross_from
        self.is_decoder = is_decoder
        self.grad_checkpointing = False
        self.bert = BertBackbone(config, self.cross_from)
        if mlm_head:
            self.cls = BertOnlyMLMHead(config)
        self.apply(self._init_weights)
        if mlm_head:
            self.tie_weights()

    def _init_weights(self, module: nn.Module) -> None:
        # BERT's initialisation: N(0, initializer_range) weights, zero biases, unit LayerNorm.
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, BertLMPredictionHead):
            nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        """Share the MLM decoder weight with the word embeddings (as transformers does)."""
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    @property
    def layers(self) -> nn.ModuleList:
        return self.bert.encoder.layer

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Checkpoint every layer while training (the name and meaning of timm's ViT switch)."""
        self.grad_checkpointing = bool(enable)

    def set_fused_qkv(self, enable: bool = True) -> None:
        """Config key fused_qkv: each attention's projections as one product (same parameters)."""
        for module in self.modules():
            if isinstance(module, BertSelfAttention):
                module.fused = bool(enable)

    def _run_layer(self, layer: BertLayer, *args: Tensor | None, **kwargs: Any) -> Tensor:
        """layer(*args, **kwargs), checkpointed when the switch is on and a backward can follow."""
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            # Keeps only the layer's inputs; the forward is rerun in backward with the RNG state it
            # had (torch's default), so dropout draws the same masks and the gradients are unchanged.
            return checkpoint(layer, *args, use_reentrant=False, **kwargs)
        return layer(*args, **kwargs)

    def _check_row_options(self, mode: str, start: int, stop: int, batch: int, cls_rows: int,
                           text_index: Tensor | None) -> None:
        """ValueError unless forward's cls_rows and text_index can act on layers start..stop-1 of `batch`
        rows (text_index's length rows when given)."""
        if cls_rows and (mode == "text" or stop - 1 < self.cross_from):
            raise ValueError("cls_rows needs a forward that ends in a fusion layer (mode 'fusion' or "
                             "'multimodal')")
        if text_index is not None and (mode != "fusion" or start < self.cross_from):
            raise ValueError("text_index needs mode 'fusion' and cross-attention from the first fusion layer")
        if (cls_rows or text_index is not None) and self.is_decoder:
            raise ValueError("cls_rows and text_index are for the bidirectional fusion encoder, not for a "
                             "decoder")
        rows = batch if text_index is None else text_index.shape[0]
        if not 0 <= cls_rows <= rows:
            raise ValueError(f"cls_rows must be in [0, {rows}] (the rows), got {cls_rows}")

    def _last_layer_split(self, layer: BertLayer, x: Tensor, mask: Tensor | None, context: Tensor,
                          context_mask: Tensor | None, context_index: Tensor | None,
                          cls_rows: int) -> tuple[Tensor, Tensor]:
        """The last fusion layer, its first cls_rows rows at [CLS] only -> ((cls_rows,H), (R-cls_rows,L,H)).

        Those rows' other positions are never read (the ITM head reads [CLS]), so the layer computes
        their [CLS] query alone: its self-attention still reads every position's keys and values, and
        the [CLS] state is the one the full layer computes. With context_index the image keys and values
        are computed once for both row groups.
        """
        n = cls_rows
        kv = None if context_index is None else layer.crossattention.self.context_kv(context)

        def rows(t: Tensor | None, part: slice) -> Tensor | None:
            return None if t is None else t[part]

        def group(part: slice, queries: int | None) -> Tensor:
            own = rows(context, part) if context_index is None else context
            return self._run_layer(layer, x[part], rows(mask, part), own, rows(context_mask, part),
                                   rows(context_index, part), queries=queries, context_kv=kv)

        head = group(slice(None, n), 1)[:, 0]
        rest = group(slice(n, None), None) if n < x.shape[0] else x[n:]
        return head, rest

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        mode: str = "multimodal",
        hidden_states: Tensor | None = None,
        encoder_hidden_states: Tensor | Sequence[Tensor] | None = None,
        encoder_attention_mask: Tensor | Sequence[Tensor] | None = None,
        context_index: Tensor | None = None,
        cls_rows: int = 0,
        text_index: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Run the text part, the fusion part or both; returns hidden states (B,L,H).

        input_ids (B,L) for 'text'/'multimodal'; hidden_states (B,L,H) (text-mode output) for 'fusion';
        attention_mask (B,L) 1 = token, 0 = padding; encoder_hidden_states (B,N,Dv) or a list of them
        (fusion layer j attends to list[(j - fusion_layer) % len(list)]), encoder_attention_mask (B,N)
        or a matching list (None = attend to every image token). context_index (B,) long, with one
        encoder_hidden_states tensor of Bc images (Bc,N,Dv) and no encoder_attention_mask: row b attends
        to image context_index[b], and each cross-attention layer computes its keys and values once per
        image (the same result as encoder_hidden_states[context_index], with fewer FLOPs).
        cls_rows > 0 ('fusion'/'multimodal'): the first cls_rows rows are read at [CLS] only (ITM), and the
        last layer computes just that position for them (config key itm_cls_only): returns ([CLS] states
        (cls_rows,H), the other rows' states (R-cls_rows,L,H); R = B, or text_index's length), the same
        numbers as the full forward's.
        text_index (R,) long (mode 'fusion'): hidden_states and attention_mask hold U distinct texts (U,L,.)
        and row r is text text_index[r]: the first fusion layer's self-attention, which reads the text
        alone, runs once per text (config key share_caption_attention); the R rows go on from there. The
        same numbers as the pass on hidden_states[text_index] (in training with dropout, the rows of one
        text share that sub-layer's dropout draw).
        """
        if mode not in _MODES:
            raise ValueError(f"BertEncoder mode must be one of {_MODES}, got {mode!r}")
        n_layers = len(self.layers)
        if mode == "fusion":
            if hidden_states is None:
                raise ValueError("BertEncoder mode 'fusion' needs hidden_states (the text-mode output)")
            start, x = self.fusion_layer, hidden_states
        else:
            if input_ids is None:
                raise ValueError(f"BertEncoder mode {mode!r} needs input_ids")
            start, x = 0, self.bert.embeddings(input_ids)
        stop = self.fusion_layer if mode == "text" else n_layers
        dtype = compute_dtype(x)
        self_mask = _attention_mask(attention_mask, dtype, x.shape[1] if self.is_decoder else None, x.device)

        contexts, context_masks = None, None
        if any(i >= self.cross_from for i in range(start, stop)):
            contexts, context_masks = _contexts(mode, encoder_hidden_states, encoder_attention_mask,
                                                context_index, dtype)
        self._check_row_options(mode, start, stop, x.shape[0], cls_rows, text_index)
        return self._run_layers(x, self_mask, range(start, stop), contexts, context_masks, context_index,
                                cls_rows, text_index)

    def _run_layers(self, x: Tensor, self_mask: Tensor | None, layers: range, contexts: list[Tensor] | None,
                    context_masks: list[Tensor | None] | None, context_index: Tensor | None, cls_rows: int,
                    text_index: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
        """forward's layers `layers` over x (B,L,H) with its additive mask -> its return value."""
        start, stop = layers.start, layers.stop
        if text_index is not None and cls_rows and start == stop - 1:
            # one fusion layer, which is also the [CLS]-only one: the rows are gathered first (not shared)
            x = x.index_select(0, text_index)
            self_mask = None if self_mask is None else self_mask.index_select(0, text_index)
            text_index = None
        for i in layers:
            layer = self.layers[i]
            if i >= self.cross_from:
                k = (i - self.fusion_layer) % len(contexts)
                if cls_rows and i == stop - 1:
                    return self._last_layer_split(layer, x, self_mask, contexts[k], context_masks[k],
                                                  context_index, cls_rows)
                if text_index is not None and i == start:
                    x = self._run_layer(layer, x, self_mask, contexts[k], context_masks[k], context_index,
                                        rows=text_index)
                    self_mask = None if self_mask is None else self_mask.index_select(0, text_index)
                    continue
                x = self._run_layer(layer, x, self_mask, contexts[k], context_masks[k], context_index)
            else:
                x = self._run_layer(layer, x, self_mask)
        return x

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """hidden (..., H) -> vocabulary logits (..., V)."""
        if not hasattr(self, "cls"):
            raise ValueError("this BertEncoder was built with mlm_head=False")
        return self.cls.predictions(hidden)

    @classmethod
    def from_pretrained(
        cls, name_or_dir: str, config: BertConfig, mlm_head: bool = True, **kwargs
    ) -> BertEncoder:
        """Build from `config` and load transformers BERT weights (BertModel / BertForMaskedLM layout)."""
        path = resolve_bert_weights(name_or_dir)  # before building: fail fast on a bad path
        model = cls(config, mlm_head=mlm_head, **kwargs)
        state = normalise_bert_keys(read_bert_weights(path))
        own = model.state_dict()
        word_key = "bert.embeddings.word_embeddings.weight"
        if word_key in state and state[word_key].shape[0] != config.vocab_size:
            raise InputFileError(
                f"text_encoder {name_or_dir!r} has a vocabulary of {state[word_key].shape[0]} tokens but the "
                f"model expects vocab_size={config.vocab_size} (the tokenizer's length); use the tokenizer "
                "that belongs to these weights"
            )
        check_shapes(state, own,
                     f"text_encoder {name_or_dir!r} does not fit bert_config (hidden size / widths differ)")
        unused = sorted(k for k in state if k not in own)
        loaded = {k: v for k, v in state.items() if k in own}
        model.load_state_dict(loaded, strict=False)
        fresh = missing_after_tying(model, set(loaded))
        logger.info(
            "BERT weights from %s: freshly initialised: %s; unused from checkpoint: %s",
            name_or_dir,
            summarise_keys(fresh) or "none",
            summarise_keys(unused) or "none",
        )
        return model


def build_text_encoder(config: Any, tokenizer: Any, mlm_head: bool, *,
                       pretrained: bool = True) -> BertEncoder:
    """The split BERT of config.bert_config, its vocabulary the tokenizer's (len(tokenizer)); its forward
    maps ids (B,L) to hidden states (B,L,H).

    config: the resolved task config (training.config.TaskConfig); reads bert_config, text_encoder (BERT
    weights; null: random init) and grad_checkpointing (checkpoint every layer while training).
    pretrained=False: random init whatever text_encoder says, for a model whose weights all come from a
    task checkpoint (VQA). Also reads fused_qkv and amp_layer_norm (the step's speed switches).
    """
    bert_config = load_bert_config(config.bert_config)
    weights = config.text_encoder if pretrained else None
    vocab = len(tokenizer)
    if vocab != bert_config.vocab_size:
        # Random init: the tokenizer decides the vocabulary; pretrained weights must already match it
        # (from_pretrained raises a clear error if they do not).
        if weights is None:
            logger.info(
                "bert_config vocab_size %d != tokenizer length %d: using %d",
                bert_config.vocab_size,
                vocab,
                vocab,
            )
        bert_config.vocab_size = vocab
    if weights is None:
        model = BertEncoder(bert_config, mlm_head=mlm_head)
    else:
        model = BertEncoder.from_pretrained(weights, bert_config, mlm_head=mlm_head)
    model.set_grad_checkpointing(config.grad_checkpointing)
    model.set_fused_qkv(config.fused_qkv)
    set_amp_layer_norm(model, config.amp_layer_norm)
    return model


__all__ = ["BertEncoder", "build_text_encoder", "load_bert_config"]
