"""Retrieval evaluation across ranks, as ALBEF: every rank encodes the whole split, the ITC top-k candidates
agree across ranks, the ranks share the ITM re-ranking and sum it. Its collectives go through
training.distributed; the ranking and the recalls are models.retrieval_eval's.

Bad samples (dataset.bad_samples): an image that cannot be read is no candidate and its captions are no
queries; an image left without captions is neither (models.retrieval_eval.good_subset).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from models.retrieval import ALBEF_Retrieval
from models.retrieval_eval import good_subset, rerank_topk
from training.distributed import (
    all_reduce_min,
    broadcast_from_main,
    get_rank,
    get_world_size,
    is_dist,
    reduce_sum,
)

__all__ = ["compute_itr_scores", "encode_eval_set"]


def _agree(valid: Tensor, device: torch.device) -> Tensor:
    """valid (N,) bool AND-ed over ranks: a file one rank failed to read is dropped on all, so the
    candidate sets, and the shapes of the collectives that follow, agree."""
    if not is_dist():
        return valid
    return all_reduce_min(valid.to(device, torch.int32)).bool().cpu()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, amp: bool):
    """bf16/fp16 autocast on CUDA when amp is set; a disabled context elsewhere (CPU evaluates in fp32)."""
    enabled = amp and device.type == "cuda"
    dtype = torch.bfloat16 if enabled and torch.cuda.is_bf16_supported() else torch.float16
    return torch.autocast(device.type, dtype=dtype, enabled=enabled)


@torch.no_grad()
def encode_eval_set(model: ALBEF_Retrieval, image_loader, texts: Sequence[str], tokenizer,
                    device: torch.device, text_batch_size: int = 256, max_tokens: int = 40,
                    amp: bool = False, txt2img: Sequence[int] | dict[int, int] | Tensor | None = None
                    ) -> dict[str, Tensor | list[str] | None]:
    """The good images and texts of an evaluation split, on every rank (as ALBEF); collective.

    image_loader yields batches with .image (B,3,H,W), .index (B,), .valid (B,) bool and .reasons over all
    images (dataset.collate.ImageBatch, through SkipBadCollate). Images are encoded first: with txt2img
    (text t's image), the unreadable images (AND-ed over ranks), their captions and images without
    captions are left out (good_subset) before the texts are tokenized, so the kept ones are encoded
    exactly as in a split without the bad entries. Returns image_embeds (Ni',1+P,Dv), image_feat (Ni',d),
    text_embeds (Nt',L,H), text_mask (Nt',L), text_feat (Nt',d), image_ids (Ni',) and text_ids (Nt',)
    (split indices of the kept rows), txt2img (Nt',) into image_ids (None without txt2img), image_valid
    (Ni,) bool and bad (this rank's reasons). All texts are padded to one length L, so a text's tokens do
    not depend on which batch encoded it.
    """
    if len(texts) == 0:
        raise ValueError("evaluation split has no captions")
    image_embeds, image_feat, order, valid, bad = [], [], [], [], []
    with _autocast(device, amp):
        for batch in image_loader:
            # A bad image's placeholder is encoded with the batch (shapes stay fixed) and dropped below.
            tokens_v = model.encode_image(batch.image.to(device, non_blocking=True))
            image_embeds.append(tokens_v)
            image_feat.append(model.image_feat(tokens_v).float())
            order.append(torch.as_tensor(batch.index))
            valid.append(batch.valid)
            bad.extend(batch.reasons)
    if not image_embeds:
        raise ValueError("evaluation split has no images")
    image_embeds, image_feat = torch.cat(image_embeds), torch.cat(image_feat)
    order, image_valid = torch.cat(order), torch.cat(valid)
    if not torch.equal(order, torch.arange(len(order))):
        perm = torch.argsort(order)  # a loader that does not keep dataset order
        image_valid = image_valid[perm]
        perm = perm.to(device)
        image_embeds, image_feat = image_embeds[perm], image_feat[perm]
    image_valid = _agree(image_valid, device)
    if txt2img is None:
        if not image_valid.all():
            raise ValueError("the image loader marked bad images: pass txt2img to leave out their captions")
        image_ids, text_ids, kept_t2i = torch.arange(len(image_valid)), torch.arange(len(texts)), None
    else:
        image_ids, text_ids, kept_t2i = good_subset(image_valid, txt2img, len(texts))
        if len(image_ids) == 0:
            raise ValueError("evaluation split has no readable image with a caption")
        if len(image_ids) < len(image_valid):  # copies only when something was dropped
            rows = image_ids.to(device)
            image_embeds, image_feat = image_embeds[rows], image_feat[rows]
        if len(text_ids) < len(texts):
            texts = [texts[t] for t in text_ids.tolist()]
    tokens = tokenizer(list(texts), padding="longest", truncation=True, max_length=max_tokens,
                       return_tensors="pt")
    input_ids, text_mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    text_embeds, text_feat = [], []
    with _autocast(device, amp):
        for start in range(0, len(texts), text_batch_size):
            rows = slice(start, start + text_batch_size)
            hidden = model.encode_text(input_ids[rows], text_mask[rows])
            text_embeds.append(hidden)
            text_feat.append(model.text_feat(hidden).float())
    return {"image_embeds": image_embeds, "image_feat": image_feat, "text_embeds": torch.cat(text_embeds),
            "text_mask": text_mask, "text_feat": torch.cat(text_feat), "image_ids": image_ids,
            "text_ids": text_ids, "txt2img": kept_t2i, "image_valid": image_valid, "bad": bad}


@torch.no_grad()
def compute_itr_scores(model: ALBEF_Retrieval, image_loader, texts: Sequence[str], tokenizer,
                       device: torch.device, k_test: int, text_batch_size: int = 256, rerank_pairs: int = 256,
                       max_tokens: int = 40, amp: bool = False, rerank: bool = True,
                       txt2img: Sequence[int] | dict[int, int] | Tensor | None = None) -> dict:
    """ITC top-k per image and per text, re-ranked by ITM; collective over all ranks, same result on each.

    k_test >= 1 (config key k_test, bounded there). rerank=False (a model trained without ITM, config key
    itm: false): the ITC cosines alone rank. txt2img (text t's image) lets bad images (a loader with
    SkipBadCollate) be left out with their captions, and images without captions too (encode_eval_set);
    the scores cover the kept ones only.

    Returns CPU tensors i2t_idx, i2t_score (Ni',k) and t2i_idx, t2i_score (Nt',k) (candidate positions
    among the kept texts / images and score = ITM match logit + ITC cosine, as ALBEF; not sorted),
    i2t_itc (Ni',k) and t2i_itc (Nt',k) (the candidates' ITC cosines, the ranking without ITM),
    image_ids (Ni',) and text_ids (Nt',) (split indices of the kept ones), txt2img (Nt',) into image_ids
    (None without txt2img), image_valid (Ni,) bool (agreed by all ranks), bad (this rank's reasons), and
    timing: itm_pairs (all ranks), encode_seconds, rerank_seconds. Each forward scores
    max(1, rerank_pairs // k) anchors x k candidates; ranks split the anchor groups (see rerank_topk).
    """
    rank, world = get_rank(), get_world_size()
    model.eval()
    _sync(device)
    start = time.perf_counter()
    enc = encode_eval_set(model, image_loader, texts, tokenizer, device, text_batch_size, max_tokens, amp,
                          txt2img)
    # Which rows were kept, for Retrieval.py and topk_rankings (absent from a stand-in encoder's output).
    kept = {k: enc[k] for k in ("image_ids", "text_ids", "txt2img", "image_valid", "bad") if k in enc}
    _sync(device)
    encode_seconds = time.perf_counter() - start

    image_embeds, text_embeds, text_mask = enc["image_embeds"], enc["text_embeds"], enc["text_mask"]
    sim_i2t = enc["image_feat"] @ enc["text_feat"].t()  # cosine, fp32 (ALBEF adds it without temperature)
    i2t_sim, i2t_idx = sim_i2t.topk(min(k_test, sim_i2t.shape[1]), dim=1)
    t2i_sim, t2i_idx = sim_i2t.t().topk(min(k_test, sim_i2t.shape[0]), dim=1)
    del sim_i2t
    if world > 1:
        # The candidate lists must agree across ranks before the rows are split among them.
        for t in (i2t_sim, i2t_idx, t2i_sim, t2i_idx):
            broadcast_from_main(t)

    def trimmed(embeds: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        # Drop the padding columns this forward does not need (fixed groups -> same shapes on any W).
        length = int(mask.sum(dim=1).max())
        return embeds[:, :length], mask[:, :length]

    def score_i2t(anchors: Tensor, cands: Tensor) -> Tensor:
        k = cands.shape[1]
        flat = cands.flatten()
        hidden, mask = trimmed(text_embeds[flat], text_mask[flat])
        image = image_embeds[anchors].repeat_interleave(k, dim=0)
        with _autocast(device, amp):
            return model.itm_logits(hidden, mask, image)[:, 1].float().view(-1, k)

    def score_t2i(anchors: Tensor, cands: Tensor) -> Tensor:
        k = cands.shape[1]
        hidden, mask = trimmed(text_embeds[anchors], text_mask[anchors])
        image = image_embeds[cands.flatten()]
        with _autocast(device, amp):
            out = model.itm_logits(hidden.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0),
                                   image)
        return out[:, 1].float().view(-1, k)

    itc = {"i2t_itc": i2t_sim.cpu(), "t2i_itc": t2i_sim.cpu()}  # ITC alone ranks by these (itc_* metrics)
    if not rerank:
        return {"i2t_idx": i2t_idx.cpu(), "i2t_score": i2t_sim.cpu(), "t2i_idx": t2i_idx.cpu(),
                "t2i_score": t2i_sim.cpu(), **itc, **kept, "itm_pairs": 0, "encode_seconds": encode_seconds,
                "rerank_seconds": 0.0}
    _sync(device)
    start = time.perf_counter()
    per_forward = lambda k: max(1, rerank_pairs // max(k, 1))
    i2t_itm = rerank_topk(i2t_idx, score_i2t, per_forward(i2t_idx.shape[1]), rank, world)
    t2i_itm = rerank_topk(t2i_idx, score_t2i, per_forward(t2i_idx.shape[1]), rank, world)
    if world > 1:
        i2t_itm = reduce_sum(i2t_itm)  # each row is non-zero on exactly one rank: the sum is exact
        t2i_itm = reduce_sum(t2i_itm)
    _sync(device)
    rerank_seconds = time.perf_counter() - start
    return {
        "i2t_idx": i2t_idx.cpu(), "i2t_score": (i2t_itm + i2t_sim).cpu(),
        "t2i_idx": t2i_idx.cpu(), "t2i_score": (t2i_itm + t2i_sim).cpu(), **itc, **kept,
        "itm_pairs": i2t_idx.numel() + t2i_idx.numel(),
        "encode_seconds": encode_seconds, "rerank_seconds": rerank_seconds,
    }
