"""GRIT: grouped mini-batch sampling (GRIT-VLP, Sec. 3.1 and Algorithms 1-2).

Sizes: per-rank batch N, world size W, global batch B = N*W, search space M (grit.search_space),
queue L (grit.queue_size), dataset D; N <= M <= L. T = D // B global steps per epoch.

Phases
  1. collect: after every training step `GritSampler.collect` gathers the step's L2-normalised image/text
     projections and dataset indices from all ranks (two all_gathers) and appends them to queues of size L.
     L need not be a multiple of B: a batch that overflows the queue spills into the next fill.
  2. example shuffle: a full queue is permuted (one permutation for features and indices) and split into
     sub-queues of M. If L is not a multiple of M, the last sub-queue of every fill is shorter
     (L mod M entries); so is the last one of the partial queue grouped at epoch end.
  3. grouping: `greedy_chain` runs all sub-queues of a fill at once on the queue's device (short
     sub-queues are padded with entries that are chained last and stripped). Positions map to dataset
     indices that are appended to the epoch's array G. One host sync per fill checks that the features
     are finite and the indices in range.
  4. batch shuffle (at end_epoch, for the next epoch): the indices not in G (the < B left out of this
     epoch, invalid samples) are put in random order in front of G, completed to whole chunks by the last
     indices of G; the result (all D indices once) is cut into C = D // N chunks of N (the D mod N tail,
     from G, is left out); C - T*W chunks are dropped, drawn at random among the chunks that hold no
     unseen index; the kept chunks are shuffled; global step s, rank r gets chunk s*W + r, so every local
     batch is one group. Hence within an epoch no index repeats, fewer than B indices are left out, they
     change every epoch, and an index left out of one epoch is used in the next (always, unless more
     than T*B indices were unseen), so none is lost. Chunks line up with sub-queues when M is a
     multiple of N and L of M (paper: N=128, M=1920, L=48000).

Invalid samples: collect(..., valid=mask) with False marks a sample (e.g. non-finite loss) that must not
be grouped. It is queued with a validity flag and zero features (NaNs are allowed there), is chained
after all valid entries of its sub-queue, becomes -1 in G and is dropped from G at end_epoch; next epoch
it is put back like an unseen index. No host sync per step is needed for this.

First epoch / disabled: DistributedSampler's permutation (seeded by seed + epoch; arange if shuffle is
false) cut into whole global batches and dealt as above; grit.warmstart_indices (a .pt/.pth LongTensor,
a checkpoint or sampler state with 'indices', .npy or .json list) replaces it by a precomputed G.
grit.mode 'naive' (paper Remark 2) builds G at set_epoch(epoch, naive_pass=fn) from an extra no-grad pass
over a fresh random permutation and uses it for that same epoch; fn(indices) receives this rank's share
(T*N indices, in per-rank batch order) and returns an iterable of local (image_feat, text_feat, index
[, valid]) batches. grit.example_shuffle / grit.batch_shuffle false skip phase 2 / the chunk shuffle of
phase 4 (the dropped chunks stay random). Random streams: torch.Generators seeded from (seed, epoch).

GritSampler(shuffle=False) only affects those plain epochs; drop_last=False is rejected (whole batches,
no repeats). collect() must be called exactly once per training batch on every rank, in every mode.

Resume: the position is the number of collect() calls since set_epoch (so the training script calls
nothing extra); sampler.start_batch is where this epoch's iteration began (0, or the resumed position),
so the global step of loader batch i is epoch * sampler.batches_per_epoch + sampler.start_batch + i.
state_dict() holds the epoch, position, the current epoch's array, the queues (up to the pointer,
float32), the pointer, the collector's generator state and 'indices': G so far during an epoch
(concurrent mode), or after end_epoch() the next epoch's global array (T*B,) (empty when there is none:
GRIT disabled, naive mode); torch.load(weights_only=True) reads it. After load_state_dict a set_epoch
with the saved epoch resumes: __iter__ yields only the remaining batches, len() counts only those, and
the next G equals that of an uninterrupted run; a finished-epoch state goes on with set_epoch(epoch + 1).
A mid-epoch state loads on another number of ranks too (same batch_size and mode): the rows of the epoch
array the saving ranks had not dealt are cut into whole global batches of the new ranks, in their order,
so each index is still seen at most once over both parts; the fewer than B rows left over
(sampler.left_out_on_resume) are never collected and come back next epoch; start_batch = T - steps
left, so the epoch still ends after batches_per_epoch steps.
Every set_epoch and end_epoch checks (two all_reduces of a checksum) that all ranks hold the same array
and raises RuntimeError otherwise.

Per epoch, on every rank:
    sampler.set_epoch(epoch[, naive_pass=fn])    # no-op when resuming mid-epoch in the same epoch
    for batch in loader:          # DataLoader(batch_size=N, sampler=sampler, drop_last=True)
        out = model(...)
        sampler.collect(out['image_feat'], out['text_feat'], idx[, valid])
    sampler.end_epoch()
    checkpoint['sampler'] = sampler.state_dict()
"""

from .chain import greedy_chain
from .collector import GritCollector
from .config import load_index_array, option_problems
from .sampler import GritSampler

__all__ = ["greedy_chain", "GritCollector", "GritSampler", "load_index_array", "option_problems"]
