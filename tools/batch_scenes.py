"""The false negatives each epoch's batches held, rebuilt from a finished pre-training's checkpoints: per
epoch, the share of examples whose batch holds another example of their scene (batch_same_scene).

    python -m tools.batch_scenes RUN_DIR [RUN_DIR ...] [--output_dir DIR]

RUN_DIR is a pre-training's --output_dir (config.yaml, log.txt, checkpoint_EE.pth) on data with a scene
table (the synthetic world's scenes.json beside each json list). Pretrain.py logs the same figure while it
trains (models.false_negatives.same_group_share on each step's batch); this tool gives it for runs made
before it did, and checks a run after the fact. Each epoch's batches are the run's own sampler's: epoch 0
from the seed, epoch e from the sampler state in checkpoint e-1 (GRIT's groups, or the random order of
seed + e). Naive mode is refused: its epoch starts with a pass of the model, not a saved order. An epoch
whose checkpoint is missing (keep_checkpoints) is left out and named. Prints (and with --output_dir writes
batch_scenes.json) {RUN_DIR: {"batch_same_scene": {epoch: share}, "missing": [epochs]}}.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from dataset import create_dataset
from grit.config import first_grouped_epoch
from grit_io import InputFileError
from models.false_negatives import same_group_share
from tools.cli import add_output_dir, emit_record, tool_parser
from tools.launch import in_root
from tools.runs import read_log
from training.checkpoints import checkpoint_path, load_checkpoint
from training.cli import Parser, run_main
from training.config import PretrainConfig
from training.config_resolve import resolve_config
from training.loaders import build_sampler

__all__ = ["NoSceneTable", "build_parser", "epoch_orders", "main", "run_config", "same_scene_by_epoch",
           "scene_ids", "with_batch_scenes"]


class NoSceneTable(InputFileError):
    """The run's data has no scene table (real data, tar shards): there is no figure to rebuild."""


def _log_epochs(pre_dir: str) -> list[int]:
    path = os.path.join(pre_dir, "log.txt")
    if not os.path.isfile(path):
        raise InputFileError(f"{path} not found: {pre_dir} is not a pre-training's output_dir")
    rows = read_log(path)
    if not all(isinstance(r, dict) and isinstance(r.get("epoch"), int) for r in rows):
        raise InputFileError(f"{path}: not a training log (a record without its epoch)")
    return [r["epoch"] for r in rows]


def run_config(pre_dir: str) -> PretrainConfig:
    """The resolved config a pre-training ran with (its output_dir's config.yaml); InputFileError for a
    run in GRIT's naive mode, whose batches come from a pass of the model and are not in the checkpoints."""
    config = resolve_config("pretrain", os.path.join(pre_dir, "config.yaml"), check_paths=False)
    if config.strategy != "random" and config.batching.mode == "naive":
        raise InputFileError(f"{pre_dir}: batching.mode naive starts every epoch with a pass of the model, "
                             "so "
                             "its batches are not in the checkpoints (the logged batch_same_scene has them)")
    return config


_SCENES: dict[tuple, torch.Tensor] = {}  # the scene ids of each data set read so far (a sweep reads one)


def scene_ids(config: PretrainConfig) -> torch.Tensor:
    """(D,) int64: the scene of each entry of the run's data (dataset.corpus.PretrainCorpus.scene_ids)."""
    data = (tuple(config.train_files), config.image_root, tuple(sorted(config.train_repeat.items())))
    if data not in _SCENES and (scenes := create_dataset("pretrain", config).scene_ids) is not None:
        _SCENES[data] = scenes
    scenes = _SCENES.get(data)
    if scenes is None:
        raise NoSceneTable(f"no scene table (scenes.json) beside the training data {config.train_files}: "
                           "batch_same_scene needs the synthetic world's scenes")
    return scenes


