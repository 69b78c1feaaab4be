"""Launching as clusters do: srun's variables alone form the process group (no torchrun variables), and
torchrun --max-restarts with the c10d rendezvous brings a group back after a worker is SIGKILLed mid-run,
resuming from the newest checkpoint, to the same weights as a run that was never interrupted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import HANG_GUARD_S, ROOT, fault_env, free_port, small_pretrain_sets

from training.config_files import ConfigError
from training.distributed import first_host, slurm_environment

LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
               "TORCHELASTIC_RUN_ID")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    from dataset.synthetic import ensure_synthetic

    return ensure_synthetic(str(tmp_path_factory.mktemp("launch_data") / "synthetic"), n=96, seed=3)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)


def _args(data: str, out: str, **values) -> list[str]:
    sets = {"batching.queue_size": 36, "batching.search_space": 12, "batch_size": 6, "max_epoch": 2,
            "schedular.epochs": 2, "schedular.warmup_steps": 4, "print_freq": 1000, **values}
    return ["Pretrain.py", "--config", "configs/tiny/Pretrain.yaml", "--output_dir", out, "--device", "cpu",
            "--set", *small_pretrain_sets(data, **sets)]


def test_first_host_and_the_variables_srun_sets():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07" and first_host("a1,a2") == "a1"
    assert first_host("node[001-004]") == "node001" and first_host("localhost") == "localhost"
    srun = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "gpu[07-08]"}
    assert slurm_environment(srun) == {"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
                                       "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 4242)}
    # srun's own task count for its step wins; MASTER_ADDR/PORT the user set are kept
    kept = slurm_environment({**srun, "SLURM_STEP_NUM_TASKS": "8", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (kept["WORLD_SIZE"], kept["MASTER_ADDR"], kept["MASTER_PORT"]) == ("8", "h", "1")
    # torchrun's variables win; one task is a single process
    assert slurm_environment({**srun, "WORLD_SIZE": "2"}) is None
    assert slurm_environment({**srun, "SLURM_NTASKS": "1"}) is None
    with pytest.raises(ConfigError, match="set MASTER_ADDR"):
        first_host("[bad")


def test_two_processes_started_with_slurm_variables_alone_train_together(data_dir, tmp_path):
    out = str(tmp_path / "srun")
    port = free_port()  # 20000-32767: as the port derived from the job id, 20000 + job id % 20000
    job = str(port - 20000)
    # Output to files, not pipes: waiting on rank 0's pipes while rank 1's filled would deadlock both.
    files = [(tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err") for r in range(2)]
    procs = []
    for r, (o, e) in enumerate(files):
        with open(o, "w") as stdout, open(e, "w") as stderr:
            procs.append(subprocess.Popen([sys.executable, *_args(data_dir, out)], cwd=ROOT, stdout=stdout,
                                          stderr=stderr, env=_env(SLURM_PROCID=str(r), SLURM_NTASKS="2",
                                                                  SLURM_LOCALID=str(r), SLURM_JOB_ID=job,
                                                                  SLURM_JOB_NODELIST="localhost")))
    for p in procs:
        p.wait(timeout=HANG_GUARD_S)
    outputs = [(o.read_text(), e.read_text()) for o, e in files]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert f"srun: 2 tasks, process group at localhost:{port}" in outputs[0][0]
    assert "world size 2 (gloo)" in outputs[0][0]
    log = [json.loads(line) for line in open(os.path.join(out, "log.txt"))]
    n = len(json.load(open(os.path.join(data_dir, "pretrain.json"))))
    assert [r["epoch"] for r in log] == [0, 1] and log[-1]["step"] == 2 * (n // 12)  # 2 ranks x 6
    state = torch.load(os.path.join(out, "checkpoint_01.pth"), map_location="cpu", weights_only=True)
    nxt = state["sampler"]["indices"]  # G from both ranks' features: disjoint batches, whole global batches
    assert nxt.numel() == n // 12 * 12 and nxt.unique().numel() == nxt.numel()


def _torchrun(port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}"]


def test_a_worker_killed_mid_run_restarts_and_ends_as_if_never_interrupted(data_dir, tmp_path):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    extra = {"checkpoint_every_steps": 3, "max_epoch": 3, "schedular.epochs": 3}
    proc = subprocess.run([*_torchrun(free_port()), *_args(data_dir, whole, **extra), "--resume"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Rank 1 SIGKILLs itself right after the step that follows epoch 1's first step checkpoint
    # (GRIT_VLP_FAULT; tests/conftest.py's rule). The newest checkpoint is then that step checkpoint:
    # rank 0 wrote it, latest.json last, before the next step's gradients could be all-reduced with rank
    # 1; and rank 0 can write no other, every later step needing rank 1. So the restart must resume from
    # exactly that file. (Killed at the checkpoint's own step, rank 0 could still be writing it.)
    with open(os.path.join(data_dir, "pretrain.json")) as f:
        per_epoch = len(json.load(f)) // 12  # 2 ranks x 6
    saved = (per_epoch // 3 + 1) * 3  # checkpoint_every_steps 3
    assert per_epoch < saved < saved + 1 < 2 * per_epoch  # inside epoch 1, the kill before its end
    proc = subprocess.run([*_torchrun(free_port()), *_args(data_dir, killed, **extra), "--resume"], cwd=ROOT,
                          env=_env(**fault_env(saved + 1, "kill", rank=1)), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, stderr[-3000:]
    assert f"GRIT_VLP_FAULT: rank 1 kills itself (SIGKILL) after step {saved + 1}" in stdout
    assert "exitcode: -9" in stderr  # torchrun saw the worker die, and restarted the group:
    assert "--resume: no checkpoint" in stdout and stdout.count("resumed from") == 1  # the restart resumed
    # ... from that step checkpoint, which it printed, as run_record.jsonl's second start says
    said = re.search(r"resumed from (\S+): epoch (\d+), step (\d+)", stdout)
    assert (os.path.basename(said[1]), int(said[2]), int(said[3])) == (
        f"checkpoint_step_{saved:07d}.pth", 1, saved)
    with open(os.path.join(killed, "run_record.jsonl")) as f:
        starts = [json.loads(line) for line in f]
    assert [s["resumed_from"] for s in starts] == [None, {"path": said[1], "epoch": 1, "step": saved}]

    a = torch.load(os.path.join(whole, "checkpoint_02.pth"), map_location="cpu", weights_only=True)
    b = torch.load(os.path.join(killed, "checkpoint_02.pth"), map_location="cpu", weights_only=True)
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    assert torch.equal(a["sampler"]["indices"], b["sampler"]["indices"])


def test_a_rank_left_alone_says_it_is_waiting_and_stops_with_one_error_line(tmp_path):
    """WORLD_SIZE 2 but only rank 0 starts (as a script started in an sbatch file without srun would):
    it says every interval what it waits for and why that usually happens, then stops at the timeout.
    The rendezvous starts (and with it the store's timeout) once the watcher has said it the first time:
    otherwise which comes first, the line or the timeout, would be a race between two threads."""
    code = ("import sys, threading\n"
            "import torch.distributed as dist\n"
            "import training.distributed as d\n"
            "from training.cli import run_main\n"
            "said = threading.Event()\n"
            "class Stderr:\n"  # the real stderr, noting the watcher's first line
            "    def write(self, text):\n"
            "        if 'still waiting' in text:\n"
            "            said.set()\n"
            "        return sys.__stderr__.write(text)\n"
            "    def flush(self):\n"
            "        sys.__stderr__.flush()\n"
            "sys.stderr = Stderr()\n"
            "rendezvous = dist.rendezvous\n"
            "def after_the_first_line(*args, **kwargs):\n"
            "    said.wait()\n"
            "    return rendezvous(*args, **kwargs)\n"
            "dist.rendezvous = after_the_first_line\n"
            "d._RendezvousWatch.__init__.__defaults__ = (1.0,)\n"  # say it every second, not every minute
            "run_main(lambda argv: d.init_distributed('cpu', None, timeout_minutes=0.06))\n")
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env=_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0",
                                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    assert proc.returncode == 2, proc.stderr[-3000:]
    waiting = [line for line in proc.stderr.splitlines() if "still waiting for the process group" in line]
    assert waiting and f"(2 ranks at 127.0.0.1:{port})" in waiting[0] and "--rdzv-backend c10d" in waiting[0]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: the process group of 2 ranks did not form within dist_timeout_minutes=0.06")
