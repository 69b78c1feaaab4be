"""Shared training objectives: ITC (+ GRIT consistency) and the losses' sum (ITM's in-batch negatives,
their mining, weights, accuracy and hardness, are in models.negatives; MLM's masking and selection in
models.mlm; the false-negative guard's keys and mask in models.false_negatives).

Everything here is a pure function of tensors (no module state, no hidden globals), so the
pre-training and every fine-tuning model compose the same code. Paper: Eq. 1-2 (ITC), Eq. 6
(consistency); ALBEF's in-batch hard-negative ITM and BERT masking.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "assert_on_device",
    "check_rows",
    "concat_all_gather",
    "gather_features",
    "itc_loss",
    "local_columns",
    "masked_mean",
    "upcast",
]


def _rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def upcast(x: Tensor) -> Tensor:
    """Upcast half types to fp32 (double stays double) for softmax/log maths."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def assert_on_device(ok: Tensor, message: str) -> None:
    """Raise ValueError(message) unless the 0-dim bool `ok` is True.

    On CPU, eagerly, this is free; on an accelerator a host check would stall the step, and under
    torch.compile it would split the graph, so the check is queued on the device instead
    (torch._assert_async fails loudly without a host sync).
    """
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok):
            raise ValueError(message)
    else:
        torch._assert_async(ok, message)


def check_rows(mask: Tensor, message: str) -> None:
    """Raise ValueError(message) unless every row of the bool mask has a True entry (see _check)."""
    assert_on_device(mask.any(dim=1).all(), message)


@torch.no_grad()
def concat_all_gather(x: Tensor) -> Tensor:
    """(B, ...) -> (W*B, ...): rows of every rank in rank order, no gradient; identity if W == 1."""
    _, world = _rank_world()
    if world == 1:
        return x.detach()
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=0)


def gather_features(x: Tensor) -> Tensor:
    """(B, d) -> (W*B, d): all ranks' rows in rank order; gradient reaches only the local slice.

    The other ranks' rows arrive as constants; this rank's slice is the input tensor itself, so
    autograd flows into it (open_clip's `gather_features` without gather_with_grad). Every rank
    must pass the same B. Identity when torch.distributed is not initialised or W == 1.
    """
    rank, world = _rank_world()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.detach().contiguous())
    parts[rank] = x
    return torch.cat(parts, dim=0)


def local_columns(sim: Tensor) -> Tensor:
    """(B, W*B) similarity from itc_loss(gather=True) -> (B, B) block of this rank's own batch."""
    rank, world = _rank_world()
    b = sim.shape[0]
    if world == 1 or sim.shape[1] != world * b:
        return sim
    return sim[:, rank * b : (rank + 1) * b]


