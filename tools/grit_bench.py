"""Benchmark GRIT grouping: `python -m tools.grit_bench [--queue_size 48000 ...]` prints one JSON line.

Times the vectorised `greedy_chain` (all sub-queues of one queue fill at once) against a plain
per-sub-queue, per-step Python loop of Algorithm 2 on the same inputs — both for a fill after the first
(the similarity tables' memory reused, as the collector does every fill) and for a first fill — and
measures batch hardness (mean over anchors of the hardest in-batch negative similarity, both directions)
on clustered synthetic features: batches of N cut from G, random batches of N, and the hardest negative
within the whole sub-queue of M (the ceiling a group of N can approach).

`--worlds 1 2 4` instead times the grouping of one queue fill split across W gloo processes
(grit.shard_grouping): per rank, its wall time and its CPU time (one thread per rank, so on a machine
with fewer cores than ranks the CPU time is the fair measure of the work) against the single-rank
fill; it also gives the memory of G and of the queues at the paper's and at LAION-400M sizes.
`--scale 10000000 100000000` instead measures GritSampler itself at web scale, each D in a fresh process:
a sampler resumed at the last step of an epoch (G of D - L/2 grouped examples, half a queue of random
features: no training), then end_epoch (the partial queue's grouping, the duplicate check, composing the
next epoch) and the next set_epoch timed, with the bytes of the index arrays it holds and the peak resident
memory above them; and the per-rank figures extrapolated to LAION-400M.
With --output_dir the JSON object is also written to DIR/grit_bench.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# _transpose_last2 is the chain's own table copy: timed here on its own to split the grouping time up.
from grit.chain import ChainWorkspace, _transpose_last2, greedy_chain
from grit.collector import GritCollector
from tools.cli import add_output_dir, emit_record, tool_parser
from training.cli import Parser, run_main


def reference_grouping(image_feats: torch.Tensor, text_feats: torch.Tensor, start: int) -> list[int]:
    """Algorithm 2 of the S.M. as written, one sub-queue, one step at a time: feats (M, d) -> M positions.

    Softmax both ways, then per step exclude_index, which zeroes the visited example's row and column in
    both probability matrices (done before the argmax, so that the chain never revisits an example: the
    rule p_i = argmax over unvisited j), and the argmax of the current row (host sync per step via int()).
    """
    similarity = image_feats.float() @ text_feats.float().T
    p_v2t = similarity.softmax(dim=1)
    p_t2v = similarity.T.softmax(dim=1)
    M = similarity.shape[0]
    chain, prev, use_v2t = [start], start, True
    for _ in range(M - 1):
        for p in (p_v2t, p_t2v):  # exclude_index(matrix, pre_index), column first: never revisit
            p[:, prev] = 0
        cur = int(torch.argmax(p_v2t[prev] if use_v2t else p_t2v[prev]))
        for p in (p_v2t, p_t2v):
            p[prev, :] = 0
        chain.append(cur)
        prev, use_v2t = cur, not use_v2t
    return chain


def clustered_features(n: int, dim: int, clusters: int, seed: int, device: torch.device,
                       spread: float = 1.0, text_noise: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture of Gaussians: image = centre + noise, text = image + noise, L2-normalised -> (n, dim) x 2."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=g) / math.sqrt(dim)
    image = centres[torch.randint(0, clusters, (n,), generator=g)]
    image = image + spread * torch.randn(n, dim, generator=g) / math.sqrt(dim)
    text = image + text_noise * torch.randn(n, dim, generator=g) / math.sqrt(dim)
    return F.normalize(image, dim=-1).to(device), F.normalize(text, dim=-1).to(device)


def batch_hardness(image: torch.Tensor, text: torch.Tensor, batches: torch.Tensor) -> float:
    """Mean hardest in-batch negative similarity: feats (n, d), batches (B, N) positions -> float."""
    sim = torch.bmm(image[batches], text[batches].transpose(1, 2))  # (B, N, N)
    eye = torch.eye(batches.shape[1], dtype=torch.bool, device=sim.device)
    sim = sim.masked_fill(eye, float("-inf"))
    return float(0.5 * (sim.amax(dim=2).mean() + sim.amax(dim=1).mean()))


def build_parser() -> Parser:
    """The benchmark's command line."""
    p = tool_parser("tools.grit_bench", __doc__.splitlines()[0])
    p.add_argument("--queue_size", type=int, default=48000,
                   help="L: examples per queue fill (default: 48000)")
    p.add_argument("--search_space", type=int, default=1920, help="M: sub-queue size (default: 1920)")
    p.add_argument("--dim", type=int, default=256, help="feature dimension (default: 256)")
    p.add_argument("--batch_size", type=int, default=128, help="N: batch the hardness is measured on "
                                                               "(default: 128)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default: cpu)")
    p.add_argument("--ref_subqueues", type=int, default=4,
                   help="time the reference loop on this many sub-queues and extrapolate (0 = all; "
                        "default: 4)")
    p.add_argument("--clusters", type=int, default=400, help="Gaussian mixture components of the synthetic "
                                                             "features (default: 400)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each version, best kept (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the features and chain starts (default: 0)")
    p.add_argument("--worlds", type=int, nargs="*", default=None,
                   help="time grouping sharded over this many gloo processes (e.g. 1 2 4) instead")
    p.add_argument("--scale", type=int, nargs="*", default=None, metavar="D",
                   help="instead: GritSampler's memory and end_epoch time for datasets of D examples (e.g. "
                        "10000000 100000000), each in a fresh process")
    p.add_argument("--strategy", default="grit", help="with --scale: the batch-construction strategy whose "
                                                      "end of epoch is measured (grit.strategies; default: "
                                                      "grit)")
    p.add_argument("--one_scale", type=int, default=None, help=argparse.SUPPRESS)
    add_output_dir(p, "grit_bench.json (the printed record)")
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark and print one JSON object (also returned)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.one_scale:
        return emit_record(one_scale(args), None, "grit_bench")
    if args.scale:
        if min(args.scale) < args.queue_size * 2:
            p.error("need every --scale D >= 2 x queue_size")
        return emit_record(at_scale(args), args.output_dir, "grit_bench")
    if args.worlds:
        if min(args.worlds) < 1 or args.queue_size % args.search_space:
            p.error("need --worlds >= 1 and --queue_size a multiple of --search_space")
        return emit_record(sharded(args), args.output_dir, "grit_bench")
    L, M, d, N = args.queue_size, args.search_space, args.dim, args.batch_size
    if not 1 <= N <= M <= L or L % M:
        p.error("need 1 <= batch_size <= search_space <= queue_size, queue_size a multiple of search_space")
    device = torch.device(args.device)
    S = L // M
    image, text = clustered_features(L, d, args.clusters, args.seed, device)
    g = torch.Generator().manual_seed(args.seed + 1)
    start = torch.randint(0, M, (S,), generator=g).to(device)
    v, t = image.view(S, M, d), text.view(S, M, d)  # features arrive in random order: already shuffled

    K = S if args.ref_subqueues <= 0 else min(args.ref_subqueues, S)

    def timed(fn):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        return time.perf_counter() - t0, out

    def reference():
        return [reference_grouping(v[s], t[s], int(start[s])) for s in range(K)]

    def reference_similarity():  # the reference's own matmul + softmaxes, to isolate its step loop
        out = []
        for s in range(K):
            sim = v[s].float() @ t[s].float().T
            out.append((sim.softmax(dim=1), sim.T.softmax(dim=1)))
        return out

    workspace = ChainWorkspace()
    greedy_chain(v, t, start, workspace=workspace)  # warm-up: later fills reuse the tables' memory
    sim_buf = workspace.get("sim", (S, M, M), device)
    sim_t_buf = workspace.get("sim_t", (S, M, M), device)

    def similarity():
        with torch.inference_mode():
            return torch.bmm(v, t.transpose(1, 2), out=sim_buf)

    def transpose():
        with torch.inference_mode():
            return _transpose_last2(sim_buf, out=sim_t_buf)

    # Runs alternate so that both versions see the same machine load; the best of each is kept.
    best = first_best = ref_best = ref_sim_best = sim_best = transpose_best = float("inf")
    for _ in range(max(1, args.repeats)):
        dt, order = timed(lambda: greedy_chain(v, t, start, workspace=workspace))
        best = min(best, dt)
        first_best = min(first_best, timed(lambda: greedy_chain(v, t, start))[0])
        dt, ref_chains = timed(reference)
        ref_best = min(ref_best, dt / K * S)
        ref_sim_best = min(ref_sim_best, timed(reference_similarity)[0] / K * S)
        sim_best = min(sim_best, timed(similarity)[0])
        transpose_best = min(transpose_best, timed(transpose)[0])
    sim_buf = sim_t_buf = None  # release the tables before the collector allocates its own
    workspace.clear()
    agree = sum(int(ref_chains[s] == order[s].tolist()) for s in range(K))

    # The whole phase 2-3 path of the collector (shuffle, checks, chain): its first fill and the next.
    collector = GritCollector(L, M, d, dataset_len=2 * L, device=device)
    collector.reset(args.seed)
    collector_first_s = timed(lambda: collector.add(image, text, torch.arange(L, device=device)))[0]
    collector_s = timed(lambda: collector.add(image, text, torch.arange(L, 2 * L, device=device)))[0]
    collector = None  # its tables are freed before the hardness section allocates
    ref_s, ref_sim_s, sim_s, transpose_s = ref_best, ref_sim_best, sim_best, transpose_best

    # Hardness: G = chains mapped to queue positions, cut into chunks of N.
    G = (order + torch.arange(S, device=device)[:, None] * M).reshape(-1)
    n_batches = L // N
    grouped = G[:n_batches * N].view(n_batches, N)
    rand = torch.randperm(L, generator=g).to(device)[:n_batches * N].view(n_batches, N)
    sim = torch.bmm(v, t.transpose(1, 2))
    eye = torch.eye(M, dtype=torch.bool, device=device)
    sim = sim.masked_fill(eye, float("-inf"))
    ceiling = float(0.5 * (sim.amax(dim=2).mean() + sim.amax(dim=1).mean()))

    result = {
        "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "queue_size": L, "search_space": M, "dim": d, "batch_size": N, "subqueues_per_fill": S,
        "grouping_s_per_fill": round(best, 4),
        "grouping_us_per_sample": round(best / L * 1e6, 3),
        "grouping_first_fill_s": round(first_best, 4),
        "collector_fill_s": round(collector_s, 4),
        "collector_first_fill_s": round(collector_first_s, 4),
        "reference_s_per_fill": round(ref_s, 4),
        "reference_us_per_sample": round(ref_s / L * 1e6, 3),
        "reference_subqueues_timed": K,
        "reference_extrapolated": K < S,
        "timing": f"best of {max(1, args.repeats)} alternating runs",
        "speedup_vs_reference": round(ref_s / best, 2),
        "speedup_vs_reference_first_fill": round(ref_s / first_best, 2),
        "breakdown_s": {
            "similarity_bmm": round(sim_s, 4), "transpose_copy": round(transpose_s, 4),
            "step_loop": round(max(best - sim_s - transpose_s, 0.0), 4),
            "reference_similarity": round(ref_sim_s, 4),
            "reference_step_loop": round(max(ref_s - ref_sim_s, 0.0), 4),
        },
        "step_loop_speedup": round(max(ref_s - ref_sim_s, 0.0) / max(best - sim_s - transpose_s, 1e-9), 2),
        "reference_chains_identical": f"{agree}/{K}",
        "hardness": {
            "grouped_batches": round(batch_hardness(image, text, grouped), 4),
            "random_batches": round(batch_hardness(image, text, rand), 4),
            "search_space_ceiling": round(ceiling, 4),
        },
        "features": f"{args.clusters}-cluster Gaussian mixture, text = image + noise, L2-normalised",
    }
    return emit_record(result, args.output_dir, "grit_bench")


