"""GritSampler in one process: W ranks simulated by W samplers fed the same gathered batches."""

import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from grit_sim import DIM, clustered_features, hardness, make_samplers, run_epoch

GRIT = dict(enabled=True, queue_size=40, search_space=24, example_shuffle=True, batch_shuffle=True,
            mode="concurrent", warmstart_indices=None, shard_grouping=True)
OFF = dict(GRIT, enabled=False, queue_size=None, search_space=None)  # a config's `batching.strategy: random`


@pytest.mark.parametrize("W", [1, 2, 3])
def test_epoch_properties(W):
    N, D = 4, 103  # D not divisible by N*W; L=40 not a multiple of M=24 nor of N*W
    feats = clustered_features(D)
    samplers = make_samplers(D, N, W, GRIT)
    invalid = {5, 17, 60}
    left_out_prev = None
    seen_any = set()
    for epoch in range(4):
        steps = run_epoch(samplers, epoch, feats, invalid=invalid if epoch == 1 else frozenset())
        T = D // (N * W)
        assert len(steps) == T and all(len(s) == T * N for s in samplers)
        flat = [i for step in steps for batch in step for i in batch]
        assert len(flat) == len(set(flat)) == T * N * W  # no repeats, whole batches
        left_out = set(range(D)) - set(flat)
        assert len(left_out) < N * W
        arrays = [s.epoch_indices() for s in samplers]
        assert all(torch.equal(a, arrays[0]) for a in arrays)
        chunks = arrays[0].view(-1, N).tolist()
        for k, step in enumerate(steps):  # rank r of global step s gets chunk s*W + r
            assert step == chunks[k * W:(k + 1) * W]
        if left_out_prev is not None:
            # indices not seen last epoch are used now; the ones left out are different
            assert not (left_out_prev & left_out)
        if epoch == 2:
            assert invalid <= set(flat)  # invalid in epoch 1 -> not in G -> back in epoch 2
        left_out_prev = left_out | (invalid if epoch == 1 else set())
        seen_any |= set(flat)
        states = [s.state_dict() for s in samplers]
        assert all(torch.equal(st["indices"], states[0]["indices"]) for st in states)
        assert states[0]["indices"].numel() == T * N * W
    assert seen_any == set(range(D))


def test_same_seed_same_G_and_different_seed_differs():
    D, N = 96, 4
    feats = clustered_features(D)
    out = []
    for seed in (0, 0, 1):
        (s,) = make_samplers(D, N, 1, GRIT, seed=seed)
        run_epoch([s], 0, feats)
        run_epoch([s], 1, feats)
        out.append(s.state_dict()["indices"])
    assert torch.equal(out[0], out[1]) and not torch.equal(out[0], out[2])


def test_grouped_batches_are_harder_than_random():
    D, N = 512, 8
    feats = clustered_features(D, clusters=32, seed=3)
    (s,) = make_samplers(D, N, 1, dict(GRIT, queue_size=256, search_space=128))
    random_steps = run_epoch([s], 0, feats)
    grouped_steps = run_epoch([s], 1, feats)
    h_random = hardness([b for st in random_steps for b in st], feats)
    h_grouped = hardness([b for st in grouped_steps for b in st], feats)
    assert h_grouped > h_random + 0.15, (h_grouped, h_random)


