"""Image-text retrieval evaluation, as ALBEF: ITC cosine similarity for all images x all texts, then
each image's top-k texts and each text's top-k images are re-scored by the ITM head (score = ITM match
logit + ITC cosine). Metrics use the standard protocol (an image's text-retrieval rank is the best rank
among its ground-truth captions).

Bad samples (dataset.bad_samples): an image that cannot be read is no candidate and its captions are no
queries (they have no correct image); an image left without captions is neither (nothing retrieves it
and it retrieves nothing), so a split is scored exactly as its json list without the bad entries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from models.retrieval import ALBEF_Retrieval

__all__ = [
    "MISSED_RANK",
    "compute_itr_scores",
    "dense_scores",
    "encode_eval_set",
    "good_subset",
    "itr_metrics",
    "rerank_topk",
    "retrieval_ranks",
    "topk_rankings",
]

# Rank given to a ground truth that was never scored (outside the top-k candidates).
MISSED_RANK = torch.iinfo(torch.long).max


def _txt2img_tensor(txt2img: Sequence[int] | dict[int, int] | Tensor, num_texts: int) -> Tensor:
    if isinstance(txt2img, dict):
        if sorted(txt2img) != list(range(num_texts)):
            raise ValueError(f"txt2img must map every text index 0..{num_texts - 1} to an image")
        txt2img = [txt2img[t] for t in range(num_texts)]
    t2i = torch.as_tensor(txt2img, dtype=torch.long).flatten().cpu()
    if t2i.numel() != num_texts:
        raise ValueError(f"txt2img has {t2i.numel()} entries but the score matrix has {num_texts} texts")
    return t2i


def good_subset(image_valid: Tensor, txt2img: Sequence[int] | dict[int, int] | Tensor,
                num_texts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Images that were read and have a caption, and their captions -> (image_ids (Ni',), text_ids (Nt',),
    txt2img (Nt',)).

    image_valid (Ni,) bool; txt2img maps the num_texts texts to images. The ids are split indices in
    ascending order; the returned txt2img maps a kept text to its image's position in image_ids.
    """
    image_valid = image_valid.bool().cpu()
    t2i = _txt2img_tensor(txt2img, num_texts)
    num_images = image_valid.numel()
    if num_texts and (t2i.min() < 0 or t2i.max() >= num_images):
        raise ValueError(f"txt2img holds image indices outside 0..{num_images - 1}")
    keep_image = image_valid & (torch.bincount(t2i, minlength=num_images) > 0)
    keep_text = keep_image[t2i]
    position = torch.cumsum(keep_image, dim=0) - 1  # an image's index among the kept ones
    return keep_image.nonzero().squeeze(1), keep_text.nonzero().squeeze(1), position[t2i[keep_text]]


