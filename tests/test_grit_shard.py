"""GRIT grouping split across ranks (batching.shard_grouping): every rank chains only its sub-queues, the
chains are all-gathered, and G equals the unsharded grouping exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grit.collector import GritCollector
from tools.grit_bench import clustered_features
from training.config import Batching

# 2 full fills of 6 sub-queues and a partial one of 68 entries (5 sub-queues, the last one short):
# uneven shares for W = 2 (3 + 2) and W = 3 (2 + 2 + 1).
N_SAMPLES, QUEUE, SEARCH, DIM, BATCH = 260, 96, 16, 8, 10
# the batching block's defaults, strategy grit
GRIT_ON = Batching(strategy='grit', queue_size=QUEUE, search_space=SEARCH).sampler_options()


def _features() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    image, text = clustered_features(N_SAMPLES, DIM, clusters=12, seed=5, device=torch.device('cpu'))
    valid = torch.ones(N_SAMPLES, dtype=torch.bool)
    valid[::17] = False  # invalid samples too (bad samples, skipped steps)
    return image, text, valid


def _grouping(shard: bool, strategy: str = "grit") -> torch.Tensor:
    from grit.strategies import build

    image, text, valid = _features()
    options = {"b3": {"rank_skip": 1, "rank_window": 4}, "rwr": {"neighbours": 4}}.get(strategy, {})
    collector = GritCollector(QUEUE, SEARCH, DIM, N_SAMPLES, shard=shard,
                              grouping=build(strategy, BATCH // 2, **options))
    collector.reset(seed=11)
    for start in range(0, N_SAMPLES, BATCH):
        part = slice(start, start + BATCH)
        collector.add(image[part], text[part], torch.arange(N_SAMPLES)[part], valid[part])
    return collector.finalize()


def _worker(rank: int, world: int, init_file: str, out_dir: str, strategy: str) -> None:
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        torch.save(_grouping(shard=True, strategy=strategy), os.path.join(out_dir, f'G{rank}.pt'))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize('world, strategy', [(1, 'grit'), (2, 'grit'), (3, 'grit'), (2, 'b3'), (2, 'rwr')])
def test_sharded_grouping_equals_unsharded(tmp_path, world, strategy):
    """Every strategy's random numbers are drawn for all sub-queues on every rank, so a sub-queue's order
    is the same whichever rank computes it."""
    torch.set_num_threads(1)
    reference = _grouping(shard=False, strategy=strategy)
    assert reference.numel() == int(_features()[2].sum())  # every valid sample grouped once
    mp.spawn(_worker, args=(world, str(tmp_path / 'init'), str(tmp_path), strategy), nprocs=world, join=True)
    for rank in range(world):
        assert torch.equal(torch.load(tmp_path / f'G{rank}.pt', weights_only=True), reference), rank


def test_sharding_changes_the_work_not_the_result(monkeypatch):
    """With W ranks, a rank's greedy_chain calls see only every W-th sub-queue (here W faked as 3)."""
    import grit.collector as collector_module
    import grit.strategies.grit as chain_module

    seen = []
    chain = chain_module.greedy_chain

    def counting_chain(image, *args, **kwargs):
        seen.append(image.shape[0])
        return chain(image, *args, **kwargs)

    def fake_gather(x):  # this rank's chains, repeated as if the other ranks had sent the same shape
        return torch.cat([x] * 3)

    monkeypatch.setattr(chain_module, 'greedy_chain', counting_chain)
    monkeypatch.setattr(collector_module.gdist, 'world_info', lambda: (3, 0))
    monkeypatch.setattr(collector_module.gdist, 'all_gather_cat', fake_gather)
    _grouping(shard=True)
    assert seen == [2, 2, 2]  # 6, 6 and 5 sub-queues: rank 0 chains sub-queues 0 and 3 of each fill


def test_bench_sharded_mode_reports_per_rank_times_and_memory(capsys, tmp_path):
    from tools import grit_bench

    result = grit_bench.main(['--worlds', '1', '2', '--queue_size', '256', '--search_space', '64',
                              '--dim', '8', '--repeats', '1', '--clusters', '8',
                              '--output-dir', str(tmp_path)])  # the hyphenated alias of --output_dir
    assert capsys.readouterr().out.strip().startswith('{')
    assert json.loads((tmp_path / 'grit_bench.json').read_text()) == json.loads(json.dumps(result))
    assert set(result['worlds']) == {'1', '2'} and result['subqueues_per_fill'] == 4
    assert all(row['max_rank_cpu_s'] > 0 and row['max_rank_wall_s'] > 0 for row in result['worlds'].values())
    laion = result['memory']['LAION-400M (L=48000)']
    assert laion['G_int64_bytes'] == 3_200_000_000 and laion['G_int32_bytes'] == 1_600_000_000


def _sampler_epochs(index_dtype: torch.dtype, epochs: int = 3) -> tuple[list[list[int]], dict]:
    """Batches of `epochs` GRIT epochs (one process), features looked up by dataset index."""
    from grit.sampler import GritSampler

    image, text, valid = _features()
    sampler = GritSampler(N_SAMPLES, num_replicas=1, rank=0, seed=4, batch_size=BATCH, dim=DIM,
                          index_dtype=index_dtype, **GRIT_ON)
    batches = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        mine = torch.tensor(list(iter(sampler)))
        for idx in mine.view(-1, BATCH):
            sampler.collect(image[idx], text[idx], idx, valid[idx])
            batches.append(idx.tolist())
        sampler.end_epoch()
    return batches, sampler.state_dict()


def test_int32_and_int64_index_arrays_give_the_same_batches():
    from grit.sampler import GritSampler

    small, state32 = _sampler_epochs(torch.int32)
    large, state64 = _sampler_epochs(torch.int64)
    assert small == large
    assert state32['indices'].dtype == torch.int32 and state64['indices'].dtype == torch.int64
    assert torch.equal(state32['indices'].long(), state64['indices'])
    # a checkpoint written with int64 arrays (before int32) resumes into an int32 sampler
    resumed = GritSampler(N_SAMPLES, num_replicas=1, rank=0, seed=4, batch_size=BATCH, dim=DIM, **GRIT_ON)
    assert resumed.index_dtype == torch.int32  # the default when the dataset fits
    resumed.load_state_dict(state64)
    resumed.set_epoch(3)
    assert resumed.epoch_indices().dtype == torch.int32
    assert torch.equal(resumed.epoch_indices().long(), state64['indices'])
    with pytest.raises(ValueError, match='cannot hold'):
        GritSampler(2**31, num_replicas=1, rank=0, batch_size=8, index_dtype=torch.int32,
                    **Batching(strategy='random').sampler_options())