@pytest.mark.parametrize("W", [1, 2])
def test_resume_mid_epoch_is_exact(W):
    D, N = 101, 4
    feats = clustered_features(D)
    invalid = {3, 44}
    ref = make_samplers(D, N, W, GRIT)
    run_epoch(ref, 0, feats)
    full_steps = run_epoch(ref, 1, feats, invalid=invalid)
    ref_next = ref[0].state_dict()["indices"]

    run = make_samplers(D, N, W, GRIT)
    run_epoch(run, 0, feats)
    stop = 13 if W == 1 else 7  # 52 or 56 rows: past the first queue fill (L=40), mid-queue
    head = run_epoch(run, 1, feats, stop_after=stop, invalid=invalid)
    assert head == full_steps[:stop]
    assert run[0].collector.ptr > 0 and run[0].state_dict()["indices"].numel() > 0
    blobs = []
    for s in run:
        buf = io.BytesIO()
        torch.save(s.state_dict(), buf)
        blobs.append(buf.getvalue())
    resumed = make_samplers(D, N, W, GRIT)
    for s, blob in zip(resumed, blobs):
        s.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
        s.set_epoch(1)
        assert len(s) == (len(full_steps) - stop) * N
    tail = run_epoch(resumed, 1, feats, invalid=invalid, start=False)
    assert tail == full_steps[stop:]
    assert torch.equal(resumed[0].state_dict()["indices"], ref_next)
    # an end-of-epoch checkpoint resumes into the same next epoch
    buf = io.BytesIO()
    torch.save(resumed[0].state_dict(), buf)
    fresh = make_samplers(D, N, W, GRIT)
    for s in fresh:
        buf.seek(0)
        s.load_state_dict(torch.load(buf, weights_only=True))
    assert run_epoch(fresh, 2, feats) == run_epoch(ref, 2, feats)


def test_disabled_is_distributed_sampler_order_and_resumes():
    D, N, W = 50, 4, 2
    samplers = make_samplers(D, N, W, dict(GRIT, enabled=False))
    assert all(s.collector is None for s in samplers)
    steps = run_epoch(samplers, 3, clustered_features(D))
    perm = torch.randperm(D, generator=torch.Generator().manual_seed(3)).tolist()  # seed + epoch
    assert [i for st in steps for b in st for i in b] == perm[:len(steps) * N * W]
    assert make_samplers(D, N, W, OFF)[0].state_dict()["indices"].numel() == 0
    # mid-epoch resume works without GRIT too (position = collect() calls)
    first = make_samplers(D, N, W, OFF)
    head = run_epoch(first, 4, clustered_features(D), stop_after=2)
    again = make_samplers(D, N, W, OFF)
    for a, b in zip(again, first):
        a.load_state_dict(b.state_dict())
    tail = run_epoch(again, 4, clustered_features(D))
    assert head + tail == run_epoch(make_samplers(D, N, W, OFF), 4, clustered_features(D))


def test_shuffle_switches():
    D, N = 64, 4
    (s,) = make_samplers(D, N, 1, dict(GRIT, batch_shuffle=False))
    G = torch.arange(D - 6).flip(0)  # pretend G; the 6 unseen ones come first
    arr = s._compose(G, epoch=1)
    chunks = arr.view(-1, N)
    assert set(chunks[0].tolist()) | set(chunks[1].tolist()) >= set(range(D - 6, D))
    pos = {int(g): k for k, g in enumerate(G)}
    order = [pos[int(c[-1])] for c in chunks[2:]]
    assert order == sorted(order)  # no chunk shuffle: G's order kept
    for c in chunks[2:].tolist():  # G's chunks stay aligned to multiples of N from G's start
        p = [pos[i] for i in c]
        assert p[0] % N == 0 and p == list(range(p[0], p[0] + N))
    (s2,) = make_samplers(D, N, 1, GRIT)
    order2 = [pos.get(int(c[-1]), -1) for c in s2._compose(G, epoch=1).view(-1, N)]
    assert order2 != sorted(order2)

    # no example shuffle and L == M: a sub-queue is exactly one queue fill in arrival order
    feats = clustered_features(D)
    (s3,) = make_samplers(D, N, 1, dict(GRIT, example_shuffle=False, queue_size=16, search_space=16))
    steps = run_epoch([s3], 0, feats)
    arrival = [i for st in steps for b in st for i in b]
    G3 = s3.state_dict()["indices"]
    # chunks of G3 that hold no unseen index come from one fill of 16 arrivals
    fills = [set(arrival[k:k + 16]) for k in range(0, len(arrival), 16)]
    for c in G3.view(-1, N).tolist():
        if set(c) <= set(arrival):
            assert any(set(c) <= f for f in fills)


