"""training.reporting and training.pictures: what a run tells and keeps. Per-step metrics, the run record,
the console copy, keep_checkpoints, TensorBoard event files (read back with tensorboard's own reader), a
W&B offline run written without network, and Pretrain.py's pictures of a random and a GRIT batch."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HANG_GUARD_S, ROOT, small_pretrain_sets
from test_trainer import FakeTask, fake_run

from training.config_files import ConfigError
from training.trainer import Trainer

METRIC_KEYS = {"step", "epoch", "train_loss", "lr", "samples_per_s", "samples_per_s_per_rank",
               "data_wait_share", "peak_memory_bytes"}


def _events(folder: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


# W&B's own limits on its service's start (30 s) and on init (90 s) are timeouts sized for an idle machine:
# the suite's hang guard replaces them (tests/conftest.py's rule).
WANDB_WAITS = {"WANDB__SERVICE_WAIT": str(HANG_GUARD_S), "WANDB_INIT_TIMEOUT": str(HANG_GUARD_S)}


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    """No W&B account: no key, no ~/.netrc, no mode set by the user (so the run must go offline)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name, value in WANDB_WAITS.items():
        monkeypatch.setenv(name, value)


def test_a_run_keeps_metrics_record_console_and_writes_both_backends(tmp_path, capsys, offline_wandb):
    out = tmp_path / "run"
    run = fake_run(out, print_freq=2, keep_checkpoints=1, report_to=["tensorboard", "wandb"])
    Trainer(run, FakeTask(run.config)).fit()
    printed = capsys.readouterr().out

    # the start-up summary, before the first step
    assert "Fake: device cpu, world size 1" in printed and "10 steps per epoch, global batch 4" in printed
    assert printed.index("global batch") < printed.index('"epoch": 0')

    # one line per logged step (every print_freq = 2 of 10 steps, 3 epochs), global step numbers
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(2, 31, 2)) and [r["epoch"] for r in rows[::5]] == [0, 1, 2]
    assert all(METRIC_KEYS <= set(r) for r in rows)
    assert all(r["samples_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1 and r["peak_memory_bytes"] > 0
               for r in rows)
    # each line holds the means since the line before: five windows of two steps average to the epoch's
    epochs = [json.loads(line) for line in open(out / "log.txt")]
    for e, record in enumerate(epochs):
        windows = [r["train_loss"] for r in rows if r["epoch"] == e]
        assert sum(windows) / len(windows) == pytest.approx(record["train_loss"], rel=1e-6)

    record = json.loads(open(out / "run_record.jsonl").readline())
    assert record["world_size"] == 1 and len(record["hostnames"]) == 1 and record["resumed_from"] is None
    assert record["versions"]["torch"] == torch.__version__.split("+")[0]
    assert "git_commit" in record and "git_dirty" in record and isinstance(record["command"], list)

    console = open(out / "console.txt").read()
    assert "global batch 4" in console and '"epoch": 2' in console

    # keep_checkpoints: 1 keeps the newest epoch checkpoint, the one latest.json names; best stays
    kept = sorted(os.path.basename(p) for p in glob.glob(str(out / "checkpoint_*.pth")))
    assert [k for k in kept if k[11:-4].isdigit()] == ["checkpoint_02.pth"]
    assert "checkpoint_best.pth" in kept
    assert json.load(open(out / "latest.json"))["path"] == "checkpoint_02.pth"

    events = _events(str(out / "tensorboard"))
    assert [e.step for e in events.Scalars("train/train_loss")] == list(range(2, 31, 2))
    assert [e.step for e in events.Scalars("epoch/val_loss")] == [10, 20, 30]
    assert events.Scalars("epoch/val_loss")[-1].value == pytest.approx(json.loads(
        open(out / "log.txt").read().splitlines()[-1])["val_loss"], rel=1e-6)

    offline = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(offline) == 1 and os.path.getsize(offline[0]) > 0
    run_id = open(out / "wandb_run_id.txt").read().strip()
    assert run_id in offline[0]


def test_a_missing_backend_stops_at_start_up_with_the_pip_command(monkeypatch):
    from training import reporting

    monkeypatch.setattr(reporting.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"report_to asks for tensorboard, wandb, which is not installed: "
                                          r"pip install tensorboard wandb"):
        reporting.check_backends(["tensorboard", "wandb"])


def test_batch_grid_draws_each_image_its_caption_and_its_hardest_negative(tmp_path, monkeypatch):
    import matplotlib.axes

    from training.pictures import batch_grid

    shown, texts = [], []
    original_imshow, original_text = matplotlib.axes.Axes.imshow, matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "imshow",
                        lambda self, x, *a, **k: (shown.append(x), original_imshow(self, x, *a, **k))[1])
    def text(self, x, y, s, *a, **k):
        texts.append(s)
        return original_text(self, x, y, s, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "text", text)
    images = torch.rand(3, 16, 16, 3)
    captions = ["a red cube", "a blue ball", "a red ball"]
    sim = torch.tensor([[0.9, 0.1, 0.7], [0.2, 0.8, 0.5], [0.6, 0.3, 0.9]])
    path = batch_grid(images, captions, sim, str(tmp_path / "grid.png"), "a batch")
    from PIL import Image

    assert Image.open(path).size[0] > 300
    assert len(shown) == 3 and all((s == images[i].numpy()).all() for i, s in enumerate(shown))
    flat = [" ".join(t.split()) for t in texts]
    assert flat[0::2] == captions
    # hardest negative of image 0: caption 2 (0.7), of 1: caption 2 (0.5), of 2: caption 0 (0.6)
    assert flat[1::2] == ["hardest negative: #2 (0.70) a red ball", "hardest negative: #2 (0.50) a red ball",
                          "hardest negative: #0 (0.60) a red cube"]


def test_pretrain_pictures_a_random_and_a_grouped_batch_and_logs_them(tmp_path):
    from dataset.synthetic import ensure_synthetic

    data = ensure_synthetic(str(tmp_path / "synthetic"), n=96, seed=3)
    out = tmp_path / "run"
    values = {"batching.queue_size": 40, "batching.search_space": 16, "max_epoch": 2, "schedular.epochs": 2,
              "schedular.warmup_steps": 4, "print_freq": 5, "batch_pictures": "true"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HOME=str(tmp_path / "home"), WANDB_SILENT="true",
               **WANDB_WAITS)
    proc = subprocess.run([sys.executable, "Pretrain.py", "--config", "configs/tiny/Pretrain.yaml",
                           "--output_dir", str(out), "--device", "cpu", "--report_to", "tensorboard", "wandb",
                           "--set", *small_pretrain_sets(data, **values)], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("batching.strategy grit (GRIT's greedy alternating chain), concurrent: groups of N = 8 per rank "
            "from sub-queues of M = 16") in proc.stdout
    assert sorted(os.listdir(out / "batches")) == ["epoch_00_random.png", "epoch_01_grouped.png"]
    events = _events(str(out / "tensorboard"))
    assert set(events.Tags()["images"]) == {"batches/random", "batches/grouped"}
    assert {"train/loss_itc", "train/hardness", "train/samples_per_s", "epoch/sampler_seconds"} <= set(
        events.Tags()["scalars"])
    # W&B, offline (no account here): both pictures among the run's media
    run_dir = glob.glob(str(out / "wandb" / "offline-run-*"))[0]
    media = glob.glob(os.path.join(run_dir, "files", "media", "images", "batches", "*.png"))
    assert sorted(os.path.basename(m).split("_")[0] for m in media) == ["grouped", "random"]
