"""Image-text retrieval: the fine-tuning model (queue ITC against a momentum encoder + ITM_hard; the losses
are models.losses' objectives).

Its evaluation (ITC scores for all pairs, ITM re-ranking of the top k, recall metrics) is in
models/retrieval_eval.py.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.dual_encoder import ImageTextModel
from models.losses import build_objectives
from models.momentum import FeatureQueue, MomentumPairs
from models.negatives import mine_negatives
from models.objectives import concat_all_gather

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
QUEUE_KEYS = ("image_queue", "text_queue", "idx_queue", "queue_ptr", "valid_queue")


class ALBEF_Retrieval(ImageTextModel, FeatureQueue):  # noqa: N801 (ALBEF's naming)
    """Retrieval model: ViT + split BERT (no MLM head), ITC projections, ITM head, momentum copies, queues.

    Parameter names are ALBEF's retrieval model's: visual_encoder, text_encoder.bert, vision_proj,
    text_proj, temp, itm_head, their *_m momentum copies, and the buffers image_queue, text_queue,
    idx_queue, queue_ptr. The queues are inherited from FeatureQueue (rather than held as a
    submodule) precisely so that those buffers sit at the top level under ALBEF's names. One buffer
    is ours: valid_queue (1, K) bool, False for a queued column that came from a bad sample
    (dataset.bad_samples); such a column never competes in the ITC softmax. A checkpoint saved
    before valid_queue existed loads with every column valid.

    The momentum copies are taken at construction, i.e. from the initial weights (vision_init,
    text_encoder); load a checkpoint afterwards into the online encoders and call copy_momentum()
    for momentum_init 'checkpoint'. Training: queue-based ITC with image-id positives (momentum
    features of the batch + queue on the other side), ITM with hard negatives mined from the ITC
    similarities excluding same-image pairs; no momentum distillation.
    """

    # The losses always reported (an exact zero when switched off): objectives.loss_names.
    paper_losses = ("loss_itc", "loss_cons", "loss_itm")

    def __init__(self, config: Any, tokenizer: Any) -> None:
        """Build the model; text weights from config.text_encoder (null: random init).

        config: the resolved retrieval config (training.config.RetrievalConfig); reads embed_dim,
        queue_size, momentum, temp, lambda_cons, itm, itm_negatives, hard_sampling and the encoders' keys
        (momentum_init is the script's: it decides whether to call copy_momentum after loading).
        tokenizer: its length is the vocabulary size.
        """
        # The queues (FeatureQueue, next in the MRO) are made first, then the encoders: ALBEF's order.
        super().__init__(config, tokenizer, mlm_head=False, dim=config.embed_dim, size=config.queue_size)
        self.momentum = config.momentum

        # Momentum copies of the initial weights (paper S.M. D: "the initial model").
        self.visual_encoder_m = copy.deepcopy(self.visual_encoder)
        self.text_encoder_m = copy.deepcopy(self.text_encoder)
        self.vision_proj_m = copy.deepcopy(self.vision_proj)
        self.text_proj_m = copy.deepcopy(self.text_proj)
        # The copies only run under no_grad: there is no backward for checkpointing to save memory for.
        self.visual_encoder_m.set_grad_checkpointing(False)
        self.text_encoder_m.set_grad_checkpointing(False)
        self.momentum_pairs = MomentumPairs.build([
            (self.visual_encoder, self.visual_encoder_m),
            (self.text_encoder, self.text_encoder_m),
            (self.vision_proj, self.vision_proj_m),
            (self.text_proj, self.text_proj_m),
        ])
        # The initial random columns count as valid: ALBEF contrasts against them as real negatives,
        # and valid=None must compute exactly what the model computed before bad samples existed.
        self.register_buffer("valid_queue", torch.ones(1, self.size, dtype=torch.bool))
        self.objectives = build_objectives(config, self.paper_losses)

    def _load_from_state_dict(self, state_dict: dict[str, Tensor], prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        # A checkpoint with queues but no valid_queue predates bad samples: every queued column was
        # a real pair (as BatchNorm fills in num_batches_tracked for checkpoints older than it).
        # load_state_dict passes its own copy of the caller's dict, made so that modules may add keys.
        key, idx_key = prefix + "valid_queue", prefix + "idx_queue"
        if key not in state_dict and idx_key in state_dict:
            state_dict[key] = torch.ones(state_dict[idx_key].shape, dtype=torch.bool)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def copy_momentum(self) -> None:
        """Momentum copies <- online weights (momentum_init 'checkpoint', after loading the checkpoint)."""
        self.momentum_pairs.copy_()

    @torch.no_grad()
    def enqueue(self, image_feat: Tensor, text_feat: Tensor, idx: Tensor,
                valid: Tensor | None = None) -> None:
        """FeatureQueue.enqueue, and valid (B,) bool (None: all valid) of all ranks into valid_queue.

        The validity is gathered even when valid is None: ranks decide None on their own batches, and
        every rank must run the same collectives (and learn of the other ranks' bad samples).
        """
        ptr = self.queue_ptr.clone()
        super().enqueue(image_feat, text_feat, idx)
        if valid is None:
            valid = torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
        # uint8 on the wire: not every backend all_gathers bool tensors.
        valid_all = concat_all_gather(valid.to(torch.uint8)).bool()
        cols = (ptr + torch.arange(valid_all.shape[0], device=ptr.device)) % self.size
        self.valid_queue.index_copy_(1, cols, valid_all.view(1, -1).to(self.valid_queue.device))

    @property
    def uses_every_parameter(self) -> bool:
        """False with itm: false (the fusion layers and ITM head get no gradient; DDP must be told)."""
        return self.use_itm

    def forward(self, image: Tensor, text, idx: Tensor,
                valid: Tensor | None = None) -> dict[str, Tensor | None]:
        """image (B,3,H,W), text (tokenizer output (B,L)), idx (B,) image ids -> what the objectives need.

        Returns image_feat, text_feat (B,d) with their graph, temp, the bank (momentum features of the batch,
        then the queue: image_bank, text_bank (B+K,d)), its image-id positives `positive` (B,B+K), the
        queued columns' validity `bank_valid` (K,), `valid`, and with ITM `itm_logits` (3B,2) over the
        negatives mined from the in-batch block (neg_text_idx, neg_image_idx (B,)). The momentum update
        and the enqueue happen here. Losses: models.losses (WithObjectives runs both).

        valid (B,) bool marks bad samples (False; dataset.bad_samples): their rows are left out of
        both losses, their columns never compete in the ITC softmax nor are mined as ITM negatives,
        and their momentum features enter the queue marked invalid (valid_queue), so no later step
        contrasts against them. None: every sample of this batch is good; the result is then exactly
        the one of the model before bad samples existed as long as the queue holds none either.
        """
        input_ids, attention_mask = text.input_ids, text.attention_mask
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
        out = {"image_feat": image_feat, "text_feat": text_feat, "temp": self.temp, "image_bank": image_bank,
               "text_bank": text_bank, "positive": positive, "bank_valid": self.valid_queue[0].clone(),
               "valid": valid, "itm_logits": None, "neg_text_idx": None, "neg_image_idx": None}
        self.enqueue(image_feat_m, text_feat_m, idx, valid)
        if self.use_itm:
            out |= self.itm_outputs(image_embeds, text_embeds, attention_mask, (image_feat, text_feat),
                                    (image_feat_m, text_feat_m), positive[:, :idx.shape[0]], valid)
        return out

    def itm_outputs(self, image_embeds: Tensor, text_embeds: Tensor, attention_mask: Tensor,
                    feats: tuple[Tensor, Tensor], feats_m: tuple[Tensor, Tensor], in_batch: Tensor,
                    valid: Tensor | None = None) -> dict[str, Tensor]:
        """ITM's logits (3B,2) over B positives and 2B negatives mined from the in-batch ITC similarities
        (the ITC projections feats (B,d) each against the momentum ones feats_m, the bank's first B
        columns), and the mined indices (B,) each.

        valid (B,) bool: a bad sample is never mined as a negative (the ITM objective leaves every pair
        with one out of its mean).
        """
        # Hard negatives from the in-batch block of the ITC similarities; every caption of the same
        # image is a positive, never a negative.
        with torch.no_grad():
            sim_i2t = feats[0].detach() @ feats_m[1].t() / self.temp
            sim_t2i = feats[1].detach() @ feats_m[0].t() / self.temp
            neg_text_idx, neg_image_idx = mine_negatives(
                sim_i2t, sim_t2i, positive=in_batch, mode=self.itm_negatives,
                sampling=self.hard_sampling, valid=valid,
            )
        hidden, mask, image_index = self.itm_pairs(text_embeds, attention_mask, neg_text_idx, neg_image_idx)
        return {"itm_logits": self.itm_logits(hidden, mask, image_embeds, image_index),
                "neg_text_idx": neg_text_idx, "neg_image_idx": neg_image_idx}
