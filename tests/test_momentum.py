"""models/momentum.py: EMA copies of encoder pairs and the retrieval feature queues."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import momentum
from models.momentum import FeatureQueue, MomentumPairs


def _pair(seed):
    torch.manual_seed(seed)
    make = lambda: nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    return make(), make()


def test_build_copies_and_freezes():
    (a, a_m), (b, b_m) = _pair(0), _pair(1)
    pairs = MomentumPairs.build([(a, a_m), (b, b_m)])
    for online, mom in ((a, a_m), (b, b_m)):
        for p, q in zip(online.parameters(), mom.parameters()):
            assert torch.equal(p, q) and q.data_ptr() != p.data_ptr()
            assert not q.requires_grad and p.requires_grad
    assert isinstance(pairs, MomentumPairs)


def test_momentum_update_formula():
    (a, a_m), (b, b_m) = _pair(0), _pair(1)
    pairs = MomentumPairs.build([(a, a_m), (b, b_m)])
    with torch.no_grad():  # move the online weights so that the EMA has something to do
        for p in list(a.parameters()) + list(b.parameters()):
            p.add_(torch.randn_like(p))
    before = [q.clone() for q in list(a_m.parameters()) + list(b_m.parameters())]
    online = [p.clone() for p in list(a.parameters()) + list(b.parameters())]
    m = 0.9
    pairs.update(m)
    after = list(a_m.parameters()) + list(b_m.parameters())
    for q0, p, q in zip(before, online, after):
        torch.testing.assert_close(q, m * q0 + (1 - m) * p)
    for p, p0 in zip(list(a.parameters()) + list(b.parameters()), online):
        assert torch.equal(p, p0)  # the online models are untouched
    pairs.update(0.0)  # m = 0 copies
    for p, q in zip(a.parameters(), a_m.parameters()):
        torch.testing.assert_close(q, p)


def test_copy_after_load():
    a, a_m = _pair(0)
    pairs = MomentumPairs([(a, a_m)])  # no copy yet
    assert not torch.equal(a[0].weight, a_m[0].weight)
    pairs.copy_()
    assert torch.equal(a[0].weight, a_m[0].weight)


def test_mismatched_pairs():
    a, _ = _pair(0)
    with pytest.raises(ValueError, match="shape"):
        MomentumPairs([(a, nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(6), nn.Linear(6, 3)))])
    with pytest.raises(ValueError, match="parameters"):
        MomentumPairs([(a, nn.Linear(4, 6))])


def _unit(n, d, seed):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def test_queue_init():
    torch.manual_seed(0)
    q = FeatureQueue(8, 5)
    assert q.image_queue.shape == (8, 5) and q.text_queue.shape == (8, 5) and q.idx_queue.shape == (1, 5)
    torch.testing.assert_close(q.image_queue.norm(dim=0), torch.ones(5))
    torch.testing.assert_close(q.text_queue.norm(dim=0), torch.ones(5))
    assert (q.idx_queue == -100).all() and q.queue_ptr.tolist() == [0]
    assert set(q.state_dict()) == {"image_queue", "text_queue", "idx_queue", "queue_ptr"}
    with pytest.raises(ValueError, match="positive"):
        FeatureQueue(8, 0)


def test_queue_wraparound_contents():
    q = FeatureQueue(8, 5)  # K = 5 is not a multiple of B = 2
    img, txt = _unit(6, 8, 1), _unit(6, 8, 2)
    idx = torch.tensor([10, 11, 12, 13, 14, 15])
    for step in range(3):
        sl = slice(2 * step, 2 * step + 2)
        q.enqueue(img[sl], txt[sl], idx[sl])
    # Writes: cols 0,1 <- rows 0,1; cols 2,3 <- rows 2,3; cols 4,0 <- rows 4,5 (wrap-around).
    order = [5, 1, 2, 3, 4]
    torch.testing.assert_close(q.image_queue, img[order].T)
    torch.testing.assert_close(q.text_queue, txt[order].T)
    assert q.idx_queue.tolist() == [[15, 11, 12, 13, 14]]
    assert q.queue_ptr.tolist() == [1]
    with pytest.raises(ValueError, match="exceed queue_size"):
        q.enqueue(_unit(6, 8, 3), _unit(6, 8, 4), torch.arange(6))
    with pytest.raises(ValueError, match="idx"):
        q.enqueue(img[:2], txt[:2], idx[:3])


def test_queue_state_dict_roundtrip():
    q = FeatureQueue(4, 6)
    q.enqueue(_unit(4, 4, 0), _unit(4, 4, 1), torch.arange(4))
    r = FeatureQueue(4, 6)
    r.load_state_dict(q.state_dict())
    img, txt = _unit(4, 4, 2), _unit(4, 4, 3)
    q.enqueue(img, txt, torch.arange(4, 8))
    r.enqueue(img, txt, torch.arange(4, 8))  # continues from the restored pointer
    for name, buf in q.state_dict().items():
        assert torch.equal(buf, r.state_dict()[name]), name
    assert r.queue_ptr.tolist() == [2]


def test_queue_bank_positives():
    q = FeatureQueue(8, 4)
    q.enqueue(_unit(2, 8, 0), _unit(2, 8, 1), torch.tensor([7, 3]))
    img_m, txt_m = _unit(3, 8, 2), _unit(3, 8, 3)
    image_bank, text_bank, positive = q.bank(img_m, txt_m, torch.tensor([3, 5, 3]))
    assert image_bank.shape == (7, 8) and text_bank.shape == (7, 8)
    torch.testing.assert_close(image_bank, torch.cat([img_m, q.image_queue.T]))
    torch.testing.assert_close(text_bank, torch.cat([txt_m, q.text_queue.T]))
    # columns: batch ids [3, 5, 3], queue ids [7, 3, -100, -100]
    want = torch.tensor([
        [1, 0, 1, 0, 1, 0, 0],
        [0, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 1, 0, 0],
    ], dtype=torch.bool)
    assert torch.equal(positive, want)


def test_queue_enqueue_gathers_all_ranks(monkeypatch):
    # Stand-in for a 2-rank all-gather (the real one runs in test_objectives' gloo test): this rank
    # is rank 0 and the peer contributes the rows that follow it in `peer`.
    img, txt = _unit(8, 4, 0), _unit(8, 4, 1)
    idx = torch.arange(8)
    peer = {}

    def fake_gather(x):
        return torch.cat([x, peer[x.data_ptr()]])

    monkeypatch.setattr(momentum, "concat_all_gather", fake_gather)
    q = FeatureQueue(4, 6)
    for step in range(2):  # rank r contributes rows [4*step + 2*r, 4*step + 2*r + 2)
        lo = 4 * step
        local = (img[lo : lo + 2], txt[lo : lo + 2], idx[lo : lo + 2])
        for full, x in zip((img, txt, idx), local):
            peer[x.data_ptr()] = full[lo + 2 : lo + 4]
        q.enqueue(*local)
    # 4 gathered rows per step into K = 6: step 0 -> cols 0..3, step 1 -> cols 4, 5, 0, 1.
    order = [6, 7, 2, 3, 4, 5]
    assert torch.equal(q.image_queue, img[order].T)
    assert torch.equal(q.text_queue, txt[order].T)
    assert q.idx_queue.tolist() == [order]
    assert q.queue_ptr.tolist() == [2]
