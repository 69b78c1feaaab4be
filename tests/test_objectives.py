"""models/objectives.py: ITC + consistency, negative mining, hardness, MLM masking, feature gather."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import HANG_GUARD_S

from models.false_negatives import caption_keys, false_negative_mask
from models.mlm import mask_tokens
from models.negatives import hardest_negative_similarity, mine_negatives
from models.objectives import concat_all_gather, gather_features, itc_loss, local_columns


def _feats(b, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(b, d, generator=g, dtype=dtype), dim=1)
    txt = F.normalize(torch.randn(b, d, generator=g, dtype=dtype), dim=1)
    return img, txt


def _reference(img, txt, temp, lam, target=None, image_bank=None, text_bank=None):
    """Explicit softmax / log formulas of Eq. 1, 2 and 6 (rows = pairs of the batch)."""
    image_bank = img if image_bank is None else image_bank
    text_bank = txt if text_bank is None else text_bank
    s_i2t = img @ text_bank.T / temp
    s_t2i = txt @ image_bank.T / temp
    p_v2t = torch.exp(s_i2t) / torch.exp(s_i2t).sum(1, keepdim=True)
    p_t2v = torch.exp(s_t2i) / torch.exp(s_t2i).sum(1, keepdim=True)
    if target is None:
        target = torch.eye(*s_i2t.shape, dtype=img.dtype)
    ce_v2t = -(target * torch.log(p_v2t)).sum(1).mean()
    ce_t2v = -(target * torch.log(p_t2v)).sum(1).mean()
    kl1 = (p_v2t * (torch.log(p_v2t) - torch.log(p_t2v))).sum(1).mean()
    kl2 = (p_t2v * (torch.log(p_t2v) - torch.log(p_v2t))).sum(1).mean()
    return (ce_v2t + ce_t2v) / 2, lam / 2 * (kl1 + kl2)


# ----------------------------------------------------------------------------- ITC + consistency


def test_itc_matches_reference():
    img, txt = _feats(6, 16)
    temp = torch.tensor(0.07, dtype=torch.float64)
    out = itc_loss(img, txt, temp, lambda_cons=0.2)
    ref_itc, ref_cons = _reference(img, txt, temp, 0.2)
    torch.testing.assert_close(out["loss_itc"], ref_itc)
    torch.testing.assert_close(out["loss_cons"], ref_cons)
    torch.testing.assert_close(out["sim_i2t"], img @ txt.T / temp)
    torch.testing.assert_close(out["sim_t2i"], txt @ img.T / temp)
    assert out["loss_itc"].dim() == 0 and out["loss_cons"].dim() == 0
    assert out["loss_cons"] > 0


def test_itc_float32_float_temp():
    img, txt = _feats(5, 8, dtype=torch.float32)
    out = itc_loss(img, txt, 0.1, lambda_cons=0.5)
    ref_itc, ref_cons = _reference(img.double(), txt.double(), 0.1, 0.5)
    torch.testing.assert_close(out["loss_itc"].double(), ref_itc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss_cons"].double(), ref_cons, rtol=1e-5, atol=1e-5)


def test_lambda_zero_is_plain_itc():
    img, txt = _feats(6, 16, seed=1)
    out0 = itc_loss(img, txt, 0.07, lambda_cons=0.0)
    out1 = itc_loss(img, txt, 0.07, lambda_cons=0.3)
    assert torch.is_tensor(out0["loss_cons"]) and out0["loss_cons"].item() == 0.0
    assert torch.equal(out0["loss_itc"], out1["loss_itc"])
    labels = torch.arange(6)
    plain = (F.cross_entropy(img @ txt.T / 0.07, labels) + F.cross_entropy(txt @ img.T / 0.07, labels)) / 2
    torch.testing.assert_close(out0["loss_itc"], plain)


def test_consistency_zero_when_symmetric():
    img, _ = _feats(7, 16, seed=2)
    out = itc_loss(img, img.clone(), 0.07, lambda_cons=0.2)
    torch.testing.assert_close(out["loss_cons"], torch.zeros((), dtype=img.dtype), atol=1e-12, rtol=0)


def test_consistency_stop_gradient():
    img, txt = _feats(5, 8, seed=3)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    lam, temp = 0.2, 0.1
    got = torch.autograd.grad(itc_loss(img, txt, temp, lam)["loss_cons"], (img, txt))

    def cons(stop):
        log_p = F.log_softmax(img @ txt.T / temp, 1)  # p_v2t, row i = image i
        log_q = F.log_softmax(txt @ img.T / temp, 1)  # p_t2v, row i = text i
        tp, tq = (log_p.detach(), log_q.detach()) if stop else (log_p, log_q)
        kl1 = (tp.exp() * (tp - log_q)).sum(1).mean()
        kl2 = (tq.exp() * (tq - log_p)).sum(1).mean()
        return lam / 2 * (kl1 + kl2)

    want = torch.autograd.grad(cons(stop=True), (img, txt))
    without_sg = torch.autograd.grad(cons(stop=False), (img, txt))
    for g, w, n in zip(got, want, without_sg):
        torch.testing.assert_close(g, w)
        assert not torch.allclose(g, n, atol=1e-6)


def test_multi_positive_targets():
    img, txt = _feats(6, 16, seed=4)
    ids = torch.tensor([3, 3, 7, 1, 7, 7])
    positive = ids[:, None] == ids[None, :]
    out = itc_loss(img, txt, 0.07, lambda_cons=0.2, positive=positive)
    target = positive.double() / positive.sum(1, keepdim=True)
    ref_itc, ref_cons = _reference(img, txt, 0.07, 0.2, target=target)
    torch.testing.assert_close(out["loss_itc"], ref_itc)
    torch.testing.assert_close(out["loss_cons"], ref_cons)
    # Identity positives are exactly the one-hot default.
    eye = itc_loss(img, txt, 0.07, positive=torch.eye(6, dtype=torch.bool))
    torch.testing.assert_close(eye["loss_itc"], itc_loss(img, txt, 0.07)["loss_itc"])


def test_itc_with_queue_bank():
    img, txt = _feats(4, 8, seed=5)
    img_m, txt_m = _feats(4, 8, seed=6)
    q_img, q_txt = _feats(10, 8, seed=7)
    image_bank, text_bank = torch.cat([img_m, q_img]), torch.cat([txt_m, q_txt])
    ids = torch.tensor([0, 1, 2, 0])
    queue_ids = torch.tensor([5, 1, -100, 9, 2, 2, 8, -100, 0, 4])
    positive = ids[:, None] == torch.cat([ids, queue_ids])[None, :]
    out = itc_loss(img, txt, 0.07, 0.2, positive=positive, image_bank=image_bank, text_bank=text_bank)
    assert out["sim_i2t"].shape == (4, 14) and out["sim_t2i"].shape == (4, 14)
    target = positive.double() / positive.sum(1, keepdim=True)
    ref_itc, ref_cons = _reference(img, txt, 0.07, 0.2, target, image_bank, text_bank)
    torch.testing.assert_close(out["loss_itc"], ref_itc)
    torch.testing.assert_close(out["loss_cons"], ref_cons)
    # Default targets with a bank: the true pair is column i (the bank starts with the batch).
    plain = itc_loss(img, txt, 0.07, image_bank=image_bank, text_bank=text_bank)
    one_hot = torch.eye(4, 14, dtype=torch.float64)
    ref_plain, _ = _reference(img, txt, 0.07, 0.0, one_hot, image_bank, text_bank)
    torch.testing.assert_close(plain["loss_itc"], ref_plain)


def test_itc_bad_input():
    img, txt = _feats(4, 8)
    with pytest.raises(ValueError, match="image_feat"):
        itc_loss(img, txt[:, :4], 0.07)
    with pytest.raises(ValueError, match="together"):
        itc_loss(img, txt, 0.07, image_bank=img)
    with pytest.raises(ValueError, match="positive"):
        itc_loss(img, txt, 0.07, positive=torch.eye(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one True"):
        itc_loss(img, txt, 0.07, positive=torch.zeros(4, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------- negative mining

IDS = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])  # several captions share an image
SAME_IMAGE = IDS[:, None] == IDS[None, :]


@pytest.mark.parametrize("mode,sampling", [("hard", "argmax"), ("hard", "multinomial"), ("random", "argmax")])
@pytest.mark.parametrize("positive", [None, SAME_IMAGE], ids=["pairs", "image_id"])
def test_mined_negative_never_positive(mode, sampling, positive):
    b = len(IDS)
    excluded = torch.eye(b, dtype=torch.bool) if positive is None else positive
    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        img, txt = _feats(b, 8, seed=seed, dtype=torch.float32)
        # Make positives the most similar items so that a leak would be picked.
        sim = img @ txt.T / 0.07 + 50.0 * excluded
        neg_t, neg_i = mine_negatives(sim, sim.T.contiguous(), positive, mode, sampling, generator=g)
        assert neg_t.shape == (b,) and neg_i.shape == (b,) and neg_t.dtype == torch.long
        assert not excluded[torch.arange(b), neg_t].any()  # image i vs text neg_t[i]
        assert not excluded[neg_i, torch.arange(b)].any()  # image neg_i[i] vs text i


def test_argmax_picks_most_similar_negative():
    b = len(IDS)
    img, txt = _feats(b, 8, seed=11, dtype=torch.float32)
    sim_i2t = img @ txt.T
    sim_t2i = sim_i2t.T.contiguous()
    neg_t, neg_i = mine_negatives(sim_i2t, sim_t2i, SAME_IMAGE, "hard", "argmax")
    for i in range(b):  # reference loop (test only)
        cand_t = [j for j in range(b) if not SAME_IMAGE[i, j]]
        cand_i = [j for j in range(b) if not SAME_IMAGE[j, i]]
        assert neg_t[i] == max(cand_t, key=lambda j: sim_i2t[i, j])
        assert neg_i[i] == max(cand_i, key=lambda j: sim_t2i[i, j])


def test_multinomial_and_random_frequencies():
    sim = torch.tensor(
        [[2.0, 1.0, 0.0, -1.0], [0.5, 3.0, 0.5, 0.0], [1.0, 1.0, 1.0, 2.0], [0.0, 0.0, 2.0, 1.0]]
    )
    positive = torch.eye(4, dtype=torch.bool)
    positive[0, 1] = positive[1, 0] = True
    # One call instead of many: `reps` copies of the 4x4 problem on the block diagonal; everything
    # off the blocks is marked positive (and has negligible softmax mass), so each row samples its block.
    reps = 400
    block = torch.block_diag(*[torch.ones(4, 4)] * reps).bool()
    big_sim = torch.where(block, sim.repeat(reps, reps), torch.tensor(-1e4))
    big_pos = ~block | positive.repeat(reps, reps)
    g = torch.Generator().manual_seed(1)
    hard = mine_negatives(big_sim, big_sim, big_pos, "hard", "multinomial", g)[0].view(reps, 4) % 4
    rand = mine_negatives(big_sim, big_sim, big_pos, "random", generator=g)[0].view(reps, 4) % 4
    want_hard = (F.softmax(sim, 1) + 1e-5).masked_fill(positive, 0)
    want_hard = want_hard / want_hard.sum(1, keepdim=True)
    want_rand = (~positive).float() / (~positive).sum(1, keepdim=True)
    for row in range(4):
        freq_h = torch.bincount(hard[:, row], minlength=4).float() / reps
        freq_r = torch.bincount(rand[:, row], minlength=4).float() / reps
        torch.testing.assert_close(freq_h, want_hard[row], atol=0.07, rtol=0)
        torch.testing.assert_close(freq_r, want_rand[row], atol=0.07, rtol=0)


def test_mining_reproducible_with_generator():
    img, txt = _feats(8, 8, seed=3, dtype=torch.float32)
    sim = img @ txt.T / 0.07
    a = mine_negatives(sim, sim.T, None, "hard", "multinomial", torch.Generator().manual_seed(5))
    b = mine_negatives(sim, sim.T, None, "hard", "multinomial", torch.Generator().manual_seed(5))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_mining_errors():
    one = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="batch size must be >= 2"):
        mine_negatives(one, one, torch.ones(1, 1, dtype=torch.bool))
    sim = torch.randn(3, 3)
    with pytest.raises(ValueError, match="no in-batch negative"):
        mine_negatives(sim, sim, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mode"):
        mine_negatives(sim, sim, None, mode="easy")
    with pytest.raises(ValueError, match="sampling"):
        mine_negatives(sim, sim, None, sampling="topk")
    with pytest.raises(ValueError, match="square"):
        mine_negatives(torch.randn(3, 6), torch.randn(3, 6))


# ----------------------------------------------------------------------------- hardness diagnostic


def test_hardest_negative_similarity_hand_matrix():
    sim = torch.tensor([[0.9, 0.2, 0.5], [0.1, 0.8, 0.3], [0.4, 0.7, 0.6]], requires_grad=True)
    h = hardest_negative_similarity(sim)  # row maxima off the diagonal: 0.5, 0.3, 0.7
    assert h.dim() == 0 and not h.requires_grad
    torch.testing.assert_close(h, torch.tensor(0.5))
    positive = torch.eye(3, dtype=torch.bool)
    positive[0, 2] = positive[2, 0] = True  # pairs 0 and 2 share an image: 0.2, 0.3, 0.7
    torch.testing.assert_close(hardest_negative_similarity(sim, positive), torch.tensor(0.4))
    positive[1] = True  # row 1 has no negative: left out of the mean -> (0.2 + 0.4) / 2
    positive[2, 1] = False
    torch.testing.assert_close(hardest_negative_similarity(sim, positive), torch.tensor(0.45))


# ----------------------------------------------------------------------------- false-negative guard

# Six pairs as GRIT batches them: pairs 0 and 1 are two entries of one image, pairs 2 and 4 carry one
# caption verbatim on two different images. Token rows: [CLS] words [SEP], right-padded with 0.
GUARD_IMAGES = torch.tensor([10, 10, 11, 12, 13, 14])
GUARD_TOKENS = torch.tensor(
    [
        [101, 7, 8, 9, 102, 0, 0],
        [101, 7, 5, 102, 0, 0, 0],
        [101, 3, 4, 5, 6, 102, 0],
        [101, 4, 3, 5, 6, 102, 0],  # pair 2's tokens in another order: a different caption
        [101, 3, 4, 5, 6, 102, 0],
        [101, 3, 4, 5, 102, 0, 0],  # a prefix of pair 2's caption
    ]
)
GUARD_MASK = torch.eye(6, dtype=torch.bool)
GUARD_MASK[0, 1] = GUARD_MASK[1, 0] = True  # same image
GUARD_MASK[2, 4] = GUARD_MASK[4, 2] = True  # same caption


def test_caption_keys():
    keys = caption_keys(GUARD_TOKENS)
    assert keys.shape == (6,) and keys.dtype == torch.int64
    same = keys[:, None] == keys[None, :]
    want = torch.eye(6, dtype=torch.bool)
    want[2, 4] = want[4, 2] = True
    assert torch.equal(same, want)
    # Trailing padding does not count: the same captions cut to the longest row or padded further.
    torch.testing.assert_close(caption_keys(GUARD_TOKENS[:, :6]), keys, rtol=0, atol=0)
    padded = torch.cat([GUARD_TOKENS, torch.zeros(6, 33, dtype=torch.long)], dim=1)
    assert torch.equal(caption_keys(padded), keys)
    assert torch.equal(caption_keys(GUARD_TOKENS.int()), keys)
    # A caption that is a prefix of another (no [SEP]), and many random rows: no collisions.
    assert caption_keys(torch.tensor([[101, 3, 4, 0], [101, 3, 4, 5]])).unique().numel() == 2
    rows = _token_batch(b=2000, length=40, seed=1)
    assert caption_keys(rows).unique().numel() == rows.unique(dim=0).shape[0]
    with pytest.raises(ValueError, match="input_ids"):
        caption_keys(GUARD_TOKENS[0])


def test_false_negative_mask():
    keys = caption_keys(GUARD_TOKENS)
    mask = false_negative_mask(GUARD_IMAGES, keys)
    assert mask.dtype == torch.bool and torch.equal(mask, GUARD_MASK)
    # Against gathered keys (this batch as the second of two ranks): the columns of the other rank
    # match by image (10) or by caption (pair 1's tokens).
    other_images = torch.tensor([10, 20, 21, 22, 23, 24])
    other_keys = caption_keys(GUARD_TOKENS[[3, 1, 0, 0, 5, 5]])
    wide = false_negative_mask(
        GUARD_IMAGES, keys, torch.cat([other_images, GUARD_IMAGES]), torch.cat([other_keys, keys])
    )
    assert wide.shape == (6, 12) and torch.equal(wide[:, 6:], GUARD_MASK)
    want = (GUARD_IMAGES[:, None] == other_images) | (keys[:, None] == other_keys)
    assert torch.equal(wide[:, :6], want)
    assert wide[0, :6].tolist() == [True, False, True, True, False, False]  # image 10; pair 0's caption
    with pytest.raises(ValueError, match="together"):
        false_negative_mask(GUARD_IMAGES, keys, image_keys_all=GUARD_IMAGES)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        false_negative_mask(GUARD_IMAGES, keys[:5])


@pytest.mark.parametrize("mode,sampling", [("hard", "argmax"), ("hard", "multinomial"), ("random", "argmax")])
def test_guarded_mining_never_picks_a_false_negative(mode, sampling):
    positive = false_negative_mask(GUARD_IMAGES, caption_keys(GUARD_TOKENS))
    rows = torch.arange(6)
    g = torch.Generator().manual_seed(0)
    leaked = 0
    for seed in range(30):
        img, txt = _feats(6, 8, seed=seed, dtype=torch.float32)
        # Same-image and same-caption pairs most similar, as they are for a trained model.
        sim = img @ txt.T / 0.07 + 50.0 * positive
        neg_t, neg_i = mine_negatives(sim, sim.T.contiguous(), positive, mode, sampling, generator=g)
        assert not positive[rows, neg_t].any() and not positive[neg_i, rows].any()
        # Without the guard, today's mining picks them.
        off_t, off_i = mine_negatives(sim, sim.T.contiguous(), None, mode, sampling, generator=g)
        leaked += int(positive[rows, off_t].sum() + positive[off_i, rows].sum())
    assert leaked > 0


@pytest.mark.parametrize("mode,sampling", [("hard", "argmax"), ("hard", "multinomial"), ("random", "argmax")])
def test_guard_without_duplicates_is_todays_mining(mode, sampling):
    tokens = GUARD_TOKENS.clone()
    tokens[4, 1] = 9  # no repeated caption
    positive = false_negative_mask(torch.arange(6), caption_keys(tokens))
    assert torch.equal(positive, torch.eye(6, dtype=torch.bool))
    img, txt = _feats(6, 8, seed=8, dtype=torch.float32)
    sim = img @ txt.T / 0.07
    on = mine_negatives(sim, sim.T, positive, mode, sampling, torch.Generator().manual_seed(3))
    off = mine_negatives(sim, sim.T, None, mode, sampling, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    guarded = itc_loss(img, txt, 0.07, 0.2, positive=positive)
    torch.testing.assert_close(guarded["loss_itc"], itc_loss(img, txt, 0.07, 0.2)["loss_itc"], rtol=0, atol=0)


def test_guarded_itc_targets_are_multi_positive():
    img, txt = _feats(6, 16, seed=9)
    positive = false_negative_mask(GUARD_IMAGES, caption_keys(GUARD_TOKENS))
    out = itc_loss(img, txt, 0.07, lambda_cons=0.2, positive=positive)
    # Hand-written soft targets: half on each of the two entries of image 10 and of the repeated caption.
    target = torch.eye(6, dtype=torch.float64)
    target[0, :2] = target[1, :2] = 0.5
    target[2, [2, 4]] = target[4, [2, 4]] = 0.5
    s_i2t, s_t2i = img @ txt.T / 0.07, txt @ img.T / 0.07
    ce = (-(target * s_i2t.log_softmax(1)).sum(1).mean() - (target * s_t2i.log_softmax(1)).sum(1).mean()) / 2
    torch.testing.assert_close(out["loss_itc"], ce)
    _, ref_cons = _reference(img, txt, 0.07, 0.2, target=target)
    torch.testing.assert_close(out["loss_cons"], ref_cons)
    assert not torch.allclose(out["loss_itc"], itc_loss(img, txt, 0.07)["loss_itc"])
    # The hardness diagnostic skips the false negatives too.
    cos = img @ txt.T
    want = cos.masked_fill(positive, float("-inf")).amax(1).mean()
    torch.testing.assert_close(hardest_negative_similarity(cos, positive), want)


# ----------------------------------------------------------------------------- MLM masking

PAD, CLS, SEP, MASK, VOCAB = 0, 101, 102, 103, 1000


def _token_batch(b=512, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(200, VOCAB, (b, length), generator=g)
    ids[:, 0] = CLS
    lengths = torch.randint(5, length, (b,), generator=g)
    pos = torch.arange(length)[None, :]
    ids[pos == lengths[:, None]] = SEP
    ids[pos > lengths[:, None]] = PAD
    return ids


def test_mask_tokens_statistics():
    ids = _token_batch()
    masked, labels = mask_tokens(ids, VOCAB, MASK, [PAD, CLS], 0.5, torch.Generator().manual_seed(0))
    assert masked.shape == ids.shape and labels.shape == ids.shape and masked.dtype == ids.dtype
    selected = labels != -100
    maskable = (ids != PAD) & (ids != CLS)
    assert not (selected & ~maskable).any()  # never [PAD] / [CLS]
    assert selected[ids == SEP].any()  # ALBEF: [SEP] is maskable
    assert torch.equal(labels[selected], ids[selected])
    assert torch.equal(masked[~selected], ids[~selected])
    frac = selected.sum() / maskable.sum()
    assert abs(frac.item() - 0.5) < 0.02
    n = selected.sum().item()
    to_mask = (masked == MASK) & selected
    kept = (masked == ids) & selected
    replaced = selected & ~to_mask & ~kept
    assert abs(to_mask.sum().item() / n - 0.8) < 0.02
    assert abs(kept.sum().item() / n - 0.1) < 0.02
    assert abs(replaced.sum().item() / n - 0.1) < 0.02
    assert masked.min() >= 0 and masked.max() < VOCAB


def test_mask_tokens_reproducible_and_edges():
    ids = _token_batch(8, 12, seed=1)
    a = mask_tokens(ids, VOCAB, MASK, [PAD, CLS], 0.3, torch.Generator().manual_seed(4))
    b = mask_tokens(ids, VOCAB, MASK, [PAD, CLS], 0.3, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    none_masked, labels = mask_tokens(ids, VOCAB, MASK, [PAD, CLS], 0.0)
    assert torch.equal(none_masked, ids) and (labels == -100).all()
    with pytest.raises(ValueError, match="probability"):
        mask_tokens(ids, VOCAB, MASK, [PAD, CLS], 1.5)


# ----------------------------------------------------------------------------- distributed gather


def _gather_worker(rank, world, init_file):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=HANG_GUARD_S),
    )
    try:
        b, d = 3, 8
        img_full, txt_full = _feats(world * b, d, seed=0)
        sl = slice(rank * b, (rank + 1) * b)
        x = img_full[sl].clone().requires_grad_(True)
        out = gather_features(x)
        assert torch.equal(out.detach(), img_full)
        w = torch.randn(world * b, d, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
        (out * w).sum().backward()
        assert torch.equal(x.grad, w[sl])  # gradient only to the local part
        assert torch.equal(concat_all_gather(txt_full[sl]), txt_full)

        img, txt = img_full[sl].clone(), txt_full[sl].clone()
        res = itc_loss(img, txt, 0.07, 0.2, gather=True)
        assert res["sim_i2t"].shape == (b, world * b)
        ref_target = torch.zeros(b, world * b, dtype=img.dtype)
        ref_target[torch.arange(b), torch.arange(b) + rank * b] = 1
        ref_itc, ref_cons = _reference(img, txt, 0.07, 0.2, ref_target, img_full, txt_full)
        torch.testing.assert_close(res["loss_itc"], ref_itc)
        torch.testing.assert_close(res["loss_cons"], ref_cons)
        torch.testing.assert_close(local_columns(res["sim_i2t"]), img @ txt.T / 0.07)

        # False-negative guard over gathered keys. Global pairs 1 and 4 share an image and 1 and 3 a
        # caption across the ranks; 0 and 2 share a caption on rank 0.
        images_full = torch.tensor([0, 1, 2, 3, 1, 5])
        ids_full = torch.tensor([[101, 5, 102], [101, 6, 102], [101, 5, 102], [101, 6, 102], [101, 8, 102],
                                 [101, 9, 102]])
        keys = caption_keys(ids_full[sl])
        positive = false_negative_mask(
            images_full[sl], keys, concat_all_gather(images_full[sl]), concat_all_gather(keys)
        )
        want = false_negative_mask(images_full[sl], keys, images_full, caption_keys(ids_full))
        assert positive.shape == (b, world * b) and torch.equal(positive, want)
        res = itc_loss(img, txt, 0.07, 0.2, positive=positive, gather=True)
        target = positive.to(img.dtype) / positive.sum(1, keepdim=True)
        ref_itc, ref_cons = _reference(img, txt, 0.07, 0.2, target, img_full, txt_full)
        torch.testing.assert_close(res["loss_itc"], ref_itc)
        torch.testing.assert_close(res["loss_cons"], ref_cons)
    finally:
        dist.destroy_process_group()


def test_gather_features_two_processes(tmp_path):
    mp.spawn(_gather_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


def test_gather_identity_without_distributed():
    x = torch.randn(4, 3, requires_grad=True)
    assert gather_features(x) is x
    assert torch.equal(concat_all_gather(x), x) and not concat_all_gather(x).requires_grad
    assert local_columns(x) is x


def test_itm_accuracy_counts_right_pairs_and_matches():
    from models.negatives import itm_accuracy

    # B = 2: pairs [match 0, match 1, (0, neg text), (1, neg text), (neg image, 0), (neg image, 1)]
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [2.0, 0.0], [0.0, 3.0], [1.0, 0.5], [1.0, -1.0]])
    neg_text, neg_image = torch.tensor([1, 0]), torch.tensor([1, 0])
    acc, match = itm_accuracy(logits, neg_text, neg_image)
    assert acc.item() == pytest.approx(4 / 6) and match.item() == pytest.approx(1 / 2)
    # an ITM at chance calls every pair a non-match: 2/3 and 0
    chance = torch.tensor([[1.0, 0.0]]).repeat(6, 1)
    assert [x.item() for x in itm_accuracy(chance, neg_text, neg_image)] == pytest.approx([2 / 3, 0.0])
    # sample 1 bad: every pair holding it is left out, so only match 0 counts (and is right)
    acc, match = itm_accuracy(logits, neg_text, neg_image, valid=torch.tensor([True, False]))
    assert match.item() == 1.0 and acc.item() == 1.0
