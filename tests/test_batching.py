"""Batch construction as one interface (grit.strategies): GRIT, random batches, B3, GCBS and BatchSampler's
random walks behind the same sampler, each keeping GRIT's guarantees (each index at most once an epoch,
fewer than N x W left out and those back next epoch, invalid samples never grouped, mid-epoch resume equal
to an uninterrupted run, the same batches for a seed and world size), plus each strategy's own property:
B3's communities exactly N, GCBS's order a permutation of small bandwidth, the walks never reusing an
example within an epoch; and every grouping strategy's batches harder than random ones."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from grit_sim import clustered_features, hardness, make_samplers, run_epoch

from grit.strategies import NAMES, ONLINE, build
from grit.strategies._graph import cross_similarity, knn_graph, symmetric_csr
from grit.strategies.b3 import exact_parts

# Every grouping strategy the registry finds (grit.strategies.NAMES): a new one is tested here with no edit;
# its options are its config block's defaults unless OPTIONS shrinks them for these small sub-queues. The
# online selection strategies (ONLINE) group nothing: tests/test_online_selection.py.
GROUPING = [name for name in NAMES if name not in ("random", *ONLINE)]
OPTIONS = {"b3": {"rank_skip": 1, "rank_window": 4}, "gcbs": {"neighbours": 4},
           "rwr": {"neighbours": 4, "restart": 0.2}}


def options(strategy: str) -> dict:
    """The strategy's keyword options: its config block's defaults, with OPTIONS' smaller sizes."""
    from training.config import Batching

    return {**Batching().options(strategy), **OPTIONS.get(strategy, {})}


def sampler_kw(strategy: str, L: int = 40, M: int = 20) -> dict:
    return dict(enabled=True, queue_size=L, search_space=M, example_shuffle=True, batch_shuffle=True,
                strategy=strategy, strategy_options=options(strategy))


def all_indices(steps) -> list[int]:
    return [i for step in steps for batch in step for i in batch]


@pytest.mark.parametrize("strategy", GROUPING)
@pytest.mark.parametrize("W", [1, 2])
def test_every_strategy_keeps_the_epoch_rule(strategy, W):
    """Each index at most once an epoch, fewer than N x W left out, every unseen and every invalid index
    of an epoch back in the next one, invalid samples never grouped, and the checkpoint's 'indices' the
    next epoch's global array whose chunk s*W + r is rank r's batch s."""
    D, N = 83, 4
    feats = clustered_features(D, seed=1)
    samplers = make_samplers(D, N, W, sampler_kw(strategy), seed=5)
    bad = {3, 17, 40}
    prev_seen = set(range(D))
    for epoch in range(4):
        steps = run_epoch(samplers, epoch, feats, invalid=bad if epoch == 1 else frozenset())
        seen = all_indices(steps)
        assert len(seen) == len(set(seen)) and D - len(seen) < N * W
        assert set(range(D)) - prev_seen <= set(seen), "an index left out (or invalid) did not come back"
        prev_seen = set(seen) - (bad if epoch == 1 else set())
        nxt = samplers[0].state_dict()["indices"]
        assert nxt.numel() == samplers[0].batches_per_epoch * N * W
        for s in samplers[1:]:
            assert torch.equal(s.state_dict()["indices"], nxt)
        following = run_epoch(make_copy(samplers), epoch + 1, feats, stop_after=None)
        assert [b for step in following for b in step] == nxt.view(-1, N).tolist()


def make_copy(samplers):
    """Fresh samplers resumed from the end-of-epoch states (through a file, as a checkpoint holds them)."""
    out = []
    for s in samplers:
        buffer = io.BytesIO()
        torch.save(s.state_dict(), buffer)
        buffer.seek(0)
        fresh = make_samplers(s.dataset_len, s.batch_size, s.num_replicas,
                              sampler_kw(s.strategy), seed=5)[s.rank]
        fresh.load_state_dict(torch.load(buffer, weights_only=True))
        out.append(fresh)
    return out