def itc_loss(
    image_feat: Tensor,
    text_feat: Tensor,
    temp: Tensor | float,
    lambda_cons: float = 0.0,
    positive: Tensor | None = None,
    gather: bool = False,
    image_bank: Tensor | None = None,
    text_bank: Tensor | None = None,
    valid: Tensor | None = None,
    valid_columns: Tensor | None = None,
    hn_beta: float = 0.0,
    smoothing: float = 0.0,
) -> dict[str, Tensor]:
    """ITC (Eq. 1-2) + consistency (Eq. 6); feats (B, d) L2-normalised -> losses (0-dim), sims (B, N).

    The other side of the contrast (N columns): image_bank / text_bank (N, d), the local batch gathered
    over the ranks (gather), or the local batch (N = B, the paper's): see _contrast_sides.

    positive (B, N) bool: positive[i, j] is True when pair i and column pair j share the image or
    the caption (false_negative_mask), so image i matches text j and text i matches image j; it
    serves both directions. The targets are then positive / positive.sum(1) (ALBEF retrieval
    soft multi-positive targets); every row needs a True entry. None -> one-hot on the true pair
    (column rank*B + i, or i with a bank, which must then start with the current batch).

    valid (B,) bool: False marks a bad sample (dataset.bad_samples): its row is left out of both
    means and its column never competes in a softmax. The columns' validity is valid_columns (N,)
    when given (a bank's rows), else valid (gathered with gather=True). None: every pair is valid
    and the computation is exactly the one without the argument.

    loss_itc = (CE(y, p_v2t) + CE(y, p_t2v)) / 2 averaged over the batch;
    loss_cons = lambda_cons / 2 * mean_i [KL(sg(p_v2t_i) || p_t2v_i) + KL(sg(p_t2v_i) || p_v2t_i)],
    where p_v2t_i = softmax(sim_i2t[i]) (image i over texts) and p_t2v_i = softmax(sim_t2i[i])
    (text i over images). lambda_cons == 0 -> loss_cons is an exact zero and costs nothing.
    Returned sims keep their graph (use .detach() for mining). hn_beta (HN-NCE) and smoothing (S-ITC),
    0 = off, exactly the paper's ITC: see _itc_loss_valid.
    """
    image_all, text_all, offset = _contrast_sides(image_feat, text_feat, gather, image_bank, text_bank)
    b, n = image_feat.shape[0], text_all.shape[0]
    _check_targets(positive, (b, n), lambda_cons, hn_beta, smoothing)
    sim_i2t = image_feat @ text_all.t() / temp
    sim_t2i = text_feat @ image_all.t() / temp
    if valid is not None or hn_beta or smoothing:
        if valid is None:
            valid = torch.ones(b, dtype=torch.bool, device=sim_i2t.device)
            valid_columns = torch.ones(n, dtype=torch.bool, device=sim_i2t.device)
        return _itc_loss_valid(sim_i2t, sim_t2i, lambda_cons, positive, offset, valid,
                               valid_columns, gather, hn_beta, smoothing)
    return _itc_loss_plain(sim_i2t, sim_t2i, lambda_cons, positive, offset)


