"""Check an online-selection run's record against the documented epoch rule (issue 52), independently of
the sampler that wrote it: it reads only the files.

    python -m tools.check_selections --run_dir output/pretrain_jest

Pre-training with batching.strategy jest or rho writes selections/epoch_EE.pt per epoch (Pretrain.py;
grit.online): every step's candidates (t, W, K) and selections (t, W, N), per segment of the epoch (a run
resumed on another number of ranks adds one). The rule (docs/batch-construction.md, 'Online batch
selection'), checked per epoch:
- K = super_batch x N candidates and N selections per rank and step, all dataset indices in [0, D);
- every index is a candidate at most once in the epoch, so it is trained on at most once;
- each rank's selection is N distinct positions of its own candidates of that step (selection per rank);
- an epoch on one number of ranks W has D // (K x W) steps, its segments following on (a resume continues
  at the step it stopped), and fewer than K x W indices (per segment) are never candidates.
It prints one JSON record (per epoch: steps, ranks, candidates, selected, left out, how many of this
epoch's left-outs were left out the epoch before) and exits 1 naming the first broken rule.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from collections.abc import Sequence

import torch

from tools.cli import emit_record, tool_parser
from training.cli import run_main

__all__ = ["check_epoch", "main"]


def check_epoch(record: dict) -> tuple[dict, list[str]]:
    """One epoch's record -> (its figures, the rules it breaks)."""
    D, N, k = int(record["dataset_len"]), int(record["batch_size"]), int(record["super_batch"])
    K = k * N
    errors, seen, steps, ranks = [], [], 0, []
    for s, segment in enumerate(record["segments"]):
        cand, sel = segment["candidates"].long(), segment["selected"].long()
        t, W = cand.shape[0], cand.shape[1] if cand.dim() == 3 else 0
        if cand.shape != (t, W, K) or sel.shape != (t, W, N):
            errors.append(f"segment {s}: candidates {tuple(cand.shape)} and selected {tuple(sel.shape)} are "
                          f"not (steps, ranks, {K}) and (steps, ranks, {N})")
            continue
        steps += t
        ranks.append(W)
        if t and (int(cand.min()) < 0 or int(cand.max()) >= D):
            errors.append(f"segment {s}: candidate indices outside [0, {D})")
        # Each rank's selection among its own candidates of that step, N distinct ones.
        member = (sel[..., :, None] == cand[..., None, :])  # (t, W, N, K)
        if not bool(member.any(-1).all()):
            errors.append(f"segment {s}: a selected index is not among its rank's candidates of that step")
        if t and bool((sel.sort(-1).values.diff(dim=-1) == 0).any()):
            errors.append(f"segment {s}: a step's selection repeats an index")
        seen.append(cand.reshape(-1))
    flat = torch.cat(seen) if seen else torch.empty(0, dtype=torch.long)
    repeats = flat.numel() - flat.unique().numel()
    if repeats:
        errors.append(f"{repeats} candidate(s) appear twice in the epoch (each index at most once)")
    never = torch.ones(D, dtype=torch.bool)
    never[flat.clamp(0, D - 1)] = False
    left_out = int(never.sum())
    if ranks and len(set(ranks)) == 1:  # one world size (resumed on it or unbroken): the whole epoch's steps
        if steps != D // (K * ranks[0]):
            errors.append(f"{steps} steps, the rule gives D // (K x W) = {D // (K * ranks[0])}")
        ends = [int(s["first_step"]) + s["candidates"].shape[0] for s in record["segments"]]
        starts = [int(s["first_step"]) for s in record["segments"]]
        if starts[0] != 0 or starts[1:] != ends[:-1]:
            errors.append(f"the segments' steps do not follow on: starts {starts}, ends {ends}")
    bound = K * sum(ranks)
    if ranks and left_out >= bound:
        errors.append(f"{left_out} indices never candidates, not fewer than K x W = {bound}")
    selected = sum(int(segment["selected"].numel()) for segment in record["segments"])
    figures = {"epoch": int(record["epoch"]), "steps": steps, "ranks": ranks, "candidates_per_step": K,
               "selected_per_step": N, "candidates": int(flat.numel()), "selected": selected,
               "left_out": left_out, "ok": not errors}
    return {**figures, "_never": never}, errors


def main(argv: Sequence[str] | None = None) -> dict:
    """Check every selections/epoch_EE.pt of --run_dir; exit 1 on a broken rule."""
    parser = tool_parser("tools.check_selections", __doc__.splitlines()[0])
    parser.add_argument("--run_dir", required=True, help="a pre-training run's output_dir with selections/")
    args = parser.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.run_dir, "selections", "epoch_*.pt")),
                   key=lambda p: int(re.search(r"epoch_(\d+)\.pt$", p)[1]))
    if not paths:
        raise FileNotFoundError(f"{args.run_dir}: no selections/epoch_*.pt (a run with batching.strategy "
                                "jest or rho writes them)")
    epochs, problems, before = [], [], None
    for path in paths:
        figures, errors = check_epoch(torch.load(path, weights_only=True))
        never = figures.pop("_never")
        if before is not None:  # left out twice in a row: a random permutation makes this rare
            figures["left_out_both_epochs"] = int((never & before).sum())
        before = never
        epochs.append(figures)
        problems += [f"{os.path.basename(path)}: {e}" for e in errors]
    record = {"run_dir": args.run_dir, "epochs": epochs, "ok": not problems, "problems": problems}
    emit_record(record, None, "check_selections")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        sys.exit(1)
    return record


if __name__ == "__main__":
    run_main(main)
