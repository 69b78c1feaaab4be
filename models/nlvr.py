"""NLVR2 model: the fusion layers duplicated consecutively, one copy per image (paper S.M. D, as ALBEF).

Of each pair of fusion layers, the first cross-attends to image 0 and the second to image 1; the pair
shares the cross-attention key and value projections (layer 2k+1's modules ARE layer 2k's), so the
image tokens are projected the same way for both images. Stage 1 (text assignment) classifies a caption
into first image / second image / neither with `ta_head`; stage 2 (NLVR2) predicts true/false with
`cls_head`. A pre-training checkpoint loads through `nlvr_key_map`, which copies every pre-trained
fusion layer onto both of its copies.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig

from models.bert import BertEncoder, load_bert_config
from models.objectives import masked_mean
from models.vit import build_vision_encoder, check_vision_text_widths

__all__ = [
    "ALBEF_NLVR",
    "NLVR_PRETRAIN_ONLY_KEYS",
    "assign_texts",
    "duplicate_fusion_layers",
    "nlvr_bert_config",
    "nlvr_key_map",
    "nlvr_loss",
    "share_cross_attention_kv",
]

# Pre-training keys the NLVR models have no use for: reported by load_weights as ignored, with the
# reasons of models.loading.IGNORE_REASONS (which also covers, for every model, momentum copies *_m.*
# and the feature queues).
NLVR_PRETRAIN_ONLY_KEYS = ("text_proj.", "temp", "itm_head.", "text_encoder.cls.", "vision_proj.",
                           "ta_head.")

_LAYER_KEY = re.compile(r"^(text_encoder\.(?:bert\.)?encoder\.layer\.)(\d+)\.(.+)$")

TA_FIRST, TA_SECOND, TA_NEITHER = 0, 1, 2

# assign_texts' score of a bad sample's image: below every cosine similarity (so a valid image is
# always preferred) but above the -inf of the same image (a pair with a bad image is weighed out of
# the loss, a same-image "other" would be a wrong label).
_INVALID_SIMILARITY = -1e4


def nlvr_bert_config(bert_config: BertConfig) -> BertConfig:
    """Copy of a BERT config with every fusion layer doubled: fusion_layer + 2 * (L - fusion_layer) layers."""
    config = copy.deepcopy(bert_config)
    fusion = config.fusion_layer
    config.num_hidden_layers = fusion + 2 * (bert_config.num_hidden_layers - fusion)
    return config


def share_cross_attention_kv(encoder: BertEncoder) -> None:
    """Make layer fusion+2k+1's cross-attention key/value the very modules of layer fusion+2k."""
    fusion, layers = encoder.fusion_layer, encoder.layers
    if (len(layers) - fusion) % 2:
        raise ValueError(f"NLVR text encoder: {len(layers) - fusion} fusion layers, expected an even number")
    for j in range(fusion, len(layers), 2):
        first, second = layers[j].crossattention.self, layers[j + 1].crossattention.self
        second.key = first.key
        second.value = first.value


def _layer_count(state_dict: dict[str, Tensor]) -> int:
    ids = [int(m[2]) for m in map(_LAYER_KEY.match, state_dict) if m]
    return max(ids) + 1 if ids else 0


def duplicate_fusion_layers(
    state_dict: dict[str, Tensor], fusion_layer: int, num_layers: int
) -> dict[str, Tensor]:
    """Map a pre-training state dict (num_layers BERT layers) to the NLVR layout.

    Text layers (< fusion_layer) keep their index; pre-trained fusion layer i goes to both
    fusion_layer + 2*(i - fusion_layer) and the next index. A state dict already in the NLVR layout
    (fusion_layer + 2*(num_layers - fusion_layer) layers, e.g. the stage-1 checkpoint) passes unchanged.
    """
    found = _layer_count(state_dict)
    doubled = fusion_layer + 2 * (num_layers - fusion_layer)
    if found in (0, doubled):
        return dict(state_dict)
    if found != num_layers:
        raise ValueError(
            f"NLVR checkpoint has {found} text encoder layers; expected {num_layers} (pre-training layout) "
            f"or {doubled} (NLVR layout) for bert_config num_hidden_layers={num_layers}, "
            f"fusion_layer={fusion_layer}"
        )
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        match = _LAYER_KEY.match(key)
        if match is None or int(match[2]) < fusion_layer:
            out[key] = value
            continue
        j = fusion_layer + 2 * (int(match[2]) - fusion_layer)
        out[f"{match[1]}{j}.{match[3]}"] = value
        out[f"{match[1]}{j + 1}.{match[3]}"] = value
    return out


def nlvr_key_map(fusion_layer: int, num_layers: int) -> Callable[[dict[str, Tensor]], dict[str, Tensor]]:
    """key_map for models.loading.load_weights: see duplicate_fusion_layers."""
    return lambda state_dict: duplicate_fusion_layers(state_dict, fusion_layer, num_layers)