def _contrast_sides(image_feat: Tensor, text_feat: Tensor, gather: bool, image_bank: Tensor | None,
                    text_bank: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """The columns ITC contrasts against -> (images (N, d), texts (N, d), the column of row 0's pair).

    In this order of precedence:
      * image_bank / text_bank (N, d), given together: retrieval with a queue (ALBEF). Build them as
        cat([feat_m, queue.t()]) (see FeatureQueue.bank); sim_i2t = image_feat @ text_bank.T / temp,
        sim_t2i = text_feat @ image_bank.T / temp. Row j of both banks must be the same pair, so the
        two softmaxes of the consistency term range over the same N pairs. No momentum distillation.
      * gather=True: all ranks' features (N = W*B, gather_features: gradient to the local part only);
        the true pair of row i is column rank*B + i. Consistency then compares rows over the same
        W*B pairs (images for p_t2v, texts for p_v2t). Each rank's loss covers its own B rows; the
        gradient that other ranks' rows would send to this rank's columns is dropped (open_clip's
        local_loss without gather_with_grad).
      * otherwise the local batch (N = B), the paper's in-batch pre-training setting.
    """
    if image_feat.dim() != 2 or image_feat.shape != text_feat.shape:
        raise ValueError(
            f"itc_loss: image_feat and text_feat must both be (B, d), got "
            f"{tuple(image_feat.shape)} and {tuple(text_feat.shape)}"
        )
    b = image_feat.shape[0]
    if (image_bank is None) != (text_bank is None):
        raise ValueError("itc_loss: image_bank and text_bank must be given together")
    if image_bank is None:
        if not gather:
            return image_feat, text_feat, 0
        return gather_features(image_feat), gather_features(text_feat), _rank_world()[0] * b
    if gather:
        raise ValueError("itc_loss: gather=True and a feature bank are exclusive; gather into the bank")
    if image_bank.shape != text_bank.shape or image_bank.shape[1] != image_feat.shape[1]:
        raise ValueError(
            f"itc_loss: banks must both be (N, {image_feat.shape[1]}), got "
            f"{tuple(image_bank.shape)} and {tuple(text_bank.shape)}"
        )
    if image_bank.shape[0] < b:
        raise ValueError(f"itc_loss: the bank has {image_bank.shape[0]} rows, fewer than the batch ({b})")
    return image_bank, text_bank, 0


def _check_targets(positive: Tensor | None, shape: tuple[int, int], lambda_cons: float, hn_beta: float,
                   smoothing: float) -> None:
    """Raise ValueError for a positive mask that is not bool (B, N) with a True in every row, or a weight
    out of its range."""
    if lambda_cons < 0:
        raise ValueError(f"itc_loss: lambda_cons must be >= 0, got {lambda_cons}")
    if positive is not None:
        if positive.shape != shape or positive.dtype != torch.bool:
            raise ValueError(
                f"itc_loss: positive must be a bool {shape} mask, got "
                f"{positive.dtype} {tuple(positive.shape)}"
            )
        check_rows(positive, "itc_loss: every row of `positive` needs at least one True (its own pair)")
    if hn_beta < 0 or not 0 <= smoothing < 1:
        raise ValueError(f"itc_loss: hn_beta must be >= 0 and 0 <= smoothing < 1, got {hn_beta}, {smoothing}")


def _itc_loss_plain(sim_i2t: Tensor, sim_t2i: Tensor, lambda_cons: float, positive: Tensor | None,
                    offset: int) -> dict[str, Tensor]:
    """itc_loss without bad samples, HN-NCE or smoothing: the paper's computation."""
    b = sim_i2t.shape[0]
    # Losses in fp32: under autocast the sims may be fp16 and log-softmax over a large bank loses bits.
    log_p_v2t = F.log_softmax(upcast(sim_i2t), dim=1)
    log_p_t2v = F.log_softmax(upcast(sim_t2i), dim=1)

    if positive is None:
        target = torch.arange(offset, offset + b, device=sim_i2t.device).unsqueeze(1)
        loss_i2t = -log_p_v2t.gather(1, target).mean()
        loss_t2i = -log_p_t2v.gather(1, target).mean()
    else:
        target = positive.to(log_p_v2t.dtype)
        target = target / target.sum(dim=1, keepdim=True)
        loss_i2t = -(target * log_p_v2t).sum(dim=1).mean()
        loss_t2i = -(target * log_p_t2v).sum(dim=1).mean()
    loss_itc = (loss_i2t + loss_t2i) / 2

    if lambda_cons == 0:
        loss_cons = loss_itc.new_zeros(())
    else:
        # kl_div(input=log q, target=log p) = sum p (log p - log q) / B: KL(sg(p) || q) per row.
        kl_v2t_t2v = F.kl_div(log_p_t2v, log_p_v2t.detach(), reduction="batchmean", log_target=True)
        kl_t2v_v2t = F.kl_div(log_p_v2t, log_p_t2v.detach(), reduction="batchmean", log_target=True)
        loss_cons = lambda_cons / 2 * (kl_v2t_t2v + kl_t2v_v2t)
    return {"loss_itc": loss_itc, "loss_cons": loss_cons, "sim_i2t": sim_i2t, "sim_t2i": sim_t2i}


# A logit no softmax picks (exp underflows to exactly 0 in fp32) but finite, so that 0 * log p stays 0.
_MASKED_LOGIT = -1e9


def masked_mean(values: Tensor, weight: Tensor) -> Tensor:
    """values (B,), weight (B,) bool/float -> 0-dim weighted mean; 0 (with a graph) when the weight is 0."""
    weight = weight.to(values.dtype)
    return (values * weight).sum() / weight.sum().clamp(min=1)


def hard_negative_logits(logits: Tensor, negative: Tensor, beta: float) -> Tensor:
    """HN-NCE's logits (B, N): each negative's logit plus log w_ij, w_ij = n_i softmax_j(beta * logit_ij)
    over the row's n_i negatives (`negative` (B, N) bool); other entries unchanged. beta = 0 gives w = 1:
    the plain logits. The weights are differentiated with the rest, as the paper's loss is written and as
    public implementations do."""
    # A finite fill, not -inf: a row without negatives must give a finite gradient, not 0 * nan.
    scaled = (beta * logits).masked_fill(~negative, _MASKED_LOGIT)
    count = negative.sum(dim=1, keepdim=True).clamp(min=1).to(logits.dtype)
    log_w = count.log() + scaled - torch.logsumexp(scaled, dim=1, keepdim=True)
    return logits + torch.where(negative, log_w, torch.zeros_like(logits))


def _itc_loss_valid(sim_i2t: Tensor, sim_t2i: Tensor, lambda_cons: float, positive: Tensor | None,
                    offset: int, valid: Tensor, valid_columns: Tensor | None, gather: bool,
                    hn_beta: float = 0.0, smoothing: float = 0.0) -> dict[str, Tensor]:
    """itc_loss with bad samples (invalid rows weigh 0, invalid columns are masked out of the softmax),
    HN-NCE's weights or smoothed targets (not in GRIT-VLP; 0 = off):
      * hn_beta: HN-NCE (Radenovic et al., CVPR 2023): in both directions every negative's exp-logit in
        the denominator is weighted by w_ij = n_i softmax_j(hn_beta * logit_ij) over the row's n_i
        negatives (the weights differentiated too; the positive's weight alpha = 1), so that the hardest
        negatives count more and the weights still sum to n_i; the consistency term keeps the plain softmaxes.
      * smoothing: MAFA's smoothed ITC targets (S-ITC, CVPR 2024): each row's target becomes
        (1 - smoothing) * target + smoothing * uniform over the row's valid columns.
    """
    b, n = sim_i2t.shape
    if valid.shape != (b,) or valid.dtype != torch.bool:
        raise ValueError(
            f"itc_loss: valid must be a bool ({b},) mask, got {valid.dtype} {tuple(valid.shape)}"
        )
    if valid_columns is None:
        # uint8 on the wire: not every backend all_gathers bool tensors.
        valid_columns = concat_all_gather(valid.to(torch.uint8)).bool() if gather else valid
    if valid_columns.shape != (n,):
        raise ValueError(f"itc_loss: valid_columns must be ({n},), got {tuple(valid_columns.shape)}")
    log_p_v2t = F.log_softmax(upcast(sim_i2t).masked_fill(~valid_columns, _MASKED_LOGIT), dim=1)
    log_p_t2v = F.log_softmax(upcast(sim_t2i).masked_fill(~valid_columns, _MASKED_LOGIT), dim=1)
    own = torch.zeros(b, n, dtype=torch.bool, device=sim_i2t.device)
    own[torch.arange(b, device=own.device), torch.arange(offset, offset + b, device=own.device)] = True
    if positive is None:
        target = own
    else:
        # An invalid row keeps its own (masked) column as target so its weight-0 loss stays finite.
        target = torch.where(valid[:, None], positive & valid_columns, own)
    ce_v2t, ce_t2v = log_p_v2t, log_p_t2v
    if hn_beta:
        negative = valid_columns[None, :] & ~target
        ce_v2t = F.log_softmax(hard_negative_logits(
            upcast(sim_i2t).masked_fill(~valid_columns, _MASKED_LOGIT), negative, hn_beta), dim=1)
        ce_t2v = F.log_softmax(hard_negative_logits(
            upcast(sim_t2i).masked_fill(~valid_columns, _MASKED_LOGIT), negative, hn_beta), dim=1)
    target = target.to(log_p_v2t.dtype)
    target = target / target.sum(dim=1, keepdim=True)
    if smoothing:
        uniform = valid_columns.to(target.dtype) / valid_columns.sum().clamp(min=1)
        target = (1 - smoothing) * target + smoothing * uniform[None, :]
    loss_i2t = masked_mean(-(target * ce_v2t).sum(dim=1), valid)
    loss_t2i = masked_mean(-(target * ce_t2v).sum(dim=1), valid)
    loss_itc = (loss_i2t + loss_t2i) / 2
    if lambda_cons == 0:
        loss_cons = loss_itc.new_zeros(())
    else:
        kl_v2t_t2v = F.kl_div(log_p_t2v, log_p_v2t.detach(), reduction="none", log_target=True).sum(1)
        kl_t2v_v2t = F.kl_div(log_p_v2t, log_p_t2v.detach(), reduction="none", log_target=True).sum(1)
        loss_cons = lambda_cons / 2 * masked_mean(kl_v2t_t2v + kl_t2v_v2t, valid)
    return {"loss_itc": loss_itc, "loss_cons": loss_cons, "sim_i2t": sim_i2t, "sim_t2i": sim_t2i}
