"""Image-text retrieval: the fine-tuning model (queue ITC against a momentum encoder + ITM_hard).

Its evaluation (ITC scores for all pairs, ITM re-ranking of the top k, recall metrics) is in
models/retrieval_eval.py.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.bert import build_text_encoder
from models.momentum import FeatureQueue, MomentumPairs
from models.objectives import itc_loss, mine_negatives
from models.vit import build_vision_encoder, check_vision_text_widths

__all__ = [
    "ALBEF_Retrieval",
    "MOMENTUM_PREFIXES",
    "QUEUE_KEYS",
    "RETRIEVAL_IGNORED_PREFIXES",
]

# Checkpoint keys of the momentum model; with momentum_init 'initial' a checkpoint's copies are skipped.
MOMENTUM_PREFIXES = ("visual_encoder_m.", "text_encoder_m.", "vision_proj_m.", "text_proj_m.")
# Pre-training keys the retrieval model has no use for (the MLM head): reported as ignored on load.
RETRIEVAL_IGNORED_PREFIXES = ("text_encoder.cls.",)
# Feature queues: state of one training run (and of its queue_size), never taken from --checkpoint.
QUEUE_KEYS = ("image_queue", "text_queue", "idx_queue", "queue_ptr")
_NEGATIVES = ("hard", "random")
_SAMPLINGS = ("argmax", "multinomial")


class ALBEF_Retrieval(FeatureQueue):  # noqa: N801 (ALBEF's naming)
    """Retrieval model: ViT + split BERT (no MLM head), ITC projections, ITM head, momentum copies, queues.

    Parameter names are ALBEF's retrieval model's: visual_encoder, text_encoder.bert, vision_proj,
    text_proj, temp, itm_head, their *_m momentum copies, and the buffers image_queue, text_queue,
    idx_queue, queue_ptr. The queues are inherited from FeatureQueue (rather than held as a
    submodule) precisely so that those buffers sit at the top level under ALBEF's names.

    The momentum copies are taken at construction, i.e. from the initial weights (vision_init,
    text_encoder); load a checkpoint afterwards into the online encoders and call copy_momentum()
    for momentum_init 'checkpoint'. Training: queue-based ITC with image-id positives (momentum
    features of the batch + queue on the other side), ITM with hard negatives mined from the ITC
    similarities excluding same-image pairs; no momentum distillation.
    """

    def __init__(self, config: dict, text_encoder: str | None = None, tokenizer=None):
        for key in ("embed_dim", "temp", "queue_size", "momentum"):
            if key not in config:
                raise ValueError(f"config key {key!r} is missing (needed by the retrieval model)")
        super().__init__(int(config["embed_dim"]), int(config["queue_size"]))
        if tokenizer is None:
            raise ValueError("ALBEF_Retrieval needs the tokenizer (for the vocabulary size)")
        self.momentum = float(config["momentum"])
        self.lambda_cons = float(config.get("lambda_cons", 0.0))
        self.itm_negatives = config.get("itm_negatives", "hard")
        self.hard_sampling = config.get("hard_sampling", "multinomial")
        # itm false: a dual encoder fine-tuned with ITC alone and ranked by ITC alone (paper Table 5).
        self.use_itm = bool(config.get("itm", True))
        if self.itm_negatives not in _NEGATIVES:
            raise ValueError(f"config key 'itm_negatives' must be one of {_NEGATIVES}, "
                             f"got {self.itm_negatives!r}")
        if self.hard_sampling not in _SAMPLINGS:
            raise ValueError(f"config key 'hard_sampling' must be one of {_SAMPLINGS}, "
                             f"got {self.hard_sampling!r}")
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"config key 'momentum' must be in [0, 1], got {self.momentum}")

        self.visual_encoder = build_vision_encoder(config)
        self.text_encoder = build_text_encoder(config, text_encoder, tokenizer, mlm_head=False)
        bert_config = self.text_encoder.config
        check_vision_text_widths(config, bert_config.encoder_width)
        hidden, embed_dim = bert_config.hidden_size, int(config["embed_dim"])
        self.vision_proj = nn.Linear(int(config["vision_width"]), embed_dim)
        self.text_proj = nn.Linear(hidden, embed_dim)
        self.temp = nn.Parameter(torch.tensor(float(config["temp"])))
        self.itm_head = nn.Linear(hidden, 2)

        # Momentum copies of the initial weights (paper S.M. D: "the initial model").
        self.visual_encoder_m = copy.deepcopy(self.visual_encoder)
        self.text_encoder_m = copy.deepcopy(self.text_encoder)
        self.vision_proj_m = copy.deepcopy(self.vision_proj)
        self.text_proj_m = copy.deepcopy(self.text_proj)
        self.momentum_pairs = MomentumPairs.build([
            (self.visual_encoder, self.visual_encoder_m),
            (self.text_encoder, self.text_encoder_m),
            (self.vision_proj, self.vision_proj_m),
            (self.text_proj, self.text_proj_m),
        ])

    def copy_momentum(self) -> None:
        """Momentum copies <- online weights (momentum_init 'checkpoint', after loading the checkpoint)."""
        self.momentum_pairs.copy_()

    def encode_image(self, image: Tensor) -> Tensor:
        """image (B,3,H,W), normalised -> tokens (B,1+P,Dv)."""
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

    def itm_logits(self, text_embeds: Tensor, text_mask: Tensor, image_embeds: Tensor) -> Tensor:
        """Pairs: text hidden (B,L,H), mask (B,L), image tokens (B,1+P,Dv) -> ITM logits (B,2) (1 = match)."""
        fused = self.text_encoder(
            mode="fusion", hidden_states=text_embeds, attention_mask=text_mask,
            encoder_hidden_states=image_embeds,
        )
        return self.itm_head(fused[:, 0])

    @property
    def uses_every_parameter(self) -> bool:
        """False with itm: false (the fusion layers and ITM head get no gradient; DDP must be told)."""
        return self.use_itm

    def itm_loss(self, image_embeds: Tensor, text_embeds: Tensor, attention_mask: Tensor, itc: dict,
                 in_batch: Tensor) -> Tensor:
        """ITM cross-entropy: B positives and 2B negatives mined from itc's in-batch sims (B,B) -> 0-dim."""
        batch = text_embeds.shape[0]
        # Hard negatives from the in-batch block of the ITC similarities; every caption of the same
        # image is a positive, never a negative.
        with torch.no_grad():
            neg_text_idx, neg_image_idx = mine_negatives(
                itc["sim_i2t"][:, :batch].detach(), itc["sim_t2i"][:, :batch].detach(), positive=in_batch,
                mode=self.itm_negatives, sampling=self.hard_sampling,
            )
        itm_logits = self.itm_logits(
            torch.cat([text_embeds, text_embeds[neg_text_idx], text_embeds]),
            torch.cat([attention_mask, attention_mask[neg_text_idx], attention_mask]),
            torch.cat([image_embeds, image_embeds, image_embeds[neg_image_idx]]),
        )
        itm_labels = torch.zeros(3 * batch, dtype=torch.long, device=itm_logits.device)
        itm_labels[:batch] = 1
        return F.cross_entropy(itm_logits, itm_labels)

    def forward(self, image: Tensor, text, idx: Tensor) -> dict[str, Tensor]:
        """image (B,3,H,W), text (tokenizer output (B,L)), idx (B,) image ids -> losses (0-dim) and feats."""
        with torch.no_grad():
            self.temp.clamp_(0.001, 0.5)
        input_ids, attention_mask = text.input_ids, text.attention_mask
        batch = input_ids.shape[0]
        idx = idx.view(-1)

        image_embeds = self.encode_image(image)
        text_embeds = self.encode_text(input_ids, attention_mask)
        image_feat = self.image_feat(image_embeds)
        text_feat = self.text_feat(text_embeds)

        with torch.no_grad():
            self.momentum_pairs.update(self.momentum)
            image_cls_m = self.visual_encoder_m.forward_features(image)[:, 0]
            image_feat_m = F.normalize(self.vision_proj_m(image_cls_m), dim=-1)
            text_hidden_m = self.text_encoder_m(input_ids, attention_mask, mode="text")
            text_feat_m = F.normalize(self.text_proj_m(text_hidden_m[:, 0]), dim=-1)
            image_bank, text_bank, positive = self.bank(image_feat_m, text_feat_m, idx)
        itc = itc_loss(image_feat, text_feat, self.temp, self.lambda_cons, positive=positive,
                       image_bank=image_bank, text_bank=text_bank)
        self.enqueue(image_feat_m, text_feat_m, idx)

        loss_itm = self.itm_loss(image_embeds, text_embeds, attention_mask, itc, positive[:, :batch]) \
            if self.use_itm else itc["loss_itc"].new_zeros(())
        return {
            "loss_itc": itc["loss_itc"],
            "loss_cons": itc["loss_cons"],
            "loss_itm": loss_itm,
            "image_feat": image_feat.detach(),
            "text_feat": text_feat.detach(),
        }
