"""GritSampler in one process: W ranks simulated by W samplers fed the same gathered batches (the
helpers that tests/test_grit_sampler.py and tests/test_grit_properties.py share)."""

import torch
import torch.nn.functional as F

from grit import GritSampler

DIM = 16


def clustered_features(D: int, clusters: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture of Gaussians: image = centre + noise, text = image + noise, both L2-normalised -> (D, DIM)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, DIM, generator=g)
    image = centres[torch.randint(0, clusters, (D,), generator=g)] + 0.6 * torch.randn(D, DIM, generator=g)
    text = image + 0.3 * torch.randn(D, DIM, generator=g)
    return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


def make_samplers(D, N, W, grit, seed=0, **kw):
    return [GritSampler(D, num_replicas=W, rank=r, seed=seed, batch_size=N, dim=DIM, **grit, **kw)
            for r in range(W)]


def run_epoch(samplers, epoch, feats, stop_after=None, invalid=frozenset(), start=True):
    """One epoch on all simulated ranks -> list of global steps, each a list of W local index batches."""
    image, text = feats
    N = samplers[0].batch_size
    if start:
        for s in samplers:
            s.set_epoch(epoch)
    per_rank = [list(iter(s)) for s in samplers]
    assert all(len(p) == len(s) and len(p) % N == 0 for p, s in zip(per_rank, samplers))
    steps = []
    for k in range(len(per_rank[0]) // N):
        if stop_after is not None and k == stop_after:
            return steps
        local = [torch.tensor(p[k * N:(k + 1) * N]) for p in per_rank]
        idx = torch.cat(local)
        valid = torch.tensor([int(i) not in invalid for i in idx])
        img = image[idx].clone()
        img[~valid] = float("nan")  # invalid samples may carry garbage
        for s in samplers:
            s.collect_global(img, text[idx], idx, valid if invalid else None)
        steps.append([b.tolist() for b in local])
    for s in samplers:
        s.end_epoch()
    return steps


def hardness(batches, feats):
    """Mean over anchors (both directions) of the hardest in-batch negative similarity."""
    image, text = feats
    vals = []
    for b in batches:
        b = torch.tensor(b)
        sim = image[b] @ text[b].T
        sim.fill_diagonal_(float("-inf"))
        vals.append(0.5 * (sim.max(1).values.mean() + sim.max(0).values.mean()))
    return float(torch.stack(vals).mean())
