"""greedy_chain against a plain Python transcription of the definition (DESIGN.md, GRIT phase 3)."""

import pytest
import torch
import torch.nn.functional as F

from grit import greedy_chain
from grit.chain import ChainWorkspace


def reference_chain(v: torch.Tensor, t: torch.Tensor, start: int) -> list[int]:
    """p_i = argmax over unvisited j of v[p_{i-1}].t[j] (i odd) or t[p_{i-1}].v[j] (i even); lowest j wins."""
    vl, tl = v.double().tolist(), t.double().tolist()
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))
    chain, visited = [start], {start}
    for i in range(1, len(vl)):
        prev = chain[-1]
        best, best_j = None, None
        for j in range(len(vl)):
            if j in visited:
                continue
            score = dot(vl[prev], tl[j]) if i % 2 == 1 else dot(tl[prev], vl[j])
            if best is None or score > best:  # strict: the first (lowest) index wins ties
                best, best_j = score, j
        chain.append(best_j)
        visited.add(best_j)
    return chain


def check_against_reference(v, t, start):
    out = greedy_chain(v, t, start)
    assert out.shape == v.shape[:2] and out.dtype == torch.long
    for s in range(v.shape[0]):
        assert sorted(out[s].tolist()) == list(range(v.shape[1]))
        assert out[s].tolist() == reference_chain(v[s], t[s], int(start[s])), f"sub-queue {s}"


# M above 64 spans several blocks of the step loop's two-level argmax, with (130, 200) and without (128)
# padding of the last block.
@pytest.mark.parametrize("S,M", [(1, 1), (3, 1), (2, 2), (1, 7), (4, 8), (5, 17), (3, 32), (2, 128),
                                 (1, 200)])
def test_matches_reference_random(S, M):
    g = torch.Generator().manual_seed(S * 100 + M)
    v = F.normalize(torch.randn(S, M, 16, generator=g), dim=-1)
    t = F.normalize(v + 0.7 * torch.randn(S, M, 16, generator=g), dim=-1)
    start = torch.randint(0, M, (S,), generator=g)
    check_against_reference(v, t, start)


@pytest.mark.parametrize("S,M", [(4, 2), (3, 9), (2, 16), (2, 31), (2, 128), (2, 130)])
def test_matches_reference_exact_ties(S, M):
    # Integer features make every dot product exact in float32, and {-1, 0, 1}^3 gives many equal scores.
    g = torch.Generator().manual_seed(M)
    v = torch.randint(-1, 2, (S, M, 3), generator=g).float()
    t = torch.randint(-1, 2, (S, M, 3), generator=g).float()
    start = torch.randint(0, M, (S,), generator=g)
    check_against_reference(v, t, start)


def test_duplicated_vectors_tie_to_lowest_index():
    g = torch.Generator().manual_seed(0)
    base = F.normalize(torch.randn(4, 8, generator=g), dim=-1)
    v = base.repeat(3, 1)  # rows k, k+4, k+8 identical
    t = v.clone()
    out = greedy_chain(v, t, torch.tensor(0))
    assert out.shape == (12,)
    assert out.tolist() == reference_chain(v, t, 0)
    # From 0, the best text is its copy with the lowest unvisited index: 4, then 8.
    assert out[:3].tolist() == [0, 4, 8]


def test_torch_argmax_returns_first_maximum():
    # greedy_chain relies on this documented behaviour for its tie rule, also for wide rows.
    row = torch.zeros(3, 5000)
    row[1, 17] = row[1, 4000] = 1.0
    row[2] = float("-inf")
    assert torch.argmax(row, dim=1).tolist() == [0, 17, 0]


def test_two_dimensional_input_and_int_start():
    g = torch.Generator().manual_seed(1)
    v = F.normalize(torch.randn(6, 4, generator=g), dim=-1)
    t = F.normalize(torch.randn(6, 4, generator=g), dim=-1)
    out = greedy_chain(v, t, 5)
    assert out.shape == (6,) and out.tolist() == reference_chain(v, t, 5)
    assert greedy_chain(v, t, torch.tensor([5])).tolist() == out.tolist()


def test_invalid_entries_are_chained_last():
    g = torch.Generator().manual_seed(2)
    S, M = 3, 12
    v = F.normalize(torch.randn(S, M, 8, generator=g), dim=-1)
    t = F.normalize(v + 0.3 * torch.randn(S, M, 8, generator=g), dim=-1)
    valid = torch.rand(S, M, generator=g) > 0.35
    valid[:, 0] = True
    out = greedy_chain(v, t, torch.zeros(S, dtype=torch.long), valid=valid)
    for s in range(S):
        keep = torch.nonzero(valid[s]).flatten()
        n = keep.numel()
        assert sorted(out[s].tolist()) == list(range(M))
        assert valid[s, out[s, :n]].all() and not valid[s, out[s, n:]].any()
        # The valid prefix is the chain of the valid entries alone (position 0 is valid and first).
        sub = reference_chain(v[s, keep], t[s, keep], 0)
        assert out[s, :n].tolist() == keep[sub].tolist()


