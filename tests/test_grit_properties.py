"""Properties of every epoch a sampler deals, over drawn seeds, world sizes, sizes and bad-sample masks
(hypothesis). GRIT's rule (grit/__init__.py, phase 4): each index at most once an epoch, fewer than N x W
left out, every index left out of epoch e (or collected as invalid there) back in epoch e + 1 whenever at
most T x B indices were unseen, and every rank's local batch one chunk of N of the G it was cut from.
The fine-tuning sampler keeps the first two (it is DistributedSampler: a fresh permutation each epoch, so
an index left out may be left out again) and resumes on the batch it stopped at.

The `ci` profile (tests/conftest.py) is derandomised: the same examples on every run; a failure prints
the falsifying example. HYPOTHESIS_PROFILE=dev draws new examples each run, and more of them.
"""

from __future__ import annotations

import numpy as np
import torch
from grit_sim import clustered_features, make_samplers, run_epoch
from hypothesis import given, note
from hypothesis import strategies as st

from training.loaders import ResumableSampler

EPOCHS = 4


@st.composite
def grit_runs(draw, mode: str = "concurrent", max_world: int = 4) -> dict:
    """Sizes N <= M <= L, world size 1-max_world, a dataset of at least two global batches (D need not
    divide by N, N x W or L), the two shuffle switches, a seed, and a bad-sample rate per epoch."""
    W = draw(st.integers(1, max_world), label="W")
    N = draw(st.integers(1, 6), label="N")
    M = draw(st.integers(N, 3 * N + 4), label="M")
    L = draw(st.integers(M, 3 * M + 5), label="L")
    D = draw(st.integers(2 * N * W, 4 * N * W + 13), label="D")
    return {"W": W, "N": N, "M": M, "L": L, "D": D, "mode": mode,
            "example_shuffle": draw(st.booleans(), label="example_shuffle"),
            "batch_shuffle": draw(st.booleans(), label="batch_shuffle"),
            "seed": draw(st.integers(0, 2**16), label="seed"),
            "bad_rate": draw(st.lists(st.sampled_from([0.0, 0.0, 0.1, 0.3, 0.9]), min_size=EPOCHS,
                                      max_size=EPOCHS), label="bad_rate")}


def simulate(run: dict) -> list[dict]:
    """Train EPOCHS epochs on W simulated ranks -> per epoch: the dealt steps, the epoch array, the bad
    samples collected, and the G the next epoch was composed from (spied on GritSampler._compose)."""
    W, N, D = run["W"], run["N"], run["D"]
    grit = dict(enabled=True, queue_size=run["L"], search_space=run["M"], mode=run["mode"],
                example_shuffle=run["example_shuffle"], batch_shuffle=run["batch_shuffle"],
                warmstart_indices=None, shard_grouping=True)
    samplers = make_samplers(D, N, W, grit, seed=run["seed"])
    composed: list[torch.Tensor] = []
    spied = samplers[0]._compose

    def compose(G: torch.Tensor, epoch: int) -> torch.Tensor:
        composed.append(G.clone())
        return spied(G, epoch)

    samplers[0]._compose = compose
    feats = clustered_features(D, seed=run["seed"])
    rng = np.random.default_rng(run["seed"])
    epochs = []
    for epoch in range(EPOCHS):
        bad = frozenset(np.flatnonzero(rng.random(D) < run["bad_rate"][epoch]).tolist())
        before = len(composed)
        if run["mode"] == "naive":
            def naive_pass(indices: torch.Tensor, bad=bad):
                """The no-grad pass over this rank's share, the bad samples marked invalid."""
                for batch in indices.split(N):
                    valid = torch.tensor([int(i) not in bad for i in batch], dtype=torch.bool)
                    yield feats[0][batch], feats[1][batch], batch, valid
            for s in samplers:
                s.set_epoch(epoch, naive_pass=naive_pass)
            steps = run_epoch(samplers, epoch, feats, start=False)
        else:
            steps = run_epoch(samplers, epoch, feats, invalid=bad)
        arrays = [s.epoch_indices() for s in samplers]
        assert all(torch.equal(a, arrays[0]) for a in arrays), "ranks hold different epoch arrays"
        G = composed[before] if len(composed) > before else None
        epochs.append({"steps": steps, "array": arrays[0], "bad": bad, "G": G})
    return epochs


