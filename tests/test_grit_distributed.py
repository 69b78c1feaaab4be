"""GritSampler under a real 2-process gloo group on CPU."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from grit import GritSampler

D, N, DIM = 83, 4, 8
GRIT = dict(enabled=True, queue_size=20, search_space=12, example_shuffle=True, batch_shuffle=True,
            mode="concurrent", warmstart_indices=None, shard_grouping=True)


def _features():
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(D, DIM, generator=g), dim=-1)
    return image, F.normalize(image + 0.3 * torch.randn(D, DIM, generator=g), dim=-1)


def _epoch(sampler, epoch, image, text, naive_pass=None):
    sampler.set_epoch(epoch, naive_pass=naive_pass)
    batches = []
    mine = list(iter(sampler))
    for k in range(0, len(mine), N):
        idx = torch.tensor(mine[k:k + N])
        sampler.collect(image[idx], text[idx], idx)  # local tensors: the sampler gathers itself
        batches.append(idx.tolist())
    sampler.end_epoch()
    return batches


def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    image, text = _features()
    result = {}
    s = GritSampler(D, batch_size=N, **GRIT, dim=DIM, seed=3)  # num_replicas/rank from the group
    result["world"] = (s.num_replicas, s.rank)
    result["epoch0"] = _epoch(s, 0, image, text)
    result["epoch1"] = _epoch(s, 1, image, text)
    state = s.state_dict()
    result["indices"] = state["indices"].clone()

    def naive_pass(indices):
        for k in range(0, indices.numel(), N):
            b = indices[k:k + N]
            yield image[b], text[b], b

    naive = GritSampler(D, batch_size=N, **dict(GRIT, mode="naive"), dim=DIM, seed=3)
    result["naive"] = _epoch(naive, 0, image, text, naive_pass=naive_pass)
    result["naive_array"] = naive.epoch_indices()

    # a corrupted index array on one rank must be caught at the next epoch boundary, on every rank
    if rank == 1:
        state["indices"][[0, 1]] = state["indices"][[1, 0]]
    fresh = GritSampler(D, batch_size=N, **GRIT, dim=DIM, seed=3)
    fresh.load_state_dict(state)
    try:
        fresh.set_epoch(2)
        result["error"] = ""
    except RuntimeError as e:
        result["error"] = str(e)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_process_gloo(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert r0["world"] == (2, 0) and r1["world"] == (2, 1)
    T = D // (2 * N)
    for key in ("epoch0", "epoch1", "naive"):
        a, b = r0[key], r1[key]
        assert len(a) == len(b) == T
        flat = [i for batch in a + b for i in batch]
        assert len(flat) == len(set(flat)) == T * 2 * N  # disjoint batches, no repeats
    assert torch.equal(r0["indices"], r1["indices"])  # same G on both ranks
    assert torch.equal(r0["naive_array"], r1["naive_array"])
    # batch s of rank r is chunk 2*s + r of the shared array
    chunks = r0["naive_array"].view(-1, N).tolist()
    assert r0["naive"] == chunks[0::2] and r1["naive"] == chunks[1::2]
    for r in (r0, r1):
        assert "differs between ranks" in r["error"] and "epoch 2" in r["error"]
