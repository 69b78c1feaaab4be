"""What a run tells and keeps, beside log.txt: the start-up summary, the run record (run_record.jsonl), the
per-step metrics (metrics.jsonl), a copy of the console (console.txt), the TensorBoard and W&B back-ends
(config key report_to), pictures of batches, and pruning old epoch checkpoints (keep_checkpoints).

Only rank 0 writes, except the console copy (console_rank{R}.txt on the other ranks). TensorBoard and
W&B are optional dependencies: asking for one that is not installed stops the run at start-up with the
pip command (check_backends). W&B runs offline unless an account is configured (WANDB_API_KEY, a
~/.netrc entry for api.wandb.ai, or WANDB_MODE set by the user), and keeps one run id per output_dir,
so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import resource
import secrets
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from training.config_files import ConfigError
from training.distributed import all_gather_objects, get_rank, is_main_process

__all__ = ["BACKENDS", "Reporter", "check_backends", "peak_memory_bytes", "prune_checkpoints", "run_record"]

# report_to value -> (module to import, pip package)
BACKENDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
LIBRARIES = ("torch", "torchvision", "timm", "transformers", "numpy", "wids", "tensorboard", "wandb")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes so far: CUDA's max allocated on a GPU, the process's peak resident set on the CPU (Linux
    reports ru_maxrss in KiB; it never resets)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def check_backends(report_to: Sequence[str]) -> None:
    """ConfigError naming the pip command when a back-end report_to asks for is not installed."""
    missing = [name for name in report_to if importlib.util.find_spec(BACKENDS[name][0]) is None]
    if missing:
        packages = " ".join(BACKENDS[name][1] for name in missing)
        raise ConfigError(f"report_to asks for {', '.join(missing)}, which is not installed: pip install "
                          f"{packages} (or leave it out of report_to)")


def _git(*args: str) -> str | None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_record(world_size: int, resumed_from: Mapping | None = None) -> dict:
    """The command line, git commit and whether the tree was dirty, library versions, hostnames (every
    rank's: a collective), world size and, on a resume, the checkpoint and where it put the run
    (resumed_from {'path', 'epoch', 'step'}; null on a fresh start) of this start of the run."""
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": [sys.executable, *sys.argv], "cwd": os.getcwd(),
            "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": None if status is None else bool(status), "versions": versions,
            "hostnames": all_gather_objects(socket.gethostname()), "world_size": world_size,
            "resumed_from": None if resumed_from is None else dict(resumed_from)}


class _Tee(io.TextIOBase):
    """A text stream that writes to the console and to a file; progress-bar redraws (with \\r) stay off
    the file."""

    def __init__(self, stream: Any, path: str) -> None:
        self.stream, self.file = stream, open(path, "a", encoding="utf-8", buffering=1)

    def write(self, text: str) -> int:
        self.stream.write(text)
        if "\r" not in text:
            self.file.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def prune_checkpoints(output_dir: str, keep: int, protect: Sequence[str] = ()) -> list[str]:
    """Delete all but the newest `keep` epoch checkpoints (checkpoint_NN.pth) in output_dir, never one in
    `protect` (the one latest.json names); returns the deleted paths. keep 0: delete nothing."""
    if keep <= 0 or not is_main_process():
        return []
    names = sorted(n for n in os.listdir(output_dir)
                   if n.startswith("checkpoint_") and n.endswith(".pth") and n[11:-4].isdigit())
    protected = {os.path.abspath(p) for p in protect}
    deleted = []
    for name in names[:-keep]:
        path = os.path.join(output_dir, name)
        if os.path.abspath(path) not in protected:
            os.remove(path)
            deleted.append(path)
    return deleted


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        with open(netrc, encoding="utf-8") as f:
            return "online" if "api.wandb.ai" in f.read() else "offline"
    except OSError:
        return "offline"


class Reporter:
    """Rank 0's per-step and per-epoch outputs and back-ends for one run in output_dir (no-ops elsewhere)."""

    def __init__(self, output_dir: str, report_to: Sequence[str], config: Mapping, run_name: str,
                 project: str) -> None:
        self.output_dir = output_dir
        self.main = is_main_process()
        self.tensorboard = self.wandb = None
        self._console: list[tuple[str, Any]] = []
        name = "console.txt" if self.main else f"console_rank{get_rank()}.txt"
        os.makedirs(output_dir, exist_ok=True)  # rank 0 makes it too; another rank may get here first
        for attr in ("stdout", "stderr"):
            self._console.append((attr, getattr(sys, attr)))
            setattr(sys, attr, _Tee(getattr(sys, attr), os.path.join(output_dir, name)))
        if not self.main:
            return
        self.metrics = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8", buffering=1)
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"))
        if "wandb" in report_to:
            import wandb

            id_file = os.path.join(output_dir, "wandb_run_id.txt")
            run_id = open(id_file).read().strip() if os.path.exists(id_file) else secrets.token_hex(8)
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
            self.wandb = wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=output_dir,
                                    mode=_wandb_mode(), config=dict(config))

    def record_start(self, record: Mapping) -> None:
        """Append this start's run record to run_record.jsonl."""
        if self.main:
            with open(os.path.join(self.output_dir, "run_record.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def step(self, global_step: int, epoch: int, values: Mapping[str, float]) -> None:
        """One logged step's values: a line of metrics.jsonl and a scalar each to the back-ends."""
        if not self.main:
            return
        self.metrics.write(json.dumps({"step": global_step, "epoch": epoch, **values}) + "\n")
        if self.tensorboard is not None:
            for k, v in values.items():
                self.tensorboard.add_scalar(f"train/{k}", v, global_step)
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in values.items()}, step=global_step)

    def epoch(self, global_step: int, record: Mapping[str, Any]) -> None:
        """An epoch's log record: its numbers to the back-ends, under epoch/."""
        if not self.main:
            return
        numbers = {k: float(v) for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tensorboard is not None:
            for k, v in numbers.items():
                self.tensorboard.add_scalar(f"epoch/{k}", v, global_step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({f"epoch/{k}": v for k, v in numbers.items()}, step=global_step)

    def image(self, tag: str, path: str, global_step: int) -> None:
        """A PNG written to output_dir, to the back-ends as an image."""
        if not self.main or (self.tensorboard is None and self.wandb is None):
            return
        from PIL import Image

        with Image.open(path) as im:
            pixels = np.asarray(im.convert("RGB"))
        if self.tensorboard is not None:
            self.tensorboard.add_image(tag, pixels, global_step, dataformats="HWC")
            self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(pixels)}, step=global_step)

    def close(self) -> None:
        """Flush and close the back-ends and files; restore the console streams."""
        if self.main:
            self.metrics.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            if self.wandb is not None:
                self.wandb.finish()
        for attr, stream in reversed(self._console):
            tee = getattr(sys, attr)
            setattr(sys, attr, stream)
            if isinstance(tee, _Tee):
                tee.file.close()
        self._console = []