def _agree(valid: Tensor, device: torch.device) -> Tensor:
    """valid (N,) bool AND-ed over ranks: a file one rank failed to read is dropped on all, so the
    candidate sets, and the shapes of the collectives that follow, agree."""
    if not (dist.is_available() and dist.is_initialized()):
        return valid
    flags = valid.to(device, torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return flags.bool().cpu()


def _positions(rows: Tensor) -> Tensor:
    """rows (n, m) -> 0-based position of every column when each row is sorted best first.

    A stable sort: equal scores keep column order (deterministic, like a stable argsort).
    """
    order = rows.sort(dim=1, descending=True, stable=True).indices
    positions = torch.empty_like(order)
    return positions.scatter_(1, order, torch.arange(rows.shape[1]).expand_as(order))


@torch.no_grad()
def retrieval_ranks(scores_i2t: Tensor, scores_t2i: Tensor,
                    txt2img: Sequence[int] | dict[int, int] | Tensor,
                    chunk: int = 512) -> tuple[Tensor, Tensor]:
    """0-based ranks: (Ni,) best rank of an image's captions, (Nt,) rank of a text's image.

    scores_i2t (Ni, Nt), scores_t2i (Nt, Ni). Candidates are ordered by score, ties by index (a
    stable sort). -inf marks candidates that were not scored (outside the top-k): a ground truth
    there gets MISSED_RANK, i.e. it is never retrieved, whatever k is.
    """
    num_images, num_texts = scores_i2t.shape
    if scores_t2i.shape != (num_texts, num_images):
        raise ValueError(f"scores_t2i has shape {tuple(scores_t2i.shape)}, "
                         f"expected {(num_texts, num_images)}")
    t2i = _txt2img_tensor(txt2img, num_texts)
    if num_texts and (t2i.min() < 0 or t2i.max() >= num_images):
        raise ValueError(f"txt2img holds image indices outside 0..{num_images - 1}")
    captions_per_image = torch.bincount(t2i, minlength=num_images)
    if (captions_per_image == 0).any():
        missing = torch.nonzero(captions_per_image == 0).flatten()[:5].tolist()
        raise ValueError(f"images without any ground-truth caption (e.g. {missing}): ranks are undefined")

    scores_i2t = scores_i2t.float().cpu()
    scores_t2i = scores_t2i.float().cpu()
    txt_rank = torch.empty(num_images, dtype=torch.long)
    img_rank = torch.empty(num_texts, dtype=torch.long)
    # Row chunks bound the (chunk, N) temporaries for COCO-sized matrices (5k x 25k).
    for start in range(0, num_images, chunk):
        rows = scores_i2t[start:start + chunk]
        is_gt = t2i[None, :] == torch.arange(start, start + rows.shape[0])[:, None]
        best = _positions(rows).masked_fill(~is_gt, MISSED_RANK).amin(dim=1)
        scored = rows.masked_fill(~is_gt, float("-inf")).amax(dim=1).isfinite()
        txt_rank[start:start + rows.shape[0]] = torch.where(scored, best, MISSED_RANK)
    for start in range(0, num_texts, chunk):
        rows = scores_t2i[start:start + chunk]
        gt = t2i[start:start + rows.shape[0], None]
        scored = rows.gather(1, gt).squeeze(1).isfinite()
        img_rank[start:start + rows.shape[0]] = torch.where(scored, _positions(rows).gather(1, gt).squeeze(1),
                                                            MISSED_RANK)
    return txt_rank, img_rank


def itr_metrics(scores_i2t: Tensor, scores_t2i: Tensor,
                txt2img: Sequence[int] | dict[int, int] | Tensor) -> dict[str, float]:
    """Recall@1/5/10 in percent for text retrieval (txt_*) and image retrieval (img_*), and means.

    scores_i2t (Ni, Nt), scores_t2i (Nt, Ni); txt2img[t] is the image of text t (several texts
    per image). Returns txt_r1, txt_r5, txt_r10, txt_r_mean, img_r1, img_r5, img_r10, img_r_mean, r_mean.
    """
    txt_rank, img_rank = retrieval_ranks(scores_i2t, scores_t2i, txt2img)
    out: dict[str, float] = {}
    for name, rank in (("txt", txt_rank), ("img", img_rank)):
        for r in (1, 5, 10):
            out[f"{name}_r{r}"] = 100.0 * (rank < r).double().mean().item()
        out[f"{name}_r_mean"] = (out[f"{name}_r1"] + out[f"{name}_r5"] + out[f"{name}_r10"]) / 3
    out["r_mean"] = (out["txt_r_mean"] + out["img_r_mean"]) / 2
    return out


@torch.no_grad()
def rerank_topk(topk_idx: Tensor, score_fn: Callable[[Tensor, Tensor], Tensor],
                anchors_per_forward: int = 1, rank: int = 0, world_size: int = 1) -> Tensor:
    """Re-score each anchor's k candidates: topk_idx (Na, k) -> scores (Na, k).

    score_fn(anchor_idx (n,), cand_idx (n, k)) -> (n, k) scores for n anchors at once (one forward
    of n*k pairs). Anchors are cut into fixed groups of ``anchors_per_forward`` starting at 0 and
    group g is scored by rank g % world_size, so every pair is computed in exactly the same batch
    whatever the world size. Rows of other ranks' anchors stay 0: a SUM all-reduce across ranks
    then reproduces the one-process result exactly (x + 0 == x).
    """
    if anchors_per_forward < 1:
        raise ValueError(f"anchors_per_forward must be >= 1, got {anchors_per_forward}")
    num_anchors, k = topk_idx.shape
    scores = torch.zeros(num_anchors, k, device=topk_idx.device)
    num_groups = (num_anchors + anchors_per_forward - 1) // anchors_per_forward
    for group in range(rank, num_groups, world_size):
        start = group * anchors_per_forward
        stop = min(start + anchors_per_forward, num_anchors)
        anchors = torch.arange(start, stop, device=topk_idx.device)
        scores[start:stop] = score_fn(anchors, topk_idx[start:stop]).float()
    return scores


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
    rank, world = _rank_world()
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
            dist.broadcast(t, src=0)

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
        dist.all_reduce(i2t_itm)  # each row is non-zero on exactly one rank: the sum is exact
        dist.all_reduce(t2i_itm)
    _sync(device)
    rerank_seconds = time.perf_counter() - start
    return {
        "i2t_idx": i2t_idx.cpu(), "i2t_score": (i2t_itm + i2t_sim).cpu(),
        "t2i_idx": t2i_idx.cpu(), "t2i_score": (t2i_itm + t2i_sim).cpu(), **itc, **kept,
        "itm_pairs": i2t_idx.numel() + t2i_idx.numel(),
        "encode_seconds": encode_seconds, "rerank_seconds": rerank_seconds,
    }


def dense_scores(idx: Tensor, score: Tensor, num_cols: int) -> Tensor:
    """Top-k candidates idx, score (Na,k) -> (Na, num_cols) matrix, -inf where not a candidate."""
    out = torch.full((idx.shape[0], num_cols), float("-inf"), dtype=score.dtype)
    return out.scatter_(1, idx.cpu(), score.cpu())


def topk_rankings(result: dict, images: Sequence[str], texts: Sequence[str],
                  txt2img: Sequence[int] | dict[int, int], topn: int | None = None) -> dict:
    """compute_itr_scores output -> JSON-ready rankings, best first: per image its texts, per text its images.

    Each entry lists the anchor (image path / caption), its ground truth and the candidate ids with
    scores; topn (None = all k) limits the list length. Ids are split indices (images, texts and
    txt2img are the whole split's); anchors left out as bad (result's image_ids / text_ids) are absent.
    """
    t2i = _txt2img_tensor(txt2img, len(texts)).tolist()
    img2txt: dict[int, list[int]] = {}
    for t, i in enumerate(t2i):
        img2txt.setdefault(i, []).append(t)
    image_ids = result.get("image_ids", torch.arange(result["i2t_idx"].shape[0]))
    text_ids = result.get("text_ids", torch.arange(result["t2i_idx"].shape[0]))

    def ranked(idx: Tensor, score: Tensor, ids: Tensor) -> tuple[list[list[int]], list[list[float]]]:
        order = score.argsort(dim=1, descending=True)[:, :topn]
        return ids[idx.gather(1, order)].tolist(), score.gather(1, order).tolist()

    i2t_ids, i2t_scores = ranked(result["i2t_idx"], result["i2t_score"], text_ids)
    t2i_ids, t2i_scores = ranked(result["t2i_idx"], result["t2i_score"], image_ids)
    return {
        "image_to_text": [
            {"image_index": i, "image": images[i], "gt_text_ids": img2txt.get(i, []),
             "text_ids": ids, "scores": [round(s, 4) for s in scores]}
            for i, ids, scores in zip(image_ids.tolist(), i2t_ids, i2t_scores)
        ],
        "text_to_image": [
            {"text_index": t, "text": texts[t], "gt_image_id": t2i[t],
             "image_ids": ids, "scores": [round(s, 4) for s in scores]}
            for t, ids, scores in zip(text_ids.tolist(), t2i_ids, t2i_scores)
        ],
    }