def check_epoch(e: dict, N: int, W: int, D: int) -> set[int]:
    """Each index at most once, whole global batches, fewer than N x W left out, rank r of step s given
    chunk s*W + r of the epoch array -> the indices used."""
    T = D // (N * W)
    steps, chunks = e["steps"], e["array"].view(-1, N).tolist()
    assert len(steps) == T
    flat = [i for step in steps for batch in step for i in batch]
    assert len(flat) == len(set(flat)) == T * N * W, "an index twice, or not whole batches"
    assert len(set(range(D)) - set(flat)) < N * W, "N x W or more indices left out"
    for s, step in enumerate(steps):
        assert step == chunks[s * W:(s + 1) * W], f"step {s} is not chunks {s * W}..{s * W + W - 1}"
    return set(flat)


def check_groups(batches: list[list[int]], G: torch.Tensor, D: int, N: int) -> None:
    """Every batch holding no unseen index is one of G's chunks of N, cut from G's start after the k
    indices that filled up the unseen ones' last chunk; the unseen ones fill at most ceil(u / N) batches."""
    G = G.tolist()
    unseen = set(range(D)) - set(G)
    k = min((-len(unseen)) % N, len(G))
    rest = G[:len(G) - k]
    groups = {tuple(rest[i:i + N]) for i in range(0, len(rest) - N + 1, N)}
    mixed = [b for b in batches if unseen & set(b)]
    assert len(mixed) <= -(-len(unseen) // N)
    for b in batches:
        if not unseen & set(b):
            assert tuple(b) in groups, f"batch {b} is not one group of G"


@given(grit_runs())
def test_grit_epoch_rule_holds_for_every_drawn_run(run):
    """GRIT concurrent (the paper's mode): the rule above in every epoch of every drawn run."""
    N, W, D = run["N"], run["W"], run["D"]
    T = D // (N * W)
    epochs = simulate(run)
    for epoch, e in enumerate(epochs):
        note(f"epoch {epoch}: array {e['array'].tolist()}, bad {sorted(e['bad'])}")
        used = check_epoch(e, N, W, D)
        # The spied G: this epoch's valid indices, each once, in grouped order.
        assert e["G"] is not None and sorted(e["G"].tolist()) == sorted(used - e["bad"])
        if epoch:
            prev = epochs[epoch - 1]
            check_groups([b for step in e["steps"] for b in step], prev["G"], D, N)
            unseen = set(range(D)) - set(prev["G"].tolist())
            if len(unseen) <= T * N * W:
                missing = unseen - used
                assert not missing, f"left out (or bad) in epoch {epoch - 1}, not back in {epoch}: {missing}"


@given(grit_runs(mode="naive", max_world=1))
def test_grit_naive_epochs_are_groups_of_their_own_pass(run):
    """Naive GRIT (Remark 2) groups a fresh permutation for the same epoch: each index at most once,
    fewer than N x W left out, G free of the bad samples, each batch one group of that epoch's G. One
    simulated rank: the naive pass runs per rank (two ranks: tests/test_pretrain.py)."""
    N, W, D = run["N"], run["W"], run["D"]
    for e in simulate(run):
        check_epoch(e, N, W, D)
        G = e["G"].tolist()
        assert len(G) == len(set(G)) and not set(G) & e["bad"]
        check_groups([b for step in e["steps"] for b in step], e["G"], D, N)


@given(W=st.integers(1, 4), N=st.integers(1, 6), extra=st.integers(0, 40), seed=st.integers(0, 2**16),
       start=st.integers(0, 3))
def test_finetune_sampler_epochs_and_resume(W, N, extra, seed, start):
    """ResumableSampler (fine-tuning): every rank the same number of whole batches, no index twice in an
    epoch, fewer than N x W left out; start_batch k yields exactly the batches after the first k."""
    D = N * W + extra
    for epoch in range(3):
        per_rank = []
        for r in range(W):
            s = ResumableSampler(list(range(D)), num_replicas=W, rank=r, shuffle=True, seed=seed,
                                 drop_last=True, batch_size=N)
            s.set_epoch(epoch)
            full = list(s)[:s.batches_per_epoch * N]  # the loader's drop_last
            k = min(start, s.batches_per_epoch)
            s.start_batch = k
            assert list(s)[:(s.batches_per_epoch - k) * N] == full[k * N:]
            assert len(s) == len(list(s))
            per_rank.append(full)
        assert len({len(p) for p in per_rank}) == 1
        flat = [i for p in per_rank for i in p]
        assert len(flat) == len(set(flat)) and D - len(flat) < N * W


def _through_a_file(state: dict) -> dict:
    """A state as a checkpoint holds it: saved and loaded (weights only)."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@given(run=grit_runs(max_world=3), new_world=st.integers(1, 4), stop=st.integers(0, 6),
       disabled=st.booleans())
def test_mid_epoch_resume_on_another_number_of_ranks(run, new_world, stop, disabled):
    """A GritSampler state saved mid-epoch by W ranks continues on W' ranks: the rest of the epoch array
    is dealt in whole global batches of the new ranks, so over both parts every index of the epoch is
    seen at most once, the new ranks leave out fewer than N x W' of the rest, the epoch still ends after
    batches_per_epoch steps, and (GRIT) every index unseen in the epoch is back in the next one whenever
    at most T' x B' were unseen; on the same W the resume is the saved run exactly."""
    W, N, D = run["W"], run["N"], run["D"]
    new_world = min(new_world, D // N)  # at least one global batch of the new ranks
    grit = dict(enabled=not disabled, queue_size=run["L"], search_space=run["M"],
                example_shuffle=run["example_shuffle"], batch_shuffle=run["batch_shuffle"])
    if disabled:
        grit.update(queue_size=None, search_space=None)
    feats = clustered_features(D, seed=run["seed"])
    old = make_samplers(D, N, W, grit, seed=run["seed"])
    run_epoch(old, 0, feats)
    stop = min(stop, old[0].batches_per_epoch - 1)  # stopped inside the epoch
    head = run_epoch(old, 1, feats, stop_after=stop)
    array = old[0].epoch_indices()
    state = _through_a_file(old[0].state_dict())
    new = make_samplers(D, N, new_world, grit, seed=run["seed"])
    for s in new:
        s.load_state_dict(state)
    T2, B2 = new[0].batches_per_epoch, N * new_world
    rest = array.numel() - stop * N * W
    note(f"rest {rest}, T' {T2}, start_batch {new[0].start_batch}")
    assert new[0].start_batch == T2 - rest // B2 and new[0].left_out_on_resume == rest % B2 < B2
    tail = run_epoch(new, 1, feats, start=False)
    assert len(tail) == T2 - new[0].start_batch
    if new_world == W:
        ref = make_samplers(D, N, W, grit, seed=run["seed"])
        run_epoch(ref, 0, feats)
        assert head + tail == run_epoch(ref, 1, feats)
    seen = [i for step in head + tail for batch in step for i in batch]
    assert len(seen) == len(set(seen)) and set(seen) <= set(array.tolist())
    assert array.numel() - len(seen) == new[0].left_out_on_resume
    nxt = run_epoch(new, 2, feats, stop_after=0)
    assert nxt == [] and new[0].epoch_indices().numel() == T2 * B2
    unseen = set(range(D)) - set(seen)
    if not disabled and len(unseen) <= T2 * B2:
        assert unseen <= set(new[0].epoch_indices().tolist())


@given(W=st.integers(1, 4), new_world=st.integers(1, 4), N=st.integers(1, 6), extra=st.integers(0, 40),
       seed=st.integers(0, 2**16), stop=st.integers(0, 5))
def test_finetune_sampler_resumes_on_another_number_of_ranks(W, new_world, N, extra, seed, stop):
    """ResumableSampler: the first s steps of W ranks used the first s x N x W entries of the epoch's
    permutation; W' ranks deal the rest in whole global batches, so the two parts together see each
    planned index at most once and leave out fewer than N x W' of the rest; the same W resumes exactly."""
    D = N * max(W, new_world) + extra

    def samplers(world: int) -> list[ResumableSampler]:
        return [ResumableSampler(list(range(D)), num_replicas=world, rank=r, shuffle=True, seed=seed,
                                 drop_last=True, batch_size=N) for r in range(world)]

    old = samplers(W)
    for s in old:
        s.set_epoch(1)
    T = old[0].batches_per_epoch
    stop = min(stop, T)
    whole = [list(s)[:T * N] for s in old]
    head = [i for r in range(W) for i in whole[r][:stop * N]]
    state = {**old[0].state_dict(), "position": stop, "in_progress": 1}
    new = samplers(new_world)
    tail = []
    for s in new:
        s.load_state_dict(_through_a_file(state))
        s.set_epoch(1)
        assert len(s) == len(list(s)) == (s.batches_per_epoch - s.start_batch) * N
        tail.append(list(s))
    if new_world == W:
        assert tail == [w[stop * N:] for w in whole]
    seen = head + [i for t in tail for i in t]
    planned = T * N * W
    assert len(seen) == len(set(seen)) and planned - len(seen) == new[0].left_out_on_resume < N * new_world
    assert set(seen) <= {i for w in whole for i in w}
    for s in new:  # the next epoch is an ordinary one on the new ranks
        s.set_epoch(2)
        assert s.start_batch == 0 and len(list(s)) == s.batches_per_epoch * N
