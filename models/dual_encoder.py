"""ImageTextModel: the image and text encoders, ITC projections and ITM head that the pre-training model
(models.pretrain.ALBEF_Base) and the retrieval model (models.retrieval.ALBEF_Retrieval) share, with the
computations both run on them: encoding, the L2-normalised ITC features, and ITM's pairs [positives, (image,
negative text), (negative image, text)] and their logits (the losses are models.losses').

The module names are ALBEF's (visual_encoder, text_encoder, vision_proj, text_proj, temp, itm_head), so
ALBEF and GRIT-VLP checkpoints load into either model without key surgery.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.bert import build_text_encoder
from models.vit import build_vision_encoder, check_vision_text_widths

__all__ = ["ImageTextModel"]

# ITC temperature range (ALBEF): clamped after every optimiser step (training.optimizer.clamp_after_steps).
_TEMP_MIN, _TEMP_MAX = 0.001, 0.5


class ImageTextModel(nn.Module):
    """ViT + split BERT (text + fusion layers), ITC projections vision_proj / text_proj, temp, ITM head.

    Cooperative: keyword arguments it does not take go to the next class in the MRO, so a subclass that
    also inherits FeatureQueue (ALBEF_Retrieval) gets its queues registered, and their random columns
    drawn, before the encoders are built (the order, and so the random initialisation, of ALBEF's model).
    """

    def __init__(self, config: Any, tokenizer: Any, *, mlm_head: bool, **kwargs: Any) -> None:
        """Build the encoders and heads.

        config: the resolved task config (training.config.PretrainConfig or RetrievalConfig); reads
        embed_dim, temp, lambda_cons, itm, itm_negatives, hard_sampling, share_image_kv, itm_cls_only,
        vision_width and
        what build_vision_encoder / build_text_encoder read. tokenizer: its length is the vocabulary size.
        mlm_head: keep BERT's MLM head (pre-training) or not (retrieval).
        """
        super().__init__(**kwargs)
        self.lambda_cons = config.lambda_cons
        # itm false: a dual encoder ranked by ITC alone (paper Table 5); the fusion layers and the ITM
        # head are still built (checkpoints keep their keys) but never run.
        self.use_itm = config.itm
        self.itm_negatives = config.itm_negatives
        self.hard_sampling = config.hard_sampling
        self.share_image_kv = config.share_image_kv
        # The ITM head reads the last fusion layer at [CLS]: that layer computes it alone for ITM's pairs
        # (not in ALBEF, which computes every position; the logits are the same up to rounding).
        self.itm_cls_only = config.itm_cls_only

        self.visual_encoder = build_vision_encoder(config)
        self.text_encoder = build_text_encoder(config, tokenizer, mlm_head=mlm_head)
        bert_config = self.text_encoder.config
        check_vision_text_widths(config, bert_config.encoder_width)
        hidden = bert_config.hidden_size
        self.vision_proj = nn.Linear(config.vision_width, config.embed_dim)
        self.text_proj = nn.Linear(hidden, config.embed_dim)
        self.temp = nn.Parameter(torch.tensor(float(config.temp)))
        self.itm_head = nn.Linear(hidden, 2)

    @torch.no_grad()
    def clamp_temperature(self) -> None:
        """Keep the learnt ITC temperature in [0.001, 0.5] (ALBEF), in place; the trainer calls it after every
        optimiser step (ALBEF: at the start of forward, which then writes a parameter)."""
        self.temp.clamp_(_TEMP_MIN, _TEMP_MAX)

    def encode_image(self, image: Tensor) -> Tensor:
        """image (B,3,H,W), already normalised -> tokens (B,1+P,Dv) (final LayerNorm applied)."""
        return self.visual_encoder.forward_features(image)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """input_ids, attention_mask (B,L) -> text-encoder hidden states (B,L,H)."""
        return self.text_encoder(input_ids, attention_mask, mode="text")

    def image_feat(self, image_embeds: Tensor) -> Tensor:
        """Image tokens (B,1+P,Dv) -> L2-normalised ITC feature of the CLS token (B,d)."""
        return F.normalize(self.vision_proj(image_embeds[:, 0]), dim=-1)

    def text_feat(self, text_embeds: Tensor) -> Tensor:
        """Text hidden states (B,L,H) -> L2-normalised ITC feature of the CLS token (B,d)."""
        return F.normalize(self.text_proj(text_embeds[:, 0]), dim=-1)

    def project(self, image_embeds: Tensor, text_embeds: Tensor) -> tuple[Tensor, Tensor]:
        """Uni-modal states (B,1+P,Dv), (B,L,H) -> L2-normalised ITC projections of the CLS, (B,d) each."""
        return self.image_feat(image_embeds), self.text_feat(text_embeds)

    @torch.no_grad()
    def unimodal_features(self, image: Tensor, text: Any) -> tuple[Tensor, Tensor]:
        """image (B,3,H,W), text (tokenizer output (B,L)) -> detached ITC projections (B,d) each, fp32
        (GRIT's naive pass, the warm-start index)."""
        image_feat, text_feat = self.project(self.encode_image(image),
                                             self.encode_text(text.input_ids, text.attention_mask))
        return image_feat.float(), text_feat.float()

    def fuse(self, text_embeds: Tensor, text_mask: Tensor, image_embeds: Tensor,
             image_index: Tensor | None = None, cls_rows: int = 0,
             text_index: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Fusion layers over text states (R,L,H), mask (R,L) and image tokens -> fused states (R,L,H).

        image_embeds (R,1+P,Dv), one image per row; or, with image_index (R,) long, Bi images (Bi,1+P,Dv)
        and row r paired with image image_index[r]. share_image_kv: each cross-attention layer computes
        its keys and values once per image and gathers them; off (ALBEF), once per row, on the gathered
        image_embeds[image_index]. The numbers are the same. cls_rows > 0: the first cls_rows rows only at
        [CLS] -> ((cls_rows,H), (R-cls_rows,L,H)) (models.bert.BertEncoder.forward). text_index (R,): the
        text states and masks hold U distinct texts and row r is text text_index[r] (BertEncoder.forward).
        """
        if image_index is not None and not self.share_image_kv:
            image_embeds, image_index = image_embeds.index_select(0, image_index), None
        return self.text_encoder(mode="fusion", hidden_states=text_embeds, attention_mask=text_mask,
                                 encoder_hidden_states=image_embeds, context_index=image_index,
                                 cls_rows=cls_rows, text_index=text_index)

    def fused_cls(self, text_embeds: Tensor, text_mask: Tensor, image_embeds: Tensor,
                  image_index: Tensor | None = None) -> Tensor:
        """Pairs as fuse -> the last fusion layer's [CLS] states (R,H), which ITM reads; itm_cls_only: that
        layer computes [CLS] alone."""
        rows = text_embeds.shape[0]
        if self.itm_cls_only and rows:  # cls_rows=0 would mean every position
            return self.fuse(text_embeds, text_mask, image_embeds, image_index, cls_rows=rows)[0]
        return self.fuse(text_embeds, text_mask, image_embeds, image_index)[:, 0]

    def itm_logits(self, text_embeds: Tensor, text_mask: Tensor, image_embeds: Tensor,
                   image_index: Tensor | None = None) -> Tensor:
        """Pairs: text hidden (R,L,H), mask (R,L), image tokens (R,1+P,Dv) (or Bi images and image_index (R,),
        as fuse) -> ITM logits (R,2) (1 = match)."""
        return self.itm_head(self.fused_cls(text_embeds, text_mask, image_embeds, image_index))

    @staticmethod
    def itm_pair_index(neg_text_idx: Tensor, neg_image_idx: Tensor) -> tuple[Tensor, Tensor]:
        """Mined indices (B,) each -> ITM's 3B pairs [positives, (image, negative text), (negative image,
        text)] as each pair's text index (3B,) and image index (3B,) into the batch's B texts and images."""
        own = torch.arange(neg_text_idx.shape[0], device=neg_text_idx.device)
        return torch.cat([own, neg_text_idx, own]), torch.cat([own, own, neg_image_idx])

    @classmethod
    def itm_pairs(cls, text_embeds: Tensor, attention_mask: Tensor, neg_text_idx: Tensor,
                  neg_image_idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """ITM's 3B pairs (itm_pair_index's order): text states (3B,L,H), masks (3B,L) and each pair's image
        index (3B,) into the batch's B images."""
        _, image_index = cls.itm_pair_index(neg_text_idx, neg_image_idx)
        return (torch.cat([text_embeds, text_embeds.index_select(0, neg_text_idx), text_embeds]),
                torch.cat([attention_mask, attention_mask.index_select(0, neg_text_idx), attention_mask]),
                image_index)