def test_bad_shapes():
    v = torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="same shape"):
        greedy_chain(v, torch.randn(2, 5, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="start"):
        greedy_chain(v, v, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="valid"):
        greedy_chain(v, v, torch.zeros(2, dtype=torch.long), valid=torch.ones(5, dtype=torch.bool))


def test_workspace_reuse_gives_the_same_chains():
    # The collector keeps one workspace for every fill, whose last fill of an epoch is smaller.
    g = torch.Generator().manual_seed(3)
    workspace = ChainWorkspace()
    for S, M in [(3, 70), (2, 33), (3, 70), (4, 90)]:
        v = F.normalize(torch.randn(S, M, 8, generator=g), dim=-1)
        t = F.normalize(v + 0.5 * torch.randn(S, M, 8, generator=g), dim=-1)
        start = torch.randint(0, M, (S,), generator=g)
        assert torch.equal(greedy_chain(v, t, start, workspace=workspace), greedy_chain(v, t, start))
    assert workspace.get("sim", (2, 3, 3), torch.device("cpu")).shape == (2, 3, 3)


def test_bench_runs_small_and_agrees_with_the_reference(capsys):
    from tools import grit_bench
    result = grit_bench.main(["--queue-size", "512", "--search-space", "128", "--dim", "16",
                              "--batch-size", "16", "--repeats", "1", "--ref-subqueues", "0",
                              "--clusters", "20"])
    assert capsys.readouterr().out.strip().startswith("{")
    assert result["reference_chains_identical"] == "4/4" and not result["reference_extrapolated"]
    assert result["grouping_s_per_fill"] > 0 and result["speedup_vs_reference"] > 0
    hard = result["hardness"]
    assert hard["random_batches"] < hard["grouped_batches"] <= hard["search_space_ceiling"] + 1e-6


def reference_skip_chain(v: torch.Tensor, t: torch.Tensor, start: int, skip: int,
                         valid: list[bool] | None = None) -> list[int]:
    """rank_skip p: p_i = the (p+1)-th most similar unvisited valid entry (the last valid one when fewer are
    left), alternating as the paper's chain; invalid entries after every valid one."""
    vl, tl = v.double().tolist(), t.double().tolist()
    valid = valid or [True] * len(vl)
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))
    chain, visited = [start], {start}
    for i in range(1, len(vl)):
        prev = chain[-1]
        scores = {j: dot(vl[prev], tl[j]) if i % 2 == 1 else dot(tl[prev], vl[j]) for j in range(len(vl))}
        score = scores.__getitem__
        left = [j for j in range(len(vl)) if j not in visited and valid[j]]
        if left:
            ranked = sorted(left, key=lambda j: -score(j))
            pick = ranked[min(skip, len(ranked) - 1)]
        else:
            pick = max((j for j in range(len(vl)) if j not in visited), key=score)
        chain.append(pick)
        visited.add(pick)
    return chain


@pytest.mark.parametrize("S,M,skip", [(2, 9, 1), (3, 17, 2), (2, 70, 4), (1, 5, 10)])
def test_rank_skip_matches_reference(S, M, skip):
    g = torch.Generator().manual_seed(7 * M + skip)
    v = F.normalize(torch.randn(S, M, 16, generator=g), dim=-1)
    t = F.normalize(v + 0.7 * torch.randn(S, M, 16, generator=g), dim=-1)
    valid = torch.rand(S, M, generator=g) > 0.2
    start = torch.where(valid, torch.rand(S, M, generator=g), -1.0).argmax(dim=1)
    out = greedy_chain(v, t, start, valid=valid, rank_skip=skip)
    for s in range(S):
        assert sorted(out[s].tolist()) == list(range(M))
        assert out[s].tolist() == reference_skip_chain(v[s], t[s], int(start[s]), skip, valid[s].tolist())
        n_valid = int(valid[s].sum())
        assert valid[s][out[s][:n_valid]].all()  # the valid entries first


def test_rank_skip_zero_is_the_paper_chain_and_skipping_changes_it():
    g = torch.Generator().manual_seed(3)
    v = F.normalize(torch.randn(2, 40, 8, generator=g), dim=-1)
    t = F.normalize(v + 0.5 * torch.randn(2, 40, 8, generator=g), dim=-1)
    start = torch.tensor([0, 5])
    assert torch.equal(greedy_chain(v, t, start, rank_skip=0), greedy_chain(v, t, start))
    assert not torch.equal(greedy_chain(v, t, start, rank_skip=2), greedy_chain(v, t, start))
    with pytest.raises(ValueError, match="rank_skip"):
        greedy_chain(v, t, start, rank_skip=-1)
