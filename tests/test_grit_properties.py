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
