"""training.trainer: the one epoch loop. A fake task runs through it and resumes exactly after a crash; the
four scripts hand their Task to the same Trainer; the log record has the same keys in every script."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil

import pytest
import torch
from conftest import ROOT, assert_resumed_from, read_latest, small_pretrain_sets, tiny_config
from torch import Tensor, nn

import NLVR
import Pretrain
import Retrieval
import VQA
from training.cli import Run
from training.config_resolve import resolve_config
from training.distributed import DistInfo
from training.loaders import finetune_sampler
from training.task import Task
from training.trainer import Trainer

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), distributed=False)
RECORD_KEYS = ["epoch", "step", "lr", "train_loss", "train_seconds", "samples_per_s", "epoch_seconds",
               "bad_samples", "skipped_steps", "val_loss", "best_epoch"]


@dataclasses.dataclass
class PairBatch:
    """What the trainer reads of a batch: len(), reasons; the fake step reads x and y."""

    x: Tensor
    y: Tensor
    ids: Tensor
    reasons: list[str]

    def __len__(self) -> int:
        return self.x.shape[0]


class Pairs(torch.utils.data.Dataset):
    """40 random (x (4,), y) pairs; every fifth is a bad sample (as dataset.bad_samples marks them)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(40, 4, generator=g), torch.randint(0, 2, (40,), generator=g)

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i, (f"entry {i}: unreadable" if i % 5 == 4 else None)


def collate(items) -> PairBatch:
    x, y, ids, reasons = zip(*items)
    return PairBatch(torch.stack(x), torch.stack(y), torch.tensor(ids), [r for r in reasons if r])


class FakeTask(Task):
    """A linear classifier: the smallest task with a step, an evaluation and a best metric."""

    name = "Fake"
    best_key = "val_loss"

    def __init__(self, config, crash_at: int | None = None, info: DistInfo = CPU) -> None:
        torch.manual_seed(1)
        dataset = Pairs()
        sampler = finetune_sampler(dataset, info, seed=config.seed, batch_size=config.batch_size_train)
        super().__init__(nn.Linear(4, 2), dataset, collate, sampler, config.batch_size_train,
                         sampler.loader_generator)
        self.steps, self.crash_at = 0, crash_at
        self.seen: dict[int, list[int]] = {}  # epoch -> the indices this rank trained on, in order

    def start_epoch(self, epoch: int) -> None:
        super().start_epoch(epoch)
        self.epoch = epoch

    def step(self, model, batch):
        loss = nn.functional.cross_entropy(model(batch.x), batch.y)
        return loss, {"train_loss": loss.detach()}

    def after_step(self, metrics, batch, skipped) -> None:
        self.seen.setdefault(self.epoch, []).extend(batch.ids.tolist())
        self.steps += 1
        if self.steps == self.crash_at:
            raise RuntimeError("crash")

    def evaluate(self, epoch, output_dir) -> dict:
        with torch.no_grad():  # minus the loss: a higher value is better, as for the recalls
            loss = nn.functional.cross_entropy(self.model(self.dataset.x), self.dataset.y)
        return {"val_loss": -float(loss)}


def fake_run(output_dir, resume: str | None = None, **values) -> Run:
    values = {"batch_size_train": 4, "max_epoch": 3, "checkpoint_every_steps": 4, "max_bad_fraction": 0.5,
              "schedular": {"epochs": 3, "warmup_steps": 3}, **values}
    config = tiny_config("retrieval", **values)
    args = argparse.Namespace(output_dir=str(output_dir), resume=resume, checkpoint=None)
    return Run(args, config, CPU)