def _shard_worker(rank: int, world: int, init_file: str, out_dir: str, args: argparse.Namespace) -> None:
    """One rank: a warm-up fill, then one timed fill of the sharded collector; writes its timings."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        L, M, d = args.queue_size, args.search_space, args.dim
        image, text = clustered_features(L, d, args.clusters, args.seed, torch.device("cpu"))
        collector = GritCollector(L, M, d, dataset_len=(args.repeats + 1) * L, shard=True)
        collector.reset(args.seed)
        collector.add(image, text, torch.arange(L))  # first fill: allocates the tables
        wall, cpu = [], []
        for r in range(args.repeats):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            collector.add(image, text, torch.arange((r + 1) * L, (r + 2) * L))
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"wall_s": min(wall), "cpu_s": min(cpu)}, f)
    finally:
        dist.destroy_process_group()


def memory_table(d: int) -> dict:
    """Bytes of G (int64 and int32) and of the two feature queues + index + valid, at two scales."""
    sizes = {"paper (5.1M pairs, L=48000)": (5_100_000, 48_000),
             "LAION-400M (L=48000)": (400_000_000, 48_000)}
    return {name: {"G_int64_bytes": D * 8, "G_int32_bytes": D * 4,
                   "queues_bytes": L * (2 * d * 4 + 8 + 1)} for name, (D, L) in sizes.items()}


def sharded(args: argparse.Namespace) -> dict:
    """Per-rank grouping time of one fill for each W in args.worlds (gloo processes on this machine)."""
    import torch.multiprocessing as mp

    rows = {}
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_shard_worker, args=(world, os.path.join(tmp, "init"), tmp, args), nprocs=world,
                     join=True)
            ranks = []
            for r in range(world):
                with open(os.path.join(tmp, f"{r}.json")) as f:
                    ranks.append(json.load(f))
        rows[world] = {"max_rank_wall_s": round(max(x["wall_s"] for x in ranks), 4),
                       "max_rank_cpu_s": round(max(x["cpu_s"] for x in ranks), 4)}
    base = rows[min(rows)]["max_rank_cpu_s"] * min(rows)
    for world, row in rows.items():
        row["cpu_vs_single_over_w"] = round(row["max_rank_cpu_s"] / (base / world), 3)
    S = args.queue_size // args.search_space
    return {"mode": "sharded grouping, one queue fill", "queue_size": args.queue_size,
            "search_space": args.search_space, "dim": args.dim, "subqueues_per_fill": S,
            "threads_per_rank": 1, "cpu_count": os.cpu_count(), "timing": f"best of {args.repeats} fills",
            "worlds": {str(w): r for w, r in rows.items()}, "memory": memory_table(args.dim),
            "note": "cpu_vs_single_over_w = per-rank CPU time / (single-rank CPU time / W); sub-queues are "
                    "dealt round robin, so a rank chains ceil(S / W) of the S sub-queues"}


# ------------------------------------------------------------------------------------------ scale


def _rss() -> dict:
    """This process's resident memory now and at its peak since the last _reset_peak(), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return {"rss": out["VmRSS"], "peak": out["VmHWM"]}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # '5' resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def _held(sampler) -> int:
    """Bytes of the D-sized index arrays the sampler holds: this epoch's, the next one's, G so far."""
    arrays = [sampler._epoch_array, sampler._next_array, *(sampler.collector._groups or [])]
    return sum(a.numel() * a.element_size() for a in arrays if a is not None)


