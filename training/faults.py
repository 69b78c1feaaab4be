"""A fault injected at a step the caller chooses: how the tests kill or pre-empt a run exactly where they
mean to, and how a user checks a cluster's restart path (torchrun --max-restarts, SLURM requeue) before a
long job depends on it.

GRIT_VLP_FAULT="STEP:ACTION[:RANK]" (RANK: 0 when left out), read once when a run starts afresh:

- kill: after global step STEP (its update and its step checkpoint, if one falls there), the process of
  rank RANK sends itself SIGKILL, as a node that dies does: nothing is saved, nothing is cleaned up.
- hold: after global step STEP, rank RANK prints one line saying so and waits until it receives SIGTERM or
  SIGINT (the StepGuard's signals); the run then stops after the next step, as pre-emption stops it. The
  signal comes from outside (the test, a cluster's scancel), so the step at which the run stops does not
  depend on how fast the sender and the run are relative to each other.

A resumed start (--resume found a checkpoint) never injects the fault: torchrun restarts its workers with
the same environment, and a fault that fired again on every restart would never let the run finish.
Unset (the default), the trainer holds None and a step costs one `is None` more. A malformed value stops the
run before it writes anything, with one line naming the variable.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

from training.config_files import ConfigError
from training.step_guard import StepGuard

__all__ = ["ENV", "Fault"]

ENV = "GRIT_VLP_FAULT"
ACTIONS = ("kill", "hold")


@dataclass(frozen=True)
class Fault:
    """What GRIT_VLP_FAULT asks for: after global step `step`, rank `rank` does `action` (kill | hold)."""

    step: int
    action: str
    rank: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Fault | None:
        """The fault GRIT_VLP_FAULT names, None when it is unset or empty; a malformed value is refused."""
        value = environ.get(ENV, "").strip()
        if not value:
            return None
        parts = value.split(":")
        usage = (f'{ENV}="{value}": expected STEP:ACTION[:RANK], ACTION one of {", ".join(ACTIONS)}, '
                 'e.g. "9:kill:1"')
        if len(parts) not in (2, 3) or parts[1] not in ACTIONS:
            raise ConfigError(usage)
        try:
            step, rank = int(parts[0]), int(parts[2]) if len(parts) == 3 else 0
        except ValueError:
            raise ConfigError(usage) from None
        if step < 1 or rank < 0:
            raise ConfigError(f"{usage} (STEP counts optimiser steps from 1, RANK from 0)")
        return cls(step=step, action=parts[1], rank=rank)

    def after_step(self, global_step: int, rank: int, guard: StepGuard) -> None:
        """Inject the fault if this is its step and rank (called once per step, after its checkpoint)."""
        if global_step != self.step or rank != self.rank:
            return
        if self.action == "kill":
            print(f"{ENV}: rank {rank} kills itself (SIGKILL) after step {global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"{ENV}: rank {rank} holds after step {global_step} until SIGTERM or SIGINT", flush=True)
        while guard.signal is None:  # set by the guard's handler; polled, so no signal can be missed
            time.sleep(0.01)
