"""ALBEF_Base: ALBEF without the momentum model. Its forward returns what ITC(+consistency), ITM_hard and MLM
(paper Eq. 7) need; the losses themselves are models.losses' objectives, composed from the config."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from models.dual_encoder import ImageTextModel
from models.false_negatives import caption_keys, false_negative_mask, odd_constants
from models.losses import build_objectives
from models.mlm import mask_tokens, mlm_capacity, select_masked
from models.negatives import hardest_negative_similarity, mine_negatives
from models.objectives import concat_all_gather
from models.vit import patch_dropout


class ALBEF_Base(ImageTextModel):  # noqa: N801 (the paper's name)
    """ViT image encoder, split BERT (text + fusion encoder, MLM head), ITC projections, ITM head, and the
    config's objectives (models.losses) as the submodule `objectives`."""

    # The paper's losses, always reported (an exact zero when switched off); objectives.loss_names adds
    # any other objective's after them. The logs, tools.step_bench and demo.py read them.
    paper_losses = ("loss_itc", "loss_cons", "loss_itm", "loss_mlm")

    def __init__(self, config: Any, tokenizer: Any) -> None:
        """Build the model; text weights from config.text_encoder (null: random init).

        config: the resolved pre-training config (training.config.PretrainConfig); reads itc, itm, mlm,
        itm_negatives, hard_sampling, itc_gather, guard_false_negatives, mlm_probability, mlm_masked_only,
        share_image_kv, itm_cls_only, share_caption_attention, image_token_drop, unmasked_epochs, max_epoch,
        embed_dim, temp, the encoders' keys and what the objectives read (lambda_cons, contrastive_loss,
        itc_hn_beta, itc_smoothing(_epoch)).
        tokenizer: vocabulary size and MLM special tokens.
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
        self.mlm_masked_only = config.mlm_masked_only
        # ITM's three pairs of a sample share captions, and the first fusion layer's self-attention reads the
        # caption alone: it runs once per caption (not in ALBEF; with share_image_kv, whose one fusion pass
        # it shares). The same numbers; in training with dropout, pairs of one caption share that
        # sub-layer's dropout draw.
        self.share_caption_attention = config.share_caption_attention

        self.vocab_size = self.text_encoder.config.vocab_size
        self.mask_token_id = tokenizer.mask_token_id
        # ALBEF never masks [PAD] or [CLS]; [SEP] stays maskable.
        self.special_ids = [tokenizer.pad_token_id, tokenizer.cls_token_id]
        # FLIP's image-token dropout (Li et al. 2023; not in the paper): timm's PatchDropout, right after
        # the positional embeddings, keeps [CLS] and a fresh random subset of a fixed size of each image's
        # patches (static shapes for compile and CUDA graphs). The step encodes the image once, so ITC, ITM
        # and MLM see the same kept tokens, and GRIT collects the CLS projections of this masked forward.
        # It acts in training mode only: evaluation and the eval-mode feature passes see every token. Its
        # draws come from the global generator, which checkpoints save or reseed, so resuming is exact. 0:
        # timm's nn.Identity, the paper's step.
        self.image_token_drop = config.image_token_drop
        self.masked_epochs = config.max_epoch - config.unmasked_epochs  # then FLIP's unmasked tuning
        if self.image_token_drop:
            self.visual_encoder.patch_drop = patch_dropout(self.visual_encoder, self.image_token_drop)
        # Last: parameters an objective learns (SigLIP's) come after the encoders' in the model's order.
        self.objectives = build_objectives(config, self.paper_losses)

    def start_epoch(self, epoch: int) -> None:
        """The epoch's settings: the objectives' (S-ITC's start) and, in the last unmasked_epochs, every
        image token (image_token_drop off)."""
        self.objectives.start_epoch(epoch)
        if self.image_token_drop:
            self.visual_encoder.patch_drop.prob = self.image_token_drop if epoch < self.masked_epochs else 0.0

    @torch.no_grad()
    def contrastive_logits(self, image: Tensor, text: Any,
                           image_key: Tensor | None = None) -> tuple[Tensor, str]:
        """image (K,3,H,W), text (tokenizer output (K,L)), image_key (K,) with the false-negative guard ->
        (the in-batch ITC logits (K,K) fp32 of image i against text j, the loss they belong to): 'sigmoid',
        t x similarity + b, with contrastive_loss sigmoid; else 'softmax', similarity / temp. In eval mode
        (every image token, no dropout), as online batch selection scores a super-batch (grit.online).
        With guard_false_negatives, the pairs the guard makes positives (same image or identical caption,
        off the diagonal) are -inf: neither negatives nor positives of the scoring losses."""
        was_training = self.training
        self.eval()
        try:
            image_feat, text_feat = self.unimodal_features(image, text)
        finally:
            self.train(was_training)
        with torch.autocast(image_feat.device.type, enabled=False):  # fp32 scores under a bf16 step
            similarity = image_feat.float() @ text_feat.float().t()
            if "sigmoid" in self.objectives:
                sigmoid = self.objectives["sigmoid"]
                logits, kind = similarity * sigmoid.log_scale.float().exp() + sigmoid.bias.float(), "sigmoid"
            else:
                logits, kind = similarity / self.temp.float(), "softmax"
        if self.guard_false_negatives and image_key is not None:
            text_key = caption_keys(text.input_ids.masked_fill(text.attention_mask == 0, 0),
                                    self.caption_constants)
            same = false_negative_mask(image_key.to(text_key.device, torch.int64), text_key)
            same.fill_diagonal_(False)
            logits = logits.masked_fill(same, float("-inf"))
        return logits, kind

    @property
    def uses_every_parameter(self) -> bool:
        """False when an objective is switched off or replaced: its modules get no gradient (DDP must be
        told)."""
        return self.use_itc and self.use_itm and self.use_mlm and not self.objectives.replaced

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

    def mlm_outputs(self, hidden: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """Fused states (B,L,H), labels (B,L) -> {'mlm_logits' (R,V), 'mlm_labels' (R,)} for the MLM loss.

        mlm_masked_only: vocabulary logits only for a fixed-size selection of R rows holding every masked
        token (models.mlm.select_masked; a data-dependent hidden[labels != -100] would sync the host
        every step). Off (ALBEF): logits at every position (R = B*L), the masked ones used.
        """
        if self.mlm_masked_only:
            # [CLS] (each row's first token) is never masked: B*(L-1) positions can be.
            maskable = labels.numel() - labels.shape[0]
            positions, labels = select_masked(labels, mlm_capacity(maskable, self.mlm_probability))
            hidden = hidden.flatten(0, 1).index_select(0, positions)
        else:
            hidden, labels = hidden.flatten(0, 1), labels.flatten()
        return {"mlm_logits": self.text_encoder.mlm_logits(hidden), "mlm_labels": labels}

    @torch.no_grad()
    def mine(self, image_feat: Tensor, text_feat: Tensor, positive: Tensor | None,
             valid: Tensor | None) -> dict[str, Tensor | None]:
        """ITC projections (B,d), the guard's mining positives (B,B) -> the batch's hardness both ways and,
        with ITM, its mined negatives: neg_text_idx (B,) (text of image i), neg_image_idx (B,) (image of
        text i).

        Mining happens in the local batch (GRIT puts similar pairs there); the local block of the (possibly
        gathered) ITC similarities is just the local cosine matrix over the temperature. Bad samples are
        neither anchors nor negatives.
        """
        cosine = image_feat.detach() @ text_feat.detach().t()
        excluded = positive
        if valid is not None:
            excluded = ~(valid[:, None] & valid[None, :])
            if positive is not None:
                excluded = excluded | positive
        found = {"hardness": hardest_negative_similarity(cosine, excluded),
                 # the same from the captions' side: each text's hardest in-batch image negative
                 "hardness_t2i": hardest_negative_similarity(cosine.t(), None if excluded is None
                                                             else excluded.t()),
                 "neg_text_idx": None, "neg_image_idx": None}
        if valid is not None:  # at most one good sample: no negative to measure; logged as 0
            for key in ("hardness", "hardness_t2i"):
                found[key] = torch.nan_to_num(found[key], nan=0.0)
        if self.use_itm:
            logits_i2t = cosine / self.temp
            found["neg_text_idx"], found["neg_image_idx"] = mine_negatives(
                logits_i2t, logits_i2t.t(), positive, mode=self.itm_negatives, sampling=self.hard_sampling,
                valid=valid)
        return found

    def forward(self, image: Tensor, text, image_key: Tensor | None = None,
                valid: Tensor | None = None) -> dict[str, Tensor | None]:
        """image (B,3,H,W), text (tokenizer output, (B,L)), image_key (B,) int -> what the objectives need.

        Returns image_feat, text_feat (B,d) with their graph (detach them for GRIT's queues), temp, the
        guard's ITC positives `positive` (B,N) (None without it), `valid`, the batch's hardness both ways,
        and with ITM its mined negatives and `itm_logits` (3B,2) in itm_pairs' order, with MLM `mlm_logits`
        (R,V) and `mlm_labels` (R,). Losses: models.losses (WithObjectives runs both).

        image_key (e.g. PretrainDataset.image_keys[idx]) is needed with guard_false_negatives and
        ignored without it. valid (B,) bool marks bad samples (False; dataset.bad_samples): they are
        left out of every loss and never mined as negatives. None (every sample good) computes
        exactly what the paper's code does.

        share_image_kv: the plain and the masked captions go through the text layers in one pass, and
        ITM's 3B pairs and MLM's B captions through the fusion layers in one pass whose cross-attention
        keys and values are computed once per image. Off: ALBEF's passes (text; ITM fusion; MLM text and
        fusion), in ALBEF's order. The outputs are the same; only dropout draws its masks in another order.
        """
        # Item access works for a BatchEncoding and for a plain dict.
        input_ids, attention_mask = text["input_ids"], text["attention_mask"]
        batch = input_ids.shape[0]
        image_embeds = self.encode_image(image)
        mlm = None
        if self.share_image_kv and self.use_mlm:
            masked_ids, mlm_labels = self._mask(input_ids, valid)
            text_embeds, mlm_text = self.encode_text(torch.cat([input_ids, masked_ids]),
                                                     attention_mask.repeat(2, 1)).split(batch)
            mlm = (mlm_text, mlm_labels)
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
        out = {"image_feat": image_feat, "text_feat": text_feat, "temp": self.temp, "positive": positive_itc,
               "valid": valid, **self.mine(image_feat, text_feat, positive_mining, valid), "itm_logits": None}
        fuse = self._fuse_shared if self.share_image_kv else self._fuse_separate
        return out | fuse(image_embeds, input_ids, text_embeds, attention_mask, out, mlm, valid)

    def _fuse_shared(self, image_embeds: Tensor, input_ids: Tensor, text_embeds: Tensor,
                     attention_mask: Tensor, out: dict, mlm: tuple[Tensor, Tensor] | None,
                     valid: Tensor | None) -> dict[str, Tensor]:
        """share_image_kv: ITM's 3B pairs and MLM's B masked captions in one fusion pass -> their outputs."""
        if not (self.use_itm or self.use_mlm):
            return {}
        batch = input_ids.shape[0]
        own = torch.arange(batch, device=input_ids.device)
        text_index = None
        if self.use_itm and self.share_caption_attention:
            # The B captions (and the B masked ones) once each; every row names its caption, so the first
            # fusion layer's self-attention runs on 2B texts, not 4B rows (ITM's three pairs share captions).
            texts = [text_embeds] + ([mlm[0]] if self.use_mlm else [])
            rows, masks = torch.cat(texts), attention_mask.repeat(len(texts), 1)
            text_index, images = self.itm_pair_index(out["neg_text_idx"], out["neg_image_idx"])
            if self.use_mlm:  # MLM's rows: the masked captions, each with its own image
                text_index, images = torch.cat([text_index, own + batch]), torch.cat([images, own])
        else:
            rows, masks, images = [], [], []
            if self.use_itm:
                pairs = self.itm_pairs(text_embeds, attention_mask, out["neg_text_idx"], out["neg_image_idx"])
                rows, masks, images = [pairs[0]], [pairs[1]], [pairs[2]]
            if self.use_mlm:
                rows.append(mlm[0])
                masks.append(attention_mask)
                images.append(own)
            rows, masks, images = torch.cat(rows), torch.cat(masks), torch.cat(images)
        itm_rows = 3 * batch if self.use_itm else 0
        if itm_rows and self.itm_cls_only:  # ITM's rows at [CLS] only in the last layer; MLM's at all
            itm_cls, fused = self.fuse(rows, masks, image_embeds, images, cls_rows=itm_rows,
                                       text_index=text_index)
        else:
            fused = self.fuse(rows, masks, image_embeds, images, text_index=text_index)
            itm_cls, fused = fused[:itm_rows, 0], fused[itm_rows:]
        found = {}
        if self.use_itm:
            found["itm_logits"] = self.itm_head(itm_cls)
        if self.use_mlm:
            found |= self.mlm_outputs(fused, mlm[1])
        return found

    def _fuse_separate(self, image_embeds: Tensor, input_ids: Tensor, text_embeds: Tensor,
                       attention_mask: Tensor, out: dict, mlm: None,
                       valid: Tensor | None) -> dict[str, Tensor]:
        """ALBEF's passes: ITM's fusion, then MLM's masking, text and fusion passes -> ITM / MLM outputs."""
        found = {}
        if self.use_itm:
            pairs = self.itm_pairs(text_embeds, attention_mask, out["neg_text_idx"], out["neg_image_idx"])
            found["itm_logits"] = self.itm_logits(*pairs[:2], image_embeds, pairs[2])
        if self.use_mlm:
            masked_ids, mlm_labels = self._mask(input_ids, valid)
            hidden = self.text_encoder(masked_ids, attention_mask, mode="multimodal",
                                       encoder_hidden_states=image_embeds)
            found |= self.mlm_outputs(hidden, mlm_labels)
        return found


__all__ = ["ALBEF_Base"]
