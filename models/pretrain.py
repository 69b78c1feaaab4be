"""ALBEF_Base: ALBEF without the momentum model; ITC(+consistency) + ITM_hard + MLM (paper Eq. 7)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.dual_encoder import ImageTextModel
from models.false_negatives import caption_keys, false_negative_mask, odd_constants
from models.mlm import mask_tokens, mlm_capacity, select_masked
from models.negatives import hardest_negative_similarity, mine_negatives
from models.objectives import concat_all_gather, itc_loss


class ALBEF_Base(ImageTextModel):  # noqa: N801 (the paper's name)
    """ViT image encoder, split BERT (text + fusion encoder, MLM head), ITC projections, ITM head."""

    # The losses forward() returns, each weighted (loss_cons by lambda_cons): models.objectives.total_loss
    # sums them; the logs, tools.step_bench and demo.py read the names from here.
    loss_names = ("loss_itc", "loss_cons", "loss_itm", "loss_mlm")

    def __init__(self, config: Any, tokenizer: Any) -> None:
        """Build the model; text weights from config.text_encoder (null: random init).

        config: the resolved pre-training config (training.config.PretrainConfig); reads itc, itm, mlm,
        itm_negatives, hard_sampling, lambda_cons, itc_gather, guard_false_negatives, mlm_probability,
        mlm_masked_only, itc_hn_beta, itc_smoothing(_epoch), share_image_kv, embed_dim, temp and the
        encoders' keys. tokenizer: vocabulary size and MLM special tokens.
        """
        super().__init__(config, tokenizer, mlm_head=True)
        self.use_itc = config.itc
        # itm and mlm false (with itc true): the dual encoder of Table 5, trained with ITC alone; the
        # fusion layers and heads are then built but never run (their losses are exact zeros).
        self.use_mlm = config.mlm
        self.itc_gather = config.itc_gather
        # In-batch false negatives: ALBEF's COCO/VG files hold one entry per caption, so GRIT, which
        # groups similar pairs, often puts several entries of one image (or a verbatim-repeated
        # caption) into one batch, and the hardest "negative" is then a true match. The guard treats
        # same image OR identical caption as positives: multi-positive ITC targets (as MAFA) and never
        # an ITM negative (BLIP masks same-image pairs). Off: the authors' computation, bit for bit.
        self.guard_false_negatives = config.guard_false_negatives
        # The caption keys' per-position constants, made once here (a buffer, not saved): inside a compiled
        # step inductor folded the table's 64-bit arithmetic into an int32 index and failed on CUDA.
        positions = self.text_encoder.config.max_position_embeddings
        self.register_buffer("caption_constants", odd_constants(positions), persistent=False)
        self.mlm_probability = config.mlm_probability
        # Loss-side switches (not in GRIT-VLP; 0 = the paper's ITC): HN-NCE's beta and MAFA's S-ITC, whose
        # smoothing starts at epoch itc_smoothing_epoch (start_epoch).
        self.itc_hn_beta = config.itc_hn_beta
        self.itc_smoothing_value, self.itc_smoothing_epoch = config.itc_smoothing, config.itc_smoothing_epoch
        self.itc_smoothing = 0.0 if config.itc_smoothing_epoch else config.itc_smoothing
        self.mlm_masked_only = config.mlm_masked_only

        self.vocab_size = self.text_encoder.config.vocab_size
        self.mask_token_id = tokenizer.mask_token_id
        # ALBEF never masks [PAD] or [CLS]; [SEP] stays maskable.
        self.special_ids = [tokenizer.pad_token_id, tokenizer.cls_token_id]

    def start_epoch(self, epoch: int) -> None:
        """Per-epoch settings of the losses: S-ITC's smoothing from epoch itc_smoothing_epoch on."""
        self.itc_smoothing = self.itc_smoothing_value if epoch >= self.itc_smoothing_epoch else 0.0

    @property
    def uses_every_parameter(self) -> bool:
        """False when an objective is switched off: its modules get no gradient (DDP must be told)."""
        return self.use_itc and self.use_itm and self.use_mlm

    @torch.no_grad()
    def false_negative_masks(
        self, image_key: Tensor, input_ids: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """image_key (B,), ids/mask (B,L) -> bool positives for ITC (B,N) and for ITM mining (B,B).

        ITC positives span the gathered columns with itc_gather (N = W*B), else N = B. Mining
        positives are the local ones, except that an item positive with the whole batch (e.g. a
        batch of one image) is unguarded in its row and column (only the diagonal stays excluded),
        so every image and text keeps an in-batch negative.
        """
        if image_key.shape != input_ids.shape[:1]:
            raise ValueError(
                f"image_key must be ({input_ids.shape[0]},), one key per pair, got {tuple(image_key.shape)}"
            )
        # Zeroing the padding makes the keys independent of the tokenizer's pad id.
        text_key = caption_keys(input_ids.masked_fill(attention_mask == 0, 0), self.caption_constants)
        image_key = image_key.to(device=input_ids.device, dtype=torch.int64)
        local = false_negative_mask(image_key, text_key)
        positive_itc = local
        if self.itc_gather:
            positive_itc = false_negative_mask(
                image_key, text_key, concat_all_gather(image_key), concat_all_gather(text_key)
            )
        eye = torch.eye(local.shape[0], dtype=torch.bool, device=local.device)
        full_row = (local | eye).all(dim=1)
        # The mask is symmetric: dropping both the row and the column keeps a negative for every
        # image and every text (mine_negatives checks both sides).
        positive_mining = local & ~full_row[:, None] & ~full_row[None, :]
        return positive_itc, positive_mining

    def _mask(self, input_ids: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
        """BERT masking of ids (B,L) -> (masked ids (B,L), labels (B,L), -100 where not predicted)."""
        masked_ids, labels = mask_tokens(
            input_ids.clone(), self.vocab_size, self.mask_token_id, self.special_ids, self.mlm_probability
        )
        if valid is not None:  # a bad sample's tokens are never predicted
            labels = labels.masked_fill(~valid[:, None], -100)
        return masked_ids, labels

    def mlm_criterion(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """MLM cross-entropy of fused states (B,L,H) over the masked tokens of labels (B,L) -> 0-dim.

        mlm_masked_only: vocabulary logits only for a fixed-size selection holding every masked token
        (models.mlm.select_masked; a data-dependent hidden[labels != -100] would sync the host
        every step). Off (ALBEF): logits at every position, the masked half used. Summing and dividing by
        a clamped count keeps the loss finite when nothing was masked.
        """
        if self.mlm_masked_only:
            positions, labels = select_masked(labels, mlm_capacity(labels.numel(), self.mlm_probability))
            hidden = hidden.flatten(0, 1).index_select(0, positions)
        else:
            hidden, labels = hidden.flatten(0, 1), labels.flatten()
        loss_sum = F.cross_entropy(self.text_encoder.mlm_logits(hidden), labels, ignore_index=-100,
                                   reduction="sum")
        return loss_sum / (labels != -100).sum().clamp(min=1)

    def forward(self, image: Tensor, text, image_key: Tensor | None = None,
                valid: Tensor | None = None) -> dict[str, Tensor]:
        """image (B,3,H,W), text (tokenizer output, (B,L)), image_key (B,) int -> losses (0-dim), feats (B,d).

        image_key (e.g. PretrainDataset.image_keys[idx]) is needed with guard_false_negatives and
        ignored without it. valid (B,) bool marks bad samples (False; dataset.bad_samples): they are
        left out of every loss and never mined as negatives. None (every sample good) computes
        exactly what the paper's code does.

        share_image_kv: the plain and the masked captions go through the text layers in one pass, and
        ITM's 3B pairs and MLM's B captions through the fusion layers in one pass whose cross-attention
        keys and values are computed once per image. Off: ALBEF's passes (text; ITM fusion; MLM text and
        fusion), in ALBEF's order. The losses are the same; only dropout draws its masks in another order.
        """
        # Item access works for a BatchEncoding and for a plain dict.
        input_ids, attention_mask = text["input_ids"], text["attention_mask"]
        batch = input_ids.shape[0]
        shared = self.share_image_kv

        image_embeds = self.encode_image(image)
        if shared and self.use_mlm:
            masked_ids, mlm_labels = self._mask(input_ids, valid)
            text_embeds, mlm_text = self.encode_text(torch.cat([input_ids, masked_ids]),
                                                     attention_mask.repeat(2, 1)).split(batch)
        else:
            text_embeds = self.encode_text(input_ids, attention_mask)
        image_feat, text_feat = self.project(image_embeds, text_embeds)

        # None everywhere without the guard: exactly the authors' one-hot ITC and diagonal-only mining.
        positive_itc = positive_mining = None
        if self.guard_false_negatives:
            if image_key is None:
                raise ValueError(
                    "config key 'guard_false_negatives' is true but forward() got no image_key "
                    "(pass image_key=dataset.image_keys[idx], or set guard_false_negatives: false)"
                )
            positive_itc, positive_mining = self.false_negative_masks(image_key, input_ids, attention_mask)

        zero = image_feat.new_zeros(())
        if self.use_itc:
            valid_itc = valid
            if self.itc_gather and valid is None:
                # Every rank gathers the flags when any rank may hold a bad sample: a rank that skipped
                # the all_gather would desynchronise the collectives (our extension, not the paper's).
                valid_itc = torch.ones(image_feat.shape[0], dtype=torch.bool, device=image_feat.device)
            itc = itc_loss(image_feat, text_feat, self.temp, self.lambda_cons,
                           positive=positive_itc, gather=self.itc_gather, valid=valid_itc,
                           hn_beta=self.itc_hn_beta, smoothing=self.itc_smoothing)
            loss_itc, loss_cons = itc["loss_itc"], itc["loss_cons"]
        else:
            loss_itc, loss_cons = zero, zero

        # Mining happens in the local batch (GRIT puts similar pairs there); the local block of the
        # (possibly gathered) ITC similarities is just the local cosine matrix over the temperature.
        with torch.no_grad():
            cosine = image_feat.detach() @ text_feat.detach().t()
            excluded = positive_mining
            if valid is not None:  # bad samples are neither anchors nor negatives
                excluded = ~(valid[:, None] & valid[None, :])
                if positive_mining is not None:
                    excluded = excluded | positive_mining
            hardness = hardest_negative_similarity(cosine, excluded)
            # the same from the captions' side: each text's hardest in-batch image negative
            hardness_t2i = hardest_negative_similarity(cosine.t(), None if excluded is None else excluded.t())
            if valid is not None:  # at most one good sample: no negative to measure; logged as 0
                hardness = torch.nan_to_num(hardness, nan=0.0)
                hardness_t2i = torch.nan_to_num(hardness_t2i, nan=0.0)
        if self.use_itm:
            with torch.no_grad():
                logits_i2t = cosine / self.temp
                neg_text_idx, neg_image_idx = mine_negatives(
                    logits_i2t, logits_i2t.t(), positive_mining,
                    mode=self.itm_negatives, sampling=self.hard_sampling, valid=valid,
                )

        loss_itm = loss_mlm = zero
        itm_logits = None
        if shared and (self.use_itm or self.use_mlm):
            rows, masks, images = [], [], []
            if self.use_itm:
                pairs = self.itm_pairs(text_embeds, attention_mask, neg_text_idx, neg_image_idx)
                rows, masks, images = [pairs[0]], [pairs[1]], [pairs[2]]
            if self.use_mlm:
                rows.append(mlm_text)
                masks.append(attention_mask)
                images.append(torch.arange(batch, device=input_ids.device))
            fused = self.fuse(torch.cat(rows), torch.cat(masks), image_embeds, torch.cat(images))
            if self.use_itm:
                itm_logits = self.itm_head(fused[:3 * batch, 0])
            if self.use_mlm:
                loss_mlm = self.mlm_criterion(fused[-batch:], mlm_labels)
        else:
            if self.use_itm:  # itm_pair_loss's one fusion pass, its logits kept for the logged accuracy
                pairs = self.itm_pairs(text_embeds, attention_mask, neg_text_idx, neg_image_idx)
                itm_logits = self.itm_logits(*pairs[:2], image_embeds, pairs[2])
            if self.use_mlm:
                masked_ids, mlm_labels = self._mask(input_ids, valid)
                hidden = self.text_encoder(masked_ids, attention_mask, mode="multimodal",
                                           encoder_hidden_states=image_embeds)
                loss_mlm = self.mlm_criterion(hidden, mlm_labels)
        if self.use_itm:
            loss_itm = self.itm_criterion(itm_logits, neg_text_idx, neg_image_idx, valid)

        return {
            "loss_itc": loss_itc,
            "loss_cons": loss_cons,
            "loss_itm": loss_itm,
            "loss_mlm": loss_mlm,
            # fp32 even under autocast: these feed GRIT's queues.
            "image_feat": image_feat.detach().float(),
            "text_feat": text_feat.detach().float(),
            "hardness": hardness,
            "hardness_t2i": hardness_t2i,
            # the mined ITM negatives (None without ITM): text of image i, image of text i (batch positions)
            "neg_text_idx": neg_text_idx if self.use_itm else None,
            "neg_image_idx": neg_image_idx if self.use_itm else None,
            # ITM's logits (3B, 2) in itm_pairs' order, detached (None without ITM): the logged accuracy
            "itm_logits": None if itm_logits is None else itm_logits.detach(),
        }


__all__ = ["ALBEF_Base"]
