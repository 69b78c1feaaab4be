"""Image-text retrieval evaluation, as ALBEF: ITC cosine similarity for all images x all texts, then
each image's top-k texts and each text's top-k images are re-scored by the ITM head (score = ITM match
logit + ITC cosine). Metrics use the standard protocol (an image's text-retrieval rank is the best rank
among its ground-truth captions). The pure part: ranks, recalls, the re-ranking loop and the saved
rankings; training.retrieval_eval encodes a split and scores it across ranks with these.

Bad samples (dataset.bad_samples): an image that cannot be read is no candidate and its captions are no
queries (they have no correct image); an image left without captions is neither (nothing retrieves it
and it retrieves nothing), so a split is scored exactly as its json list without the bad entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "MISSED_RANK",
    "dense_scores",
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
