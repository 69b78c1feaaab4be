"""Image-text retrieval: the fine-tuning model (queue ITC against a momentum encoder + ITM_hard).

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
from models.momentum import FeatureQueue, MomentumPairs
from models.negatives import mine_negatives
from models.objectives import concat_all_gather, itc_loss

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

    loss_names = ("loss_itc", "loss_cons", "loss_itm")  # forward()'s weighted losses (total_loss sums them)

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

    def itm_loss(self, image_embeds: Tensor, text_embeds: Tensor, attention_mask: Tensor, itc: dict,
                 in_batch: Tensor, valid: Tensor | None = None) -> Tensor:
        """ITM cross-entropy: B positives and 2B negatives mined from itc's in-batch sims (B,B) -> 0-dim.

        valid (B,) bool: a bad sample is never mined as a negative, and every pair with one is left
        out of the mean (itm_pair_weights); None: the plain mean over the 3B pairs.
        """
        batch = text_embeds.shape[0]
        # Hard negatives from the in-batch block of the ITC similarities; every caption of the same
        # image is a positive, never a negative.
        with torch.no_grad():
            neg_text_idx, neg_image_idx = mine_negatives(
                itc["sim_i2t"][:, :batch].detach(), itc["sim_t2i"][:, :batch].detach(), positive=in_batch,
                mode=self.itm_negatives, sampling=self.hard_sampling, valid=valid,
            )
        return self.itm_pair_loss(image_embeds, text_embeds, attention_mask, neg_text_idx, neg_image_idx,
                                  valid)

    def forward(self, image: Tensor, text, idx: Tensor, valid: Tensor | None = None) -> dict[str, Tensor]:
        """image (B,3,H,W), text (tokenizer output (B,L)), idx (B,) image ids -> losses (0-dim) and feats.

        valid (B,) bool marks bad samples (False; dataset.bad_samples): their rows are left out of
        both losses, their columns never compete in the ITC softmax nor are mined as ITM negatives,
        and their momentum features enter the queue marked invalid (valid_queue), so no later step
        contrasts against them. None: every sample of this batch is good; the result is then exactly
        the one of the model before bad samples existed as long as the queue holds none either.
        """
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
        itc = self._queue_itc(image_feat, text_feat, image_bank, text_bank, positive, valid)
        self.enqueue(image_feat_m, text_feat_m, idx, valid)

        loss_itm = self.itm_loss(image_embeds, text_embeds, attention_mask, itc, positive[:, :batch], valid) \
            if self.use_itm else itc["loss_itc"].new_zeros(())
        return {
            "loss_itc": itc["loss_itc"],
            "loss_cons": itc["loss_cons"],
            "loss_itm": loss_itm,
            "image_feat": image_feat.detach(),
            "text_feat": text_feat.detach(),
        }

    def _queue_itc(self, image_feat: Tensor, text_feat: Tensor, image_bank: Tensor, text_bank: Tensor,
                   positive: Tensor, valid: Tensor | None) -> dict[str, Tensor]:
        """itc_loss against the bank (B+K, d): batch columns valid per `valid`, queue ones per valid_queue."""
        def itc(row_valid: Tensor | None, column_valid: Tensor | None = None) -> dict[str, Tensor]:
            return itc_loss(image_feat, text_feat, self.temp, self.lambda_cons, positive=positive,
                            image_bank=image_bank, text_bank=text_bank, valid=row_valid,
                            valid_columns=column_valid)

        if valid is not None:
            return itc(valid, torch.cat([valid, self.valid_queue[0]]))
        # A good batch may still face bad samples queued by earlier steps, on any rank. Whether the
        # queue holds one is known only on the device, and asking the host would stall every step, so
        # both losses are computed and the device picks: the plain one (the exact pre-bad-sample
        # result, and gradient: the other branch gets exact zeros) while the queue is clean, the
        # masked one otherwise. The extra cost is one (B, B+K) softmax pair, small next to the encoders.
        plain = itc(None)
        ones = torch.ones_like(positive[:, 0])
        masked = itc(ones, torch.cat([ones, self.valid_queue[0]]))
        clean = self.valid_queue.all()
        return {**plain, "loss_itc": torch.where(clean, plain["loss_itc"], masked["loss_itc"]),
                "loss_cons": torch.where(clean, plain["loss_cons"], masked["loss_cons"])}
