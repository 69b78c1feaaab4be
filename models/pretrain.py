"""ALBEF_Base: ALBEF without the momentum model; ITC(+consistency) + ITM_hard + MLM (paper Eq. 7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.bert import build_text_encoder
from models.false_negatives import caption_keys, false_negative_mask
from models.objectives import (
    concat_all_gather,
    hardest_negative_similarity,
    itc_loss,
    itm_pair_weights,
    mask_tokens,
    masked_mean,
    mine_negatives,
)
from models.vit import build_vision_encoder, check_vision_text_widths

_NEGATIVES = ("hard", "random")
_SAMPLINGS = ("argmax", "multinomial")


class ALBEF_Base(nn.Module):  # noqa: N801 (the paper's name)
    """ViT image encoder, split BERT (text + fusion encoder, MLM head), ITC projections, ITM head."""

    def __init__(self, config: dict, text_encoder: str | None = None, tokenizer=None):
        super().__init__()
        if tokenizer is None:
            raise ValueError(
                "ALBEF_Base needs the tokenizer (for the vocabulary size and MLM special tokens)"
            )
        self.use_itc = bool(config.get("itc", True))
        # itm / mlm false (with itc true): the dual encoder of Table 5, trained with ITC alone; the
        # fusion layers and heads are then built but never run (their losses are exact zeros).
        self.use_itm = bool(config.get("itm", True))
        self.use_mlm = bool(config.get("mlm", True))
        if not (self.use_itc or self.use_itm or self.use_mlm):
            raise ValueError("config: 'itc', 'itm' and 'mlm' are all false: nothing to train")
        self.itm_negatives = config.get("itm_negatives", "hard")
        self.hard_sampling = config.get("hard_sampling", "argmax")
        if self.itm_negatives not in _NEGATIVES:
            raise ValueError(
                f"config key 'itm_negatives' must be one of {_NEGATIVES}, got {self.itm_negatives!r}"
            )
        if self.hard_sampling not in _SAMPLINGS:
            raise ValueError(
                f"config key 'hard_sampling' must be one of {_SAMPLINGS}, got {self.hard_sampling!r}"
            )
        if self.use_itm and not self.use_itc and self.itm_negatives == "hard":
            raise ValueError(
                "config: 'itc: false' with 'itm_negatives: hard' is not supported: hard ITM negatives are "
                "mined from ITC similarities; set itm_negatives: random or enable itc"
            )
        for key in ("embed_dim", "temp"):
            if key not in config:
                raise ValueError(f"config key {key!r} is missing")
        self.lambda_cons = float(config.get("lambda_cons", 0.0))
        self.itc_gather = bool(config.get("itc_gather", False))
        # In-batch false negatives: ALBEF's COCO/VG files hold one entry per caption, so GRIT, which
        # groups similar pairs, often puts several entries of one image (or a verbatim-repeated
        # caption) into one batch, and the hardest "negative" is then a true match. The guard treats
        # same image OR identical caption as positives: multi-positive ITC targets (as MAFA) and never
        # an ITM negative (BLIP masks same-image pairs). Off: the authors' computation, bit for bit.
        self.guard_false_negatives = bool(config.get("guard_false_negatives", False))
        self.mlm_probability = float(config.get("mlm_probability", 0.15))

        self.visual_encoder = build_vision_encoder(config)
        self.text_encoder = build_text_encoder(config, text_encoder, tokenizer, mlm_head=True)
        bert_config = self.text_encoder.config
        check_vision_text_widths(config, bert_config.encoder_width)
        hidden = bert_config.hidden_size
        self.vision_proj = nn.Linear(int(config["vision_width"]), int(config["embed_dim"]))
        self.text_proj = nn.Linear(hidden, int(config["embed_dim"]))
        self.temp = nn.Parameter(torch.tensor(float(config["temp"])))
        self.itm_head = nn.Linear(hidden, 2)

        self.vocab_size = bert_config.vocab_size
        self.mask_token_id = tokenizer.mask_token_id
        # ALBEF never masks [PAD] or [CLS]; [SEP] stays maskable.
        self.special_ids = [tokenizer.pad_token_id, tokenizer.cls_token_id]

    @property
    def uses_every_parameter(self) -> bool:
        """False when an objective is switched off: its modules get no gradient (DDP must be told)."""
        return self.use_itc and self.use_itm and self.use_mlm

    def encode_image(self, image: Tensor) -> Tensor:
        """image (B,3,H,W), already normalised -> tokens (B,1+P,Dv) (final LayerNorm applied)."""
        return self.visual_encoder.forward_features(image)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """input_ids, attention_mask (B,L) -> text-encoder hidden states (B,L,H)."""
        return self.text_encoder(input_ids, attention_mask, mode="text")

    def project(self, image_embeds: Tensor, text_embeds: Tensor) -> tuple[Tensor, Tensor]:
        """Uni-modal states (B,1+P,Dv), (B,L,H) -> L2-normalised ITC projections of the CLS, (B,d) each."""
        image_feat = F.normalize(self.vision_proj(image_embeds[:, 0]), dim=-1)
        text_feat = F.normalize(self.text_proj(text_embeds[:, 0]), dim=-1)
        return image_feat, text_feat

    def itm_logits(self, text_embeds: Tensor, text_mask: Tensor, image_embeds: Tensor) -> Tensor:
        """Pairs: text hidden (B,L,H), mask (B,L), image tokens (B,1+P,Dv) -> ITM logits (B,2) (1 = match)."""
        fused = self.text_encoder(
            mode="fusion", hidden_states=text_embeds, attention_mask=text_mask,
            encoder_hidden_states=image_embeds,
        )
        return self.itm_head(fused[:, 0])

    @torch.no_grad()
    def unimodal_features(self, image: Tensor, text) -> tuple[Tensor, Tensor]:
        """image (B,3,H,W), text (B,L) -> detached ITC projections (B,d) each, fp32 (GRIT's naive pass)."""
        image_feat, text_feat = self.project(self.encode_image(image),
                                             self.encode_text(text.input_ids, text.attention_mask))
        return image_feat.float(), text_feat.float()

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
        text_key = caption_keys(input_ids.masked_fill(attention_mask == 0, 0))
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

    def _itm_loss(self, image_embeds: Tensor, text_embeds: Tensor, attention_mask: Tensor,
                  neg_text_idx: Tensor, neg_image_idx: Tensor, valid: Tensor | None = None) -> Tensor:
        """ITM cross-entropy over B positives and 2B mined negatives (image tokens, text states, (B,) idx);
        with valid (B,) bool, pairs with a bad sample are left out."""
        batch = text_embeds.shape[0]
        # One fusion pass over [positives, (image, negative text), (negative image, text)].
        itm_logits = self.itm_logits(
            torch.cat([text_embeds, text_embeds[neg_text_idx], text_embeds]),
            torch.cat([attention_mask, attention_mask[neg_text_idx], attention_mask]),
            torch.cat([image_embeds, image_embeds, image_embeds[neg_image_idx]]),
        )
        itm_labels = torch.cat(
            [
                torch.ones(batch, dtype=torch.long, device=itm_logits.device),
                torch.zeros(2 * batch, dtype=torch.long, device=itm_logits.device),
            ]
        )
        if valid is None:
            return F.cross_entropy(itm_logits, itm_labels)
        return masked_mean(F.cross_entropy(itm_logits, itm_labels, reduction="none"),
                           itm_pair_weights(valid, neg_text_idx, neg_image_idx))

    def _mlm_loss(self, image_embeds: Tensor, input_ids: Tensor, attention_mask: Tensor,
                  valid: Tensor | None = None) -> Tensor:
        """MLM cross-entropy of the fusion encoder over the masked tokens of input_ids (B,L), 0-dim."""
        masked_ids, labels = mask_tokens(
            input_ids.clone(), self.vocab_size, self.mask_token_id, self.special_ids, self.mlm_probability
        )
        if valid is not None:  # a bad sample's tokens are never predicted
            labels = labels.masked_fill(~valid[:, None], -100)
        hidden = self.text_encoder(
            masked_ids, attention_mask, mode="multimodal", encoder_hidden_states=image_embeds
        )
        # Logits at every position instead of only the masked ones: selecting hidden[labels != -100]
        # has a data-dependent shape (a host sync per step). With the paper's 50 % masking at most
        # ~2x of the head's work is wasted, which is cheaper than stalling the pipeline. Summing and
        # dividing by a clamped count keeps the loss finite when nothing was masked.
        mlm_logits = self.text_encoder.mlm_logits(hidden)
        loss_sum = F.cross_entropy(
            mlm_logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        return loss_sum / (labels != -100).sum().clamp(min=1)

    def forward(self, image: Tensor, text, image_key: Tensor | None = None,
                valid: Tensor | None = None) -> dict[str, Tensor]:
        """image (B,3,H,W), text (tokenizer output, (B,L)), image_key (B,) int -> losses (0-dim), feats (B,d).

        image_key (e.g. PretrainDataset.image_keys[idx]) is needed with guard_false_negatives and
        ignored without it. valid (B,) bool marks bad samples (False; dataset.bad_samples): they are
        left out of every loss and never mined as negatives. None (every sample good) computes
        exactly what the paper's code does.
        """
        with torch.no_grad():
            self.temp.clamp_(0.001, 0.5)
        # Item access works for a BatchEncoding and for a plain dict.
        input_ids, attention_mask = text["input_ids"], text["attention_mask"]

        image_embeds = self.encode_image(image)
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
                           positive=positive_itc, gather=self.itc_gather, valid=valid_itc)
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
            if valid is not None:  # at most one good sample: no negative to measure; logged as 0
                hardness = torch.nan_to_num(hardness, nan=0.0)
        loss_itm = zero
        if self.use_itm:
            with torch.no_grad():
                logits_i2t = cosine / self.temp
                neg_text_idx, neg_image_idx = mine_negatives(
                    logits_i2t, logits_i2t.t(), positive_mining,
                    mode=self.itm_negatives, sampling=self.hard_sampling, valid=valid,
                )
            loss_itm = self._itm_loss(image_embeds, text_embeds, attention_mask, neg_text_idx, neg_image_idx,
                                      valid)
        loss_mlm = self._mlm_loss(image_embeds, input_ids, attention_mask, valid) if self.use_mlm else zero

        return {
            "loss_itc": loss_itc,
            "loss_cons": loss_cons,
            "loss_itm": loss_itm,
            "loss_mlm": loss_mlm,
            # fp32 even under autocast: these feed GRIT's queues.
            "image_feat": image_feat.detach().float(),
            "text_feat": text_feat.detach().float(),
            "hardness": hardness,
        }


__all__ = ["ALBEF_Base"]