def one_scale(args: argparse.Namespace) -> dict:
    """One dataset size in this process: a GritSampler resumed at the last step of an epoch (G of D - L/2
    grouped examples, half a queue of random features), then end_epoch and the next set_epoch timed, with
    the memory they hold and their peak."""
    from grit import GritSampler

    torch.manual_seed(args.seed)
    D, L, M, d, N = args.one_scale, args.queue_size, args.search_space, args.dim, args.batch_size
    grit = dict(enabled=True, queue_size=L, search_space=M, example_shuffle=True, batch_shuffle=True,
                mode="concurrent", warmstart_indices=None, shard_grouping=True)
    from training.config import Batching

    sampler = GritSampler(D, num_replicas=1, rank=0, seed=args.seed, batch_size=N, dim=d, **grit,
                          strategy=args.strategy, strategy_options=Batching().options(args.strategy))
    T = sampler.batches_per_epoch
    half = L // 2
    perm = torch.randperm(D)
    state = {"version": 1, "epoch": 0, "in_progress": 1, "position": T, "has_next": 0, "epochs_started": 1,
             "dataset_len": D, "batch_size": N, "num_replicas": 1, "seed": args.seed, "mode": "concurrent",
             "strategy": args.strategy,
             "epoch_indices": perm[:T * N].to(sampler.index_dtype), "indices": perm[half:],
             "collector": {"ptr": half, "image": F.normalize(torch.randn(half, d), dim=-1),
                           "text": F.normalize(torch.randn(half, d), dim=-1), "index": perm[:half].clone(),
                           "valid": torch.ones(half, dtype=torch.bool),
                           "rng": torch.Generator().manual_seed(args.seed).get_state()}}
    sampler.load_state_dict(state)
    del state, perm
    sampler.set_epoch(0)  # resumes at the epoch's end: its G and half a queue are held
    before = _rss()
    held_in_epoch = _held(sampler)
    _reset_peak()
    t0 = time.perf_counter()
    sampler.end_epoch()
    end_epoch_s = time.perf_counter() - t0
    after_end = _rss()
    held_after = _held(sampler)
    _reset_peak()
    t0 = time.perf_counter()
    sampler.set_epoch(1)
    first = next(iter(sampler))
    set_epoch_s = time.perf_counter() - t0
    after_set = _rss()
    assert 0 <= first < D
    return {"dataset": D, "index_dtype": str(sampler.index_dtype).removeprefix("torch."),
            "end_epoch_s": round(end_epoch_s, 3), "set_epoch_and_first_index_s": round(set_epoch_s, 3),
            "held_bytes_in_epoch": held_in_epoch, "held_bytes_after_end_epoch": held_after,
            "rss_before_end_epoch": before["rss"],
            "end_epoch_peak_over_rss": max(0, after_end["peak"] - before["rss"]),
            "set_epoch_peak_over_rss": max(0, after_set["peak"] - after_end["rss"]),
            "rss_after_set_epoch": after_set["rss"]}