def test_naive_mode_groups_the_current_epoch():
    D, N = 256, 8
    feats = clustered_features(D, clusters=16, seed=5)
    grit = dict(GRIT, mode="naive", queue_size=128, search_space=64)
    (s,) = make_samplers(D, N, 1, grit)
    calls = []

    def naive_pass(indices):
        calls.append(indices.clone())
        for k in range(0, indices.numel(), N):
            b = indices[k:k + N]
            yield feats[0][b], feats[1][b], b

    with pytest.raises(ValueError, match="naive_pass"):
        s.set_epoch(0)
    s.set_epoch(0, naive_pass=naive_pass)
    assert calls[0].numel() == len(s) == (D // N) * N
    batches = [b for st in run_epoch([s], 0, feats, start=False) for b in st]
    (plain,) = make_samplers(D, N, 1, dict(grit, enabled=False))
    random_batches = [b for st in run_epoch([plain], 0, feats) for b in st]
    assert hardness(batches, feats) > hardness(random_batches, feats) + 0.15
    s.set_epoch(1, naive_pass=naive_pass)
    assert len(calls) == 2 and not torch.equal(calls[0], calls[1])


@pytest.mark.parametrize("suffix", [".pt", ".npy", ".json"])
def test_warmstart_indices(tmp_path, suffix):
    D, N = 40, 4
    G = torch.randperm(D, generator=torch.Generator().manual_seed(9))
    path = str(tmp_path / f"G{suffix}")
    if suffix == ".pt":
        torch.save(G, path)
    elif suffix == ".npy":
        np.save(path, G.numpy())
    else:
        json.dump(G.tolist(), open(path, "w"))
    (s,) = make_samplers(D, N, 1, dict(GRIT, warmstart_indices=path))
    s.set_epoch(0)
    chunks = {tuple(c) for c in s.epoch_indices().view(-1, N).tolist()}
    assert chunks <= {tuple(c) for c in G.view(-1, N).tolist()}


def test_bad_input_errors(tmp_path):
    D, N = 64, 8
    with pytest.raises(ValueError, match="GritSampler: search_space"):
        make_samplers(D, N, 1, dict(GRIT, search_space=4))
    with pytest.raises(ValueError, match="GritSampler: queue_size"):
        make_samplers(D, N, 1, dict(GRIT, queue_size=16, search_space=24))
    with pytest.raises(ValueError, match="GritSampler: mode"):
        make_samplers(D, N, 1, dict(GRIT, mode="fast"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'serch_space'"):
        make_samplers(D, N, 1, dict(GRIT, serch_space=4))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        make_samplers(10, N, 2, GRIT)
    with pytest.raises(FileNotFoundError, match="batching.warmstart_indices"):
        make_samplers(D, N, 1, dict(GRIT, warmstart_indices=str(tmp_path / "missing.pt")))
    for bad in (torch.arange(D).view(8, 8), torch.tensor([0, 1, 1]), torch.tensor([0, D])):
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(ValueError, match="batching.warmstart_indices"):
            make_samplers(D, N, 1, dict(GRIT, warmstart_indices=str(tmp_path / "bad.pt")))

    (s,) = make_samplers(D, N, 1, dict(GRIT, queue_size=16, search_space=8))
    s.set_epoch(0)
    x = F.normalize(torch.randn(N, DIM), dim=-1)
    idx = torch.arange(N)
    with pytest.raises(ValueError, match="image_feat"):
        s.collect(x[:, :3], x, idx)
    with pytest.raises(ValueError, match="index"):
        s.collect(x, x, idx.float())
    nan = x.clone()
    nan[2, 0] = float("nan")
    s.collect(x, nan, idx)  # checked once per fill, at grouping time
    with pytest.raises(ValueError, match="text_feat.*NaN"):
        s.collect(x, x, idx + N)
    (s,) = make_samplers(D, N, 1, dict(GRIT, queue_size=16, search_space=8))
    s.collect(x, x, idx + D)
    with pytest.raises(ValueError, match=r"index .*\[0, 64\)"):
        s.collect(x, x, idx)
    (s,) = make_samplers(D, N, 1, dict(GRIT, queue_size=16, search_space=8))
    s.collect(x, x, idx)
    s.collect(x, x, idx)
    with pytest.raises(ValueError, match="more than once"):
        s.end_epoch()
    s = make_samplers(D, N, 2, GRIT)[0]
    with pytest.raises(ValueError, match="collect_global"):
        s.collect(x, x, idx)


def test_collector_drops_invalid_and_handles_overflow():
    from grit import GritCollector

    D = 50
    image, text = clustered_features(D)
    c = GritCollector(queue_size=12, search_space=5, dim=DIM, dataset_len=D)
    c.reset(seed=0)
    valid = torch.ones(D, dtype=torch.bool)
    valid[[3, 20, 21, 49]] = False
    for k in range(0, D, 7):  # batches of 7 do not divide L=12, which does not divide by M=5
        sl = slice(k, min(k + 7, D))
        c.add(image[sl], text[sl], torch.arange(D)[sl], valid[sl])
    G = c.finalize()
    assert sorted(G.tolist()) == torch.nonzero(valid).flatten().tolist()


def test_no_host_sync_in_collect_and_chain(monkeypatch):
    from grit import greedy_chain

    D, N, W = 64, 4, 2
    image, text = clustered_features(D)
    s = make_samplers(D, N, W, dict(GRIT, queue_size=40, search_space=24))[0]
    s.set_epoch(0)
    order = list(iter(s))

    def boom(*args, **kwargs):
        raise AssertionError("host synchronisation")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    idx = torch.tensor(order[:N * W])
    valid = torch.ones(N * W, dtype=torch.bool)
    s.collect_global(image[idx], text[idx], idx, valid)  # 8 of 40 queue slots: no grouping yet
    v = F.normalize(torch.randn(3, 10, DIM), dim=-1)
    greedy_chain(v, v.flip(1), torch.tensor([0, 4, 9]), valid=torch.ones(3, 10, dtype=torch.bool))


def test_group_from_epoch_keeps_the_first_epochs_random_and_resumes():
    D, N = 96, 4
    feats = clustered_features(D)
    late = dict(GRIT, group_from_epoch=3)
    (paper,) = make_samplers(D, N, 1, GRIT)
    (s,) = make_samplers(D, N, 1, late)
    (off,) = make_samplers(D, N, 1, OFF)
    assert (paper.first_grouped, s.first_grouped) == (1, 3)
    for epoch in range(3):  # random batches (DistributedSampler's order), nothing collected before epoch 2
        steps = run_epoch([s], epoch, feats)
        assert steps == run_epoch([off], epoch, feats)
        assert (s.collector.ptr > 0 or s.state_dict()["indices"].numel() > 0) == (epoch == 2)
    # epoch 3 is grouped from epoch 2's features, as the paper's epoch 1 is from epoch 0's
    grouped = run_epoch([s], 3, feats)
    assert grouped != run_epoch([off], 3, feats)
    assert hardness([b for st in grouped for b in st], feats) > hardness(
        [b for st in run_epoch([off], 4, feats) for b in st], feats)
    # a mid-epoch resume in a random epoch that collects (epoch 2) is exact
    (a,) = make_samplers(D, N, 1, late)
    for epoch in range(2):
        run_epoch([a], epoch, feats)
    run_epoch([a], 2, feats, stop_after=5)
    (b,) = make_samplers(D, N, 1, late)
    b.load_state_dict(a.state_dict())
    b.set_epoch(2)
    run_epoch([b], 2, feats, start=False)
    (ref,) = make_samplers(D, N, 1, late)
    for epoch in range(3):
        run_epoch([ref], epoch, feats)
    assert torch.equal(b.state_dict()["indices"], ref.state_dict()["indices"])
    with pytest.raises(ValueError, match="group_from_epoch"):
        make_samplers(D, N, 1, dict(late, warmstart_indices="unused.pt"))