def epoch_orders(pre_dir: str, config: PretrainConfig, dataset_len: int) -> tuple[dict[int, torch.Tensor],
                                                                                   list[int]]:
    """Each logged epoch's global order (T*W*N,) as the run's sampler dealt it, and the epochs that cannot
    be rebuilt (a grouped epoch whose previous checkpoint was deleted, keep_checkpoints)."""
    epochs = _log_epochs(pre_dir)
    states = {}  # epoch -> the sampler state saved at its end
    for epoch in range(max(epochs, default=-1) + 1):
        path = checkpoint_path(pre_dir, epoch=epoch)
        if os.path.isfile(path):
            states[epoch] = load_checkpoint(path)["sampler"]
    # The first grouped epoch (batching.group_from_epoch may keep later ones random too); an epoch before it
    # comes from the seed like random batches.
    grit = config.batching
    first = first_grouped_epoch(grit.group_from_epoch, grit.mode, bool(grit.warmstart_indices))
    grouped = config.strategy != "random"
    orders: dict[int, torch.Tensor] = {}
    missing: list[int] = []
    for epoch in epochs:
        # A grouped epoch e was composed at the end of e - 1, into that checkpoint's state; epoch 0 and
        # random batches come from the seed. The ranks that ran it: its own state's (else the nearest).
        composed = grouped and epoch >= first
        state = states.get(epoch - 1) if composed else None
        ranks = states.get(epoch) or states.get(epoch - 1) or next(iter(states.values()), None)
        if ranks is None or (composed and state is None):
            missing.append(epoch)
            continue
        sampler = build_sampler(config, dataset_len, int(ranks["num_replicas"]), 0)
        if state is not None:
            sampler.load_state_dict(state)
        sampler.set_epoch(epoch)
        orders[epoch] = sampler.epoch_indices()
    return orders, missing


def same_scene_by_epoch(pre_dir: str, scenes: torch.Tensor | None = None) -> dict:
    """{"batch_same_scene": {epoch: share of examples whose (per-rank) batch holds another of their scene},
    "missing": [epochs without a sampler state]} of the pre-training in pre_dir; scenes: its scene_ids
    (read from its data when None)."""
    config = run_config(pre_dir)
    if scenes is None:
        scenes = scene_ids(config)
    orders, missing = epoch_orders(pre_dir, config, len(scenes))
    shares = {e: float(same_group_share(scenes[order.long()].view(-1, config.batch_size)))
              for e, order in orders.items()}
    return {"batch_same_scene": shares, "missing": missing}


def with_batch_scenes(rows: list[dict], pre_dir: str) -> list[dict]:
    """A run's log rows with batch_same_scene added from its checkpoints where the run did not log it (made
    before Pretrain.py did); as they are when it did, or when pre_dir has no config.yaml, no checkpoints
    or no scene table (nothing to rebuild from)."""
    if not rows or all("batch_same_scene" in r for r in rows) or not os.path.isfile(
            os.path.join(pre_dir, "config.yaml")):
        return rows
    try:
        shares = same_scene_by_epoch(pre_dir)["batch_same_scene"]
    except NoSceneTable:  # real data (tar shards, a corpus): nothing to rebuild; other errors name their file
        return rows
    return [{**r, "batch_same_scene": shares[r["epoch"]]} if r.get("epoch") in shares and
            "batch_same_scene" not in r else r for r in rows]


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser("tools.batch_scenes", __doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="pre-training output_dirs")
    add_output_dir(p, "batch_scenes.json")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Rebuild every run's batches; returns {RUN_DIR: same_scene_by_epoch}."""
    args = build_parser().parse_args(argv)
    run_dirs = [os.path.abspath(d) for d in args.run_dirs]  # the user's paths, from where the user is
    with in_root():  # a run's config.yaml names repository-relative data, as the configs do
        record = {d: same_scene_by_epoch(d) for d in run_dirs}
    emit_record(record, args.output_dir, "batch_scenes")
    return record


if __name__ == "__main__":
    run_main(main)