@pytest.mark.parametrize("strategy", GROUPING)
def test_every_strategy_is_deterministic_and_resumes_mid_epoch_exactly(strategy):
    """The same seed and world size give the same batches; a mid-epoch resume (queues, partial groups,
    generator through a checkpoint) gives the rest of the epoch and the next epoch of an unbroken run."""
    D, N, W = 90, 4, 2
    feats = clustered_features(D, seed=2)
    whole = make_samplers(D, N, W, sampler_kw(strategy), seed=9)
    again = make_samplers(D, N, W, sampler_kw(strategy), seed=9)
    ref = [run_epoch(whole, e, feats) for e in range(3)]
    assert [run_epoch(again, e, feats) for e in range(3)] == ref
    cut = make_samplers(D, N, W, sampler_kw(strategy), seed=9)
    run_epoch(cut, 0, feats)
    head = run_epoch(cut, 1, feats, stop_after=7)
    resumed = []
    for s in cut:
        buffer = io.BytesIO()
        torch.save(s.state_dict(), buffer)
        buffer.seek(0)
        fresh = make_samplers(D, N, W, sampler_kw(strategy), seed=9)[s.rank]
        fresh.load_state_dict(torch.load(buffer, weights_only=True))
        resumed.append(fresh)
    tail = run_epoch(resumed, 1, feats, start=False)
    assert head + tail == ref[1]
    assert run_epoch(resumed, 2, feats) == ref[2]


def test_a_mid_epoch_state_of_another_strategy_is_refused():
    D, N = 60, 4
    feats = clustered_features(D)
    (s,) = make_samplers(D, N, 1, sampler_kw("grit"))
    run_epoch([s], 0, feats, stop_after=3)
    (other,) = make_samplers(D, N, 1, sampler_kw("gcbs"))
    with pytest.raises(ValueError, match=r"\(batch_size, mode, strategy\) = \(4, 'concurrent', 'grit'\), "
                                         r"now \(4, 'concurrent', 'gcbs'\)"):
        other.load_state_dict(s.state_dict())


@pytest.mark.parametrize("strategy", GROUPING)
def test_grouping_strategies_make_batches_harder_than_random_ones(strategy):
    """On clustered features, the hardest in-batch negative of a grouped epoch is more similar than a
    random epoch's: every strategy does what it is for."""
    D, N = 240, 8
    feats = clustered_features(D, clusters=24, seed=3)
    kw = sampler_kw(strategy, L=120, M=40)
    (grouped,) = make_samplers(D, N, 1, kw, seed=1)
    (plain,) = make_samplers(D, N, 1, dict(kw, strategy="random"), seed=1)
    run_epoch([grouped], 0, feats)
    batches = [b for step in run_epoch([grouped], 1, feats) for b in step]
    random_batches = [b for step in run_epoch([plain], 1, feats) for b in step]
    assert hardness(batches, feats) > hardness(random_batches, feats) + 0.1


def test_random_is_the_disabled_sampler():
    D, N = 50, 4
    feats = clustered_features(D)
    (a,) = make_samplers(D, N, 1, sampler_kw("random"))
    (b,) = make_samplers(D, N, 1, dict(enabled=False, queue_size=None, search_space=None))
    assert a.collector is None and a.strategy == "random"
    assert [run_epoch([a], e, feats) for e in range(2)] == [run_epoch([b], e, feats) for e in range(2)]


# ---------------------------------------------------------------------------- each strategy's own rule


