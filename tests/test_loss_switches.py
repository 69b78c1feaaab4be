"""The loss-side switches beside batch construction (models.objectives.itc_loss): HN-NCE's weighted
negatives (hn_beta) and MAFA's smoothed ITC targets (smoothing), each 0 = the paper's ITC, each against
an independent float64 computation of its paper's formula; and the one method that sums a model's
named losses (models.losses.Objectives.total)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.losses import Objectives
from models.objectives import hard_negative_logits, itc_loss

TEMP = 0.07


def feats(b: int = 6, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=-1)
    text = F.normalize(image + 0.5 * torch.randn(b, d, generator=g, dtype=torch.float64), dim=-1)
    return image, text


def hn_nce_reference(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """HN-NCE's loss of each row, written out: -log(e^{l_ii} / (e^{l_ii} + sum_{j!=i} w_ij e^{l_ij})),
    w_ij = (n-1) e^{beta l_ij} / sum_{k!=i} e^{beta l_ik}."""
    b = logits.shape[0]
    out = []
    for i in range(b):
        others = [j for j in range(b) if j != i]
        z = sum(math.exp(beta * float(logits[i, k])) for k in others)
        weight = {j: (b - 1) * math.exp(beta * float(logits[i, j])) / z for j in others}
        denominator = math.exp(float(logits[i, i])) + sum(weight[j] * math.exp(float(logits[i, j]))
                                                          for j in others)
        out.append(-(float(logits[i, i]) - math.log(denominator)))
    return torch.tensor(out, dtype=torch.float64)


def test_zero_switches_are_the_papers_itc():
    image, text = feats()
    plain = itc_loss(image.float(), text.float(), TEMP, 0.2)
    zero = itc_loss(image.float(), text.float(), TEMP, 0.2, hn_beta=0.0, smoothing=0.0)
    for key in ("loss_itc", "loss_cons"):
        torch.testing.assert_close(zero[key], plain[key], rtol=0, atol=1e-7)
    # the weighting itself at beta = 0: w = 1 (to rounding), so the general path equals the plain one
    logits = image @ text.T / TEMP
    negative = ~torch.eye(6, dtype=torch.bool)
    torch.testing.assert_close(hard_negative_logits(logits, negative, 0.0), logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_hn_nce_is_the_papers_formula(beta):
    image, text = feats(seed=1)
    out = itc_loss(image, text, TEMP, 0.0, hn_beta=beta)
    i2t = hn_nce_reference(image @ text.T / TEMP, beta)
    t2i = hn_nce_reference(text @ image.T / TEMP, beta)
    torch.testing.assert_close(out["loss_itc"], ((i2t.mean() + t2i.mean()) / 2), rtol=1e-10, atol=1e-10)
    assert out["loss_itc"] > itc_loss(image, text, TEMP)["loss_itc"]  # hard negatives weigh more


def hn_nce_tensor(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """The same formula on tensors, so autograd differentiates all of it (the weights included): the mean
    over rows of -log(e^{l_ii} / (e^{l_ii} + sum_{j!=i} w_ij e^{l_ij}))."""
    b = logits.shape[0]
    off = ~torch.eye(b, dtype=torch.bool)
    e_beta = torch.exp(beta * logits) * off
    weight = (b - 1) * e_beta / e_beta.sum(dim=1, keepdim=True)
    denominator = logits.diagonal().exp() + (weight * logits.exp() * off).sum(dim=1)
    return (denominator.log() - logits.diagonal()).mean()


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_hn_nce_gradient_is_the_formulas(beta):
    """The weights are not constants: the gradient is the whole formula's, as the paper writes it."""
    image, text = feats(seed=2)
    image.requires_grad_(True)
    loss = itc_loss(image, text, TEMP, hn_beta=beta)["loss_itc"]
    (grad,) = torch.autograd.grad(loss, image)
    reference = (hn_nce_tensor(image @ text.T / TEMP, beta) + hn_nce_tensor(text @ image.T / TEMP, beta)) / 2
    (ref,) = torch.autograd.grad(reference, image)
    torch.testing.assert_close(grad, ref, rtol=1e-9, atol=1e-12)
    # ... and differs from the gradient with the weights held constant
    negative = ~torch.eye(6, dtype=torch.bool)
    both = (image @ text.T / TEMP, text @ image.T / TEMP)
    with torch.no_grad():
        frozen = [hard_negative_logits(x, negative, beta) - x for x in both]
    ce = [F.cross_entropy(x + w, torch.arange(6)) for x, w in zip(both, frozen)]
    (held,) = torch.autograd.grad((ce[0] + ce[1]) / 2, image)
    assert (grad - held).abs().max() > 1e-3