def read_log(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "log.txt"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_a_fake_task_trains_and_resumes_after_a_crash_exactly(tmp_path):
    whole = tmp_path / "whole"
    run = fake_run(whole)
    task = FakeTask(run.config)
    Trainer(run, task).fit()
    rows = read_log(whole)
    assert [r["epoch"] for r in rows] == [0, 1, 2] and rows[-1]["step"] == 30  # 40 // 4 steps a epoch
    assert list(rows[0]) == RECORD_KEYS
    assert [r["bad_samples"] for r in rows] == [8, 8, 8]  # every fifth of 40, counted each epoch
    assert os.path.isfile(whole / "checkpoint_best.pth")
    # output_dir/config.yaml is the resolved config, every default written: it resolves to the same one
    assert resolve_config("retrieval", str(whole / "config.yaml"), check_paths=False) == run.config

    cut = tmp_path / "cut"
    crashing = FakeTask(fake_run(cut).config, crash_at=15)  # mid-epoch 1, after the step-12 checkpoint
    with pytest.raises(RuntimeError, match="crash"):
        Trainer(fake_run(cut), crashing).fit()
    latest = read_latest(cut)
    assert latest == {"path": "checkpoint_step_0000012.pth", "epoch": 1, "step": 12}
    resumed = FakeTask(fake_run(cut).config)
    Trainer(fake_run(cut, resume="latest"), resumed).fit()
    assert_resumed_from(cut, latest)
    for name, value in task.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    again = read_log(cut)
    assert [r["epoch"] for r in again] == [0, 1, 2]
    timing = {"train_seconds", "epoch_seconds", "samples_per_s"}
    # The same numbers, timing aside; the resumed epoch's means cover the steps after the resume only.
    for a, b in zip(rows, again):
        skip = timing | ({"train_loss", "lr"} if a["epoch"] == 1 else set())
        assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def test_a_mid_epoch_checkpoint_resumed_with_another_batch_size_is_one_error_naming_the_epoch_checkpoint(
        tmp_path):
    """Another per-rank batch size cannot continue the rest of an epoch (GRIT's groups are batch_size
    long): one InputFileError (exit 2 from the command line) that names the end-of-epoch checkpoint to
    resume from; nothing is written."""
    from grit_io import InputFileError

    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="crash"):
        Trainer(fake_run(cut), FakeTask(fake_run(cut).config, crash_at=15)).fit()
    before = sorted(os.listdir(cut))
    epoch_end = os.path.join(cut, "checkpoint_00.pth")
    step = os.path.join(cut, "checkpoint_step_0000012.pth")
    wider = fake_run(cut, resume="latest", batch_size_train=8)
    with pytest.raises(InputFileError) as err:
        Trainer(wider, FakeTask(wider.config)).fit()
    assert str(err.value) == (
        f"--resume {step}: saved mid-epoch with batch size 4 per process, resumed with 8; the rest of that "
        f"epoch continues on any number of processes but only with the same batch size per process: resume "
        f"with batch size 4, or from --resume {epoch_end} (the newest end-of-epoch checkpoint)")
    assert sorted(os.listdir(cut)) == before
    Trainer(fake_run(cut, resume=epoch_end), FakeTask(fake_run(cut).config)).fit()  # the way out works
    assert [r["epoch"] for r in read_log(cut)] == [0, 1, 2]


def step_lrs(output_dir) -> list[tuple[int, int, float]]:
    """(epoch, step, lr) of every line of output_dir/metrics.jsonl (print_freq 1: one line a step)."""
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [(r["epoch"], r["step"], r["lr"]) for r in map(json.loads, f)]