def at_scale(args: argparse.Namespace) -> dict:
    """one_scale for every D of args.scale, each in a fresh Python (so that its peak memory is its own)."""
    from tools.launch import child_env, python_command

    rows = []
    for D in args.scale:
        sizes = ["--queue_size", args.queue_size, "--search_space", args.search_space, "--dim", args.dim,
                 "--batch_size", args.batch_size, "--seed", args.seed, "--one_scale", D,
                 "--strategy", args.strategy]
        proc = subprocess.run(python_command(["tools.grit_bench", *map(str, sizes)]),
                              capture_output=True, text=True, env=child_env(threads=1))
        if proc.returncode != 0:
            rows.append({"dataset": D, "error": proc.stderr.strip()[-800:]})
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = {"mode": "GritSampler at scale (random features, no training)", "strategy": args.strategy,
           "queue_size": args.queue_size,
           "search_space": args.search_space, "dim": args.dim, "batch_size": args.batch_size,
           "threads": 1, "rows": rows}
    done = [r for r in rows if "error" not in r]
    if done:
        big = max(done, key=lambda r: r["dataset"])  # the fixed costs (queue, chain tables) weigh least
        keys = ("held_bytes_after_end_epoch", "end_epoch_peak_over_rss", "set_epoch_peak_over_rss")
        per_example = {k: big[k] / big["dataset"] for k in keys}
        D = 400_000_000
        out["laion_400m_per_rank"] = {
            "held_bytes": round(per_example["held_bytes_after_end_epoch"] * D),
            "end_epoch_peak_bytes_over_rss": round(per_example["end_epoch_peak_over_rss"] * D),
            "set_epoch_peak_bytes_over_rss_one_rank": round(per_example["set_epoch_peak_over_rss"] * D),
            "end_epoch_s": round(big["end_epoch_s"] * D / big["dataset"], 1),
            "note": f"linear in D from the D = {big['dataset']} row; every rank holds the same D-sized "
                    "arrays whatever the world size; set_epoch's peak is that of one rank of one (a rank "
                    "of W converts 1/W of the epoch to Python ints, a chunk at a time)"}
    return out


if __name__ == "__main__":
    run_main(main)