def test_hn_nce_row_without_negatives_is_finite():
    """A row whose every column is a positive (or masked) has no weight to normalise: plain logits, and a
    finite gradient."""
    logits = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    negative = torch.tensor([[False, True, True, True], [False, False, False, False],
                             [True, False, True, False]])
    out = hard_negative_logits(logits, negative, 1.0)
    torch.testing.assert_close(out[1], logits[1], rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.logsumexp(dim=1).sum(), logits)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("smoothing", [0.1, 0.3])
def test_smoothed_itc_targets(smoothing):
    """S-ITC: the target (1 - s) one-hot + s uniform, i.e. (1 - s) CE + s mean over columns of -log p."""
    image, text = feats(seed=3)
    out = itc_loss(image, text, TEMP, 0.0, smoothing=smoothing)
    ref = 0.0
    for logits in (image @ text.T / TEMP, text @ image.T / TEMP):
        log_p = F.log_softmax(logits, dim=1)
        ref = ref + ((1 - smoothing) * -log_p.diagonal() + smoothing * -log_p.mean(dim=1)).mean() / 2
    torch.testing.assert_close(out["loss_itc"], ref, rtol=1e-12, atol=1e-12)


def test_switches_keep_bad_samples_out():
    """With a bad sample, its row weighs 0 and its column is no negative, as for the paper's ITC."""
    image, text = feats(b=7, seed=4)
    valid = torch.tensor([True, True, False, True, True, True, True])
    out = itc_loss(image, text, TEMP, hn_beta=1.0, smoothing=0.1, valid=valid)
    keep = valid.nonzero().flatten()
    clean = itc_loss(image[keep], text[keep], TEMP, hn_beta=1.0, smoothing=0.1)
    torch.testing.assert_close(out["loss_itc"], clean["loss_itc"], rtol=1e-10, atol=1e-10)


def test_bad_values_are_refused():
    image, text = feats()
    with pytest.raises(ValueError, match="hn_beta must be >= 0 and 0 <= smoothing < 1"):
        itc_loss(image, text, TEMP, smoothing=1.0)


def test_total_loss_sums_the_named_losses_in_order(tmp_path):
    out = {"a": torch.tensor(1.0), "b": torch.tensor(2.0), "c": torch.tensor(4.0), "extra": torch.tensor(8.0)}
    assert float(Objectives({}, ("a", "b", "c")).total(out)) == 7.0
    from conftest import tiny_config, word_tokenizer

    from models.pretrain import ALBEF_Base
    from models.retrieval import ALBEF_Retrieval

    assert ALBEF_Base.paper_losses == ("loss_itc", "loss_cons", "loss_itm", "loss_mlm")
    assert ALBEF_Retrieval.paper_losses == ("loss_itc", "loss_cons", "loss_itm")
    tokenizer = word_tokenizer(tmp_path, ["a", "dog"])
    small = dict(image_res=32, vision_depth=2, vision_init=None, text_encoder=None)
    pretrain = ALBEF_Base(tiny_config("pretrain", **small), tokenizer)
    retrieval = ALBEF_Retrieval(tiny_config("retrieval", **small), tokenizer)
    assert pretrain.objectives.loss_names == ("loss_itc", "loss_cons", "loss_itm", "loss_mlm")
    assert retrieval.objectives.loss_names == ("loss_itc", "loss_cons", "loss_itm")