def _mlp_head(width: int, classes: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))


def _ta_head(kind: Literal["linear", "mlp"], width: int) -> nn.Module:
    """Stage-1 text-assignment head. 'linear': the authors' (GRIT-VLP / ALBEF model_pretrain_nlvr)
    nn.Linear(hidden, 3), keys ta_head.weight/bias; 'mlp': this repository's older two-layer head
    (Linear, ReLU, Linear), keys ta_head.0.* / ta_head.2.*, kept to load stage-1 checkpoints saved with it."""
    return nn.Linear(width, 3) if kind == "linear" else _mlp_head(width, 3)


def nlvr_loss(logits: Tensor, labels: Tensor, valid: Tensor | None = None) -> Tensor:
    """NLVR2 cross-entropy: logits (B,2), labels (B,) -> 0-dim mean over the batch.

    valid (B,) bool: bad samples (False; dataset.bad_samples) weigh 0 and the mean runs over the
    valid ones (0, with a graph, when there are none). None: F.cross_entropy, exactly as before.
    """
    if valid is None:
        return F.cross_entropy(logits, labels)
    return masked_mean(F.cross_entropy(logits, labels, reduction="none"), valid)


@torch.no_grad()
def assign_texts(
    image_feat: Tensor, image_ids: Tensor | None = None, generator: torch.Generator | None = None,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Text-assignment pairs: image_feat (B,d) L2-normalised -> (first (B,), second (B,), labels (B,)).

    Each text b is paired with its own image b and the most similar other in-batch images o1, o2
    (image-image ITC similarity; images with the same image_ids count as the same image):
    label 0 -> (b, o1), 1 -> (o1, b), 2 -> (o1, o2), drawn uniformly.
    valid (B,) bool: a bad sample's image is taken as o1/o2 only when a row has fewer than two valid
    other images (the caller then weighs that pair out); the labels are drawn as without it.
    """
    batch = image_feat.shape[0]
    if batch < 3:
        raise ValueError(f"text assignment needs a batch of at least 3 images, got {batch}")
    sim = image_feat @ image_feat.t()
    same = torch.eye(batch, dtype=torch.bool, device=sim.device)
    if image_ids is not None:
        same = same | (image_ids[:, None] == image_ids[None, :])
    if valid is not None:
        sim = sim.masked_fill(~valid[None, :], _INVALID_SIMILARITY)
    others = sim.masked_fill(same, float("-inf")).topk(2, dim=1).indices
    labels = torch.randint(0, 3, (batch,), device=image_feat.device, generator=generator)
    own = torch.arange(batch, device=image_feat.device)
    first = torch.where(labels == TA_FIRST, own, others[:, 0])
    second = torch.where(
        labels == TA_FIRST, others[:, 0], torch.where(labels == TA_SECOND, own, others[:, 1])
    )
    return first, second, labels


class ALBEF_NLVR(nn.Module):
    """ViT + BERT whose fusion layers attend alternately to two images; a head on the fused [CLS]:
    cls_head (MLP, NLVR2) or, in stage 1, ta_head (one Linear as the authors', or our older MLP)."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        """Build the stage config.text_assignment asks for (true: stage 1, false: NLVR2) from random weights.

        config: the resolved NLVR config (training.config.NLVRConfig); reads text_assignment, ta_head,
        embed_dim, bert_config, grad_checkpointing and the ViT's keys (text_encoder is not read: every
        weight comes from a pre-training or stage-1 checkpoint via load_weights). tokenizer: its length
        is the vocabulary size.
        """
        super().__init__()
        base = load_bert_config(config.bert_config)
        base.vocab_size = len(tokenizer)
        self.pretrain_layers = base.num_hidden_layers
        self.fusion_layer = base.fusion_layer
        self.text_assignment = config.text_assignment
        check_vision_text_widths(config, base.encoder_width)
        self.visual_encoder = build_vision_encoder(config)
        # Random init: the weights come from a (pre-training or stage-1) checkpoint via load_weights.
        self.text_encoder = BertEncoder(nlvr_bert_config(base), mlm_head=False)
        self.text_encoder.set_grad_checkpointing(config.grad_checkpointing)
        share_cross_attention_kv(self.text_encoder)
        width = base.hidden_size
        if self.text_assignment:
            # Only picks similar images (no gradient): frozen so DDP sees no unused trainable parameter.
            self.vision_proj = nn.Linear(config.vision_width, config.embed_dim)
            self.vision_proj.requires_grad_(False)
            # ta_head 'linear' (the authors' layout) or 'mlp' (our older stage-1 checkpoints);
            # load_weights switches to the checkpoint's layout (match_checkpoint_layout).
            self.ta_head = _ta_head(config.ta_head, width)
        else:
            self.cls_head = _mlp_head(width, 2)

    def key_map(self) -> Callable[[dict[str, Tensor]], dict[str, Tensor]]:
        """Checkpoint key map for load_weights (pre-training -> duplicated layout)."""
        return nlvr_key_map(self.fusion_layer, self.pretrain_layers)

    def match_checkpoint_layout(self, state: dict[str, Tensor]) -> str | None:
        """Rebuild ta_head in the checkpoint's layout (called by load_weights before loading); a note or None.

        An older stage-1 checkpoint's two-layer MLP head (ta_head.0.*, ta_head.2.*) cannot be mapped
        exactly onto the authors' single Linear, so instead of approximating it this load builds the
        MLP head, and the model goes on with it (fine-tuning, saving: its checkpoints keep the MLP keys).
        The other way round an authors'-layout head (ta_head.weight) gets the Linear. The new head is
        freshly initialised (the checkpoint then fills it): call this before building an optimizer.
        """
        if not self.text_assignment:
            return None
        if "ta_head.0.weight" in state and "ta_head.2.weight" in state:
            kind = "mlp"
        elif "ta_head.weight" in state:
            kind = "linear"
        else:
            return None
        current = "linear" if isinstance(self.ta_head, nn.Linear) else "mlp"
        if kind == current:
            return None
        old = next(self.ta_head.parameters())
        self.ta_head = _ta_head(kind, self.text_encoder.config.hidden_size).to(old.device, old.dtype)
        layout = ("the older two-layer MLP (ta_head.0/.2)" if kind == "mlp"
                  else "the authors' single Linear (ta_head.weight/bias)")
        # Printed by the callers with the load report (load_task_checkpoint: on the main rank).
        return f"the checkpoint's ta_head is {layout}: ta_head rebuilt as '{kind}' for this load"

    def ignored_keys(self) -> tuple[str, ...]:
        """Checkpoint key prefixes dropped on purpose (pre-training-only parts, the other stage's head)."""
        if self.text_assignment:
            return tuple(k for k in NLVR_PRETRAIN_ONLY_KEYS if k != "vision_proj.") + ("cls_head.",)
        return NLVR_PRETRAIN_ONLY_KEYS

    def encode_image(self, image: Tensor) -> Tensor:
        """image (B,3,H,W) -> tokens (B,1+P,Dv)."""
        return self.visual_encoder.forward_features(image)

    def fuse(self, input_ids: Tensor, attention_mask: Tensor, image0: Tensor, image1: Tensor) -> Tensor:
        """input_ids/attention_mask (B,L), image tokens (B,N,Dv) x2 -> fused [CLS] state (B,H)."""
        hidden = self.text_encoder(
            input_ids, attention_mask, mode="multimodal", encoder_hidden_states=[image0, image1]
        )
        return hidden[:, 0]

    def forward(self, *args, **kwargs):
        """classify(...) for NLVR2, text_assignment_loss(...) for stage 1 (DDP needs one entry point)."""
        if self.text_assignment:
            return self.text_assignment_loss(*args, **kwargs)
        return self.classify(*args, **kwargs)

    def classify(self, image0: Tensor, image1: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """NLVR2: images (B,3,H,W) x2, sentence ids/mask (B,L) -> false/true logits (B,2).

        The training loss is nlvr_loss(logits, labels, valid), which leaves bad samples out.
        """
        if self.text_assignment:
            raise ValueError("this ALBEF_NLVR was built for text assignment (no cls_head)")
        tokens = self.encode_image(torch.cat([image0, image1]))
        tokens0, tokens1 = tokens.split(image0.shape[0])
        return self.cls_head(self.fuse(input_ids, attention_mask, tokens0, tokens1))

    def text_assignment_loss(
        self,
        image: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        image_ids: Tensor | None = None,
        generator: torch.Generator | None = None,
        valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Stage 1: image (B,3,H,W), caption ids/mask (B,L) -> (loss, logits (B,3), labels (B,)).

        valid (B,) bool marks bad samples (False; dataset.bad_samples): their captions are left out
        of the loss and their images serve as nobody's "other" image; a pair that still holds one
        (a batch with fewer than three valid images) weighs 0. None: exactly the unweighted mean.
        """
        if not self.text_assignment:
            raise ValueError("this ALBEF_NLVR was built for NLVR2 (config text_assignment: false)")
        tokens = self.encode_image(image)
        with torch.no_grad():
            feat = F.normalize(self.vision_proj(tokens[:, 0]), dim=-1)
        first, second, labels = assign_texts(feat, image_ids, generator, valid)
        logits = self.ta_head(self.fuse(input_ids, attention_mask, tokens[first], tokens[second]))
        if valid is None:
            return F.cross_entropy(logits, labels), logits, labels
        weight = valid & valid[first] & valid[second]
        return masked_mean(F.cross_entropy(logits, labels, reduction="none"), weight), logits, labels