def sub_queue(v: int = 60, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    image, text = clustered_features(v, clusters=6, seed=seed)
    return image[None], text[None], torch.ones(1, v, dtype=torch.bool)


@pytest.mark.parametrize("metis", [True, False])
def test_b3_communities_are_exactly_the_batch_size(metis, monkeypatch):
    """METIS's parts (or, without pymetis, the RCM fallback's) made exactly N, the short one last, every
    entry once: consecutive N of the order are one community."""
    image, text, valid = sub_queue(v=58)
    grouping = build("b3", batch_size=8, rank_skip=1, rank_window=5)
    if not metis:
        monkeypatch.setattr(grouping, "metis", None)
    order = grouping.order(image, text, valid, torch.tensor([7]))[0]
    assert sorted(order.tolist()) == list(range(58))
    labels = grouping.communities(cross_similarity(image[0], text[0]), 7)
    assert np.bincount(labels).tolist() == [8] * 7 + [2]
    chunks = labels[order.numpy()].reshape(-1)
    assert all(len(set(chunks[i:i + 8].tolist())) == 1 for i in range(0, 58, 8))  # a chunk = a community
    # exact_parts on a METIS-like imbalanced labelling: sizes 10, 9, 6, 5 -> 8, 8, 8, 6
    sim = cross_similarity(image[0], text[0])
    graph = symmetric_csr(knn_graph(sim[:30, :30], 4), 30)
    member = np.array([0] * 10 + [1] * 9 + [2] * 6 + [3] * 5)
    balanced = exact_parts(member, graph, 8)
    assert sorted(np.bincount(balanced).tolist()) == [6, 8, 8, 8] and np.bincount(balanced)[-1] == 6


def test_b3_links_each_example_to_its_rank_window():
    """rank_skip p passes over each example's p most similar; the graph links ranks p+1 .. p+m."""
    from grit.strategies._graph import rank_window

    x = -np.inf
    sim = torch.tensor([[x, 0.9, 0.8, 0.7, 0.1], [0.9, x, 0.5, 0.4, 0.3], [0.8, 0.5, x, 0.2, 0.6],
                        [0.7, 0.4, 0.2, x, 0.0], [0.1, 0.3, 0.6, 0.0, x]])
    assert rank_window(sim, 1, 2)[0].tolist() == [2, 3]  # 1 is its nearest: skipped
    assert rank_window(sim, 3, 5).shape == (5, 1)  # only one rank left after skipping 3 of 4


def test_gcbs_order_is_a_permutation_of_small_bandwidth():
    """Reverse Cuthill-McKee: a permutation of the sub-queue whose k-NN graph's bandwidth is well below a
    random order's (neighbours sit close together, so a batch cut from it holds them)."""
    image, text, valid = sub_queue(v=60, seed=4)
    order = build("gcbs", batch_size=8, neighbours=4).order(image, text, valid, torch.zeros(1))[0].numpy()
    assert sorted(order.tolist()) == list(range(60))
    graph = symmetric_csr(knn_graph(cross_similarity(image[0], text[0]), 4), 60).tocoo()

    def bandwidth(perm: np.ndarray) -> int:
        where = np.empty(60, dtype=np.int64)
        where[perm] = np.arange(60)
        return int(np.abs(where[graph.row] - where[graph.col]).max())

    shuffled = np.random.default_rng(0).permutation(60)
    assert bandwidth(order) < bandwidth(shuffled) / 2


def test_random_walks_never_reuse_an_example_and_walk_the_graph():
    """Every example once in the sub-queue's order (with a complete neighbour list and a sparse one); and
    the batches follow the graph: the first batch lies wholly in its start's reach along the neighbour
    lists, and most members of every batch do (a later walk whose reach is used up completes its batch
    with the unused examples nearest its start). Random jumps instead of walks reach a third of that."""
    v, N = 48, 8
    image, text, valid = sub_queue(v=v, seed=5)
    complete = build("rwr", batch_size=N, neighbours=v - 1, restart=0.3)
    assert sorted(complete.order(image, text, valid, torch.tensor([11]))[0].tolist()) == list(range(v))
    grouping = build("rwr", batch_size=N, neighbours=5, restart=0.3)
    order = grouping.order(image, text, valid, torch.tensor([11]))[0].tolist()
    assert sorted(order) == list(range(v))
    nb = knn_graph(cross_similarity(image[0], text[0]), 5)
    reached = []
    for b in range(v // N):
        batch = order[b * N:(b + 1) * N]
        reach, frontier = {batch[0]}, [batch[0]]
        while frontier:
            frontier = [int(j) for i in frontier for j in nb[i] if int(j) not in reach]
            reach.update(frontier)
        reached.append(sum(x in reach for x in batch[1:]))
    assert reached[0] == N - 1 and sum(reached) >= 0.75 * (v - v // N), reached


def test_invalid_entries_come_last_in_every_strategy():
    image, text, _ = sub_queue(v=30)
    valid = torch.ones(1, 30, dtype=torch.bool)
    valid[0, [2, 9, 20]] = False
    for name in GROUPING:
        grouping = build(name, batch_size=4, **options(name))
        order = grouping.order(image, text, valid, grouping.draw(1, 30, torch.Generator().manual_seed(0)))[0]
        assert sorted(order.tolist()) == list(range(30))
        assert set(order[-3:].tolist()) == {2, 9, 20}, name


def test_strategy_names_and_a_missing_one():
    assert NAMES[0] == "random" and {"grit", "b3", "gcbs", "rwr"} <= set(NAMES) and build("random", 4) is None
    # the config's allowed values are exactly the strategies there are, each block a strategy's options
    import typing

    from training.config import Batching

    hint = typing.get_type_hints(Batching)["strategy"]  # never null: random is a strategy of its own
    assert typing.get_origin(hint) is typing.Literal
    assert set(typing.get_args(hint)) == set(NAMES)
    for name in NAMES[1:]:
        assert build(name, 4, **Batching().options(name)).name == name
    with pytest.raises(ValueError, match="batching.strategy must be one of"):
        build("greedy", 4)


def test_the_sampler_deals_the_strategys_own_order():
    """One sub-queue holding the whole epoch, no shuffles: the next epoch is exactly the strategy's order
    of the examples in the order they were collected (GCBS has no randomness of its own); the other
    strategies deal batches of their own, not GRIT's."""
    D, N = 48, 4
    feats = clustered_features(D, seed=6)
    kw = dict(sampler_kw("gcbs", L=D, M=D), example_shuffle=False, batch_shuffle=False)
    (s,) = make_samplers(D, N, 1, kw)
    collected = torch.tensor(all_indices(run_epoch([s], 0, feats)))
    order = build("gcbs", batch_size=N, **options("gcbs")).order(
        feats[0][collected][None], feats[1][collected][None], torch.ones(1, D, dtype=torch.bool),
        torch.zeros(1))[0]
    assert torch.equal(s.state_dict()["indices"].long(), collected[order])
    dealt = {}
    for name in GROUPING:
        (t,) = make_samplers(D, N, 1, dict(kw, strategy=name, strategy_options=options(name)))
        run_epoch([t], 0, feats)
        dealt[name] = t.state_dict()["indices"].tolist()
    assert len({tuple(v) for v in dealt.values()}) == len(GROUPING)


def test_strategy_bench_measures_every_strategy(capsys):
    """tools.strategy_bench at small sizes: one JSON line, a row per strategy with its fill time, its share
    of the step by the documented arithmetic, and batches harder than random ones."""
    import json

    from tools.strategy_bench import main

    record = main(["--queue_size", "480", "--search_space", "240", "--batch_size", "8", "--dim", "16",
                   "--clusters", "24", "--repeats", "1", "--step_seconds", "0.5"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert [r["strategy"] for r in record["strategies"]] == sorted(GROUPING)
    for row in record["strategies"]:
        # both rounded in the record (fill to 1 ms, share to 1e-5): equal within that rounding
        assert row["share_of_step"] == pytest.approx(8 * row["fill_seconds"] / 480 / 0.5, rel=0, abs=3e-5)
        assert row["hardness"] > record["random_hardness"], row


def test_a_missing_graph_package_names_the_extra(monkeypatch):
    import sys

    from grit.strategies._graph import require

    monkeypatch.setitem(sys.modules, "scipy", None)  # `import scipy` now raises ImportError
    with pytest.raises(ImportError, match=r"'gcbs' needs scipy: pip install scipy .*grit-vlp\[strategies\]"):
        require("scipy", "gcbs")