def test_a_mid_epoch_checkpoint_continues_on_another_number_of_processes(tmp_path, capsys):
    """One process stops in epoch 1 (checkpoint after 2 of its 10 steps of 4); the resume runs on 2
    processes (their ranks one after the other here: the trainer's per-rank work, without collectives).
    The rest of the epoch is dealt over the two ranks: every index of the epoch once over both parts;
    the warm-up (20 steps of 4 samples) continues from the 48 samples seen, at twice the pace per step,
    so each resumed step's rate is the one-process run's at the same number of samples: no jump; the
    next epoch starts on time (5 steps per epoch now) at that epoch's rate."""
    values = {"print_freq": 1, "schedular": {"epochs": 3, "warmup_steps": 20}}
    whole = tmp_path / "whole"
    Trainer(fake_run(whole, **values), FakeTask(fake_run(whole).config)).fit()
    lr_at = {step: lr for _, step, lr in step_lrs(whole)}  # one process: samples seen = 4 x step
    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="crash"):
        Trainer(fake_run(cut, **values), FakeTask(fake_run(cut).config, crash_at=15)).fit()
    capsys.readouterr()
    seen, lines = [], []
    for rank in (0, 1):
        out = tmp_path / f"rank{rank}"
        shutil.copytree(cut, out)
        run = fake_run(out, resume="latest", **values)
        info = dataclasses.replace(CPU, rank=rank, world_size=2)
        task = FakeTask(run.config, info=info)
        Trainer(Run(run.args, run.config, info), task).fit()
        seen.append(task.seen)
        lines.append(step_lrs(out)[len(step_lrs(cut)):])  # the resumed run's lines
    printed = capsys.readouterr().out
    assert ("resumed on another number of processes: saved by 1 (global batch 4, 10 steps per epoch), now 2 "
            "(global batch 8, 5 steps per epoch)") in printed
    assert "the rest of epoch 1 is re-dealt over 2 process(es): 4 steps from step 6" in printed
    assert "schedule continues from the 48 samples seen, warm-up in steps of 4 samples" in printed
    # Epoch 1: the 8 indices of the cut run's first 2 steps, then the two ranks' 16 each: all 40 once.
    order = torch.randperm(40, generator=torch.Generator().manual_seed(fake_run(cut).config.seed + 1))
    assert len(seen[0][1]) == len(seen[1][1]) == 16
    assert sorted(order[:8].tolist() + seen[0][1] + seen[1][1]) == list(range(40))
    assert all(len(s[2]) == 20 for s in seen)  # epoch 2: 5 steps of 4 on each rank
    assert sorted(seen[0][2] + seen[1][2]) == list(range(40))
    # The schedule: resumed step 6 + j has seen 48 + 8j samples = one-process step 12 + 2j.
    assert lines[0] == lines[1]
    resumed = lines[0]
    assert [(e, s) for e, s, _ in resumed] == [(1, s) for s in range(7, 11)] + [(2, s) for s in range(11, 16)]
    for j, (_, _, lr) in enumerate(resumed[:4]):
        assert lr == pytest.approx(lr_at[13 + 2 * j], rel=1e-12), j  # metrics.jsonl counts steps from 1
    assert all(lr == pytest.approx(lr_at[21], rel=1e-12) for _, _, lr in resumed[4:])  # epoch 2's rate
    assert read_log(tmp_path / "rank0")[-1]["step"] == 15  # 3 epochs of 5 steps, in this run's steps


def test_resume_in_an_empty_output_dir_starts_fresh_and_says_so(tmp_path, capsys):
    run = fake_run(tmp_path / "new", resume="latest", max_epoch=1)
    Trainer(run, FakeTask(run.config)).fit()
    assert "no checkpoint in" in capsys.readouterr().out and len(read_log(tmp_path / "new")) == 1


class Recorder:
    """Stands in for Trainer in a script: keeps the task it was handed, trains nothing."""

    tasks: list[Task] = []

    def __init__(self, run: Run, task: Task) -> None:
        assert isinstance(run, Run)
        Recorder.tasks.append(task)

    def fit(self) -> dict:
        return {}

    def evaluate_only(self) -> dict:
        return {}


@pytest.mark.parametrize("script, config, sets", [
    (Pretrain, "configs/tiny/Pretrain.yaml", ()),
    (Retrieval, "configs/tiny/Retrieval.yaml", ()),
    (NLVR, "configs/tiny/NLVR_pretrain.yaml", ()),
    (NLVR, "configs/tiny/NLVR.yaml", ()),
    (VQA, "configs/tiny/VQA.yaml", ()),
])
def test_every_script_runs_its_task_through_the_one_trainer(in_repo, monkeypatch, tmp_path, script, config,
                                                            sets):
    import training.finetune

    # Pretrain.py hands its task to the trainer itself, the fine-tuning scripts through their scaffold
    monkeypatch.setattr(script if script is Pretrain else training.finetune, "Trainer", Recorder)
    Recorder.tasks = []
    shrink = ["vision_init=null", "image_res=32", "patch_size=16", "vision_depth=1"]
    if script is Pretrain:
        shrink = small_pretrain_sets("data/synthetic")
    script.main(["--config", os.path.join(ROOT, config), "--output_dir", str(tmp_path / "out"),
                 "--device", "cpu", "--set", *shrink, *sets])
    (task,) = Recorder.tasks
    assert isinstance(task, Task) and type(task).step is not Task.step
    spread = list(range(0, len(task.dataset), len(task.dataset) // 4))[:4]  # four different images
    batch = next(iter(torch.utils.data.DataLoader(task.dataset, batch_size=4, collate_fn=task.collate,
                                                  sampler=spread)))
    assert len(batch) == 4 and batch.reasons == [] and batch.valid.dtype == torch.bool
    # What the trainer hands step() (before DDP and compile): the model with its objectives, where it has any.
    loss, metrics = task.step(task.train_module(), batch)
    assert loss.dim() == 0 and torch.isfinite(loss) and all(v.dim() == 0 for v in metrics.values())
    assert not (tmp_path / "out").exists()  # the Trainer creates it, and it never ran
