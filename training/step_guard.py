"""The per-step decisions every rank must take together: skip a step whose loss is not finite, and stop
(save and exit) when the job is pre-empted (SIGTERM) or interrupted (SIGINT).

One flag vector [loss not finite, stop requested] is all-reduced (max) per step and read on the host:
that read is the only host synchronisation the training step has. On a GPU it costs one wait for the
forward pass to finish before the backward pass is queued (the CPU can no longer run ahead into the
backward kernels; the launch latency of the first backward kernels is exposed, typically tens of
microseconds per step), plus, with several ranks, one all-reduce of two numbers. Without it, a
rank that saw NaN and one that did not would run different collectives and hang, and a SIGTERM that
reaches ranks at different steps would make them stop at different steps.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch

from training.distributed import is_dist, reduce_sum

__all__ = ['Preempted', 'StepGuard', 'TooManySkippedSteps', 'ignore_stop_signals']


def ignore_stop_signals() -> None:
    """In a DataLoader worker: ignore SIGTERM/SIGINT. A cluster (or Ctrl-C) signals the whole process
    group; a worker killed by it would make the main process fail at its next batch instead of saving.
    The main process's StepGuard handles the signal; workers exit when it shuts them down or dies."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


class Preempted(SystemExit):
    """The run saved a checkpoint after SIGTERM/SIGINT and stops; exit status 128 + signal number."""


class TooManySkippedSteps(RuntimeError):
    """max_skipped_steps consecutive steps had a non-finite loss (a checkpoint was saved)."""


class StepGuard:
    """Counts skipped (non-finite) steps and turns SIGTERM/SIGINT into a synchronised stop request.

    install() (or `with guard:`) replaces the SIGTERM/SIGINT handlers until uninstall(); a signal only
    sets a flag, read at the next decide(). max_skipped_steps: consecutive skips after which the run
    stops (0: never).
    """

    def __init__(self, max_skipped_steps: int = 10) -> None:
        self.max_skipped_steps = int(max_skipped_steps)
        self.consecutive = 0
        self.skipped = 0          # this epoch; reset by start_epoch()
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StepGuard:
        """Catch SIGTERM and SIGINT (main thread only; elsewhere, e.g. in a test thread, a no-op)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread
                pass
        return self

    def uninstall(self) -> None:
        """Restore the handlers install() replaced."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> StepGuard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.signal = signum

    def start_epoch(self) -> None:
        """Reset the per-epoch skip count (the consecutive count carries over)."""
        self.skipped = 0

    def decide(self, loss: torch.Tensor) -> tuple[bool, bool]:
        """(skip this step, stop after it), the same on every rank; one host sync (see module doc)."""
        flags = torch.stack([~torch.isfinite(loss.detach()).all(),
                             torch.tensor(self.signal is not None, device=loss.device)]).float()
        if is_dist():
            flags = reduce_sum(flags)
        bad, stop = (v > 0 for v in flags.tolist())
        if bad:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        return bad, stop

    @property
    def too_many_skipped(self) -> bool:
        """True once max_skipped_steps consecutive steps were skipped."""
        return 0 < self.max_skipped_steps <= self.consecutive

    def exit_code(self) -> int:
        """128 + the signal number, the shell's status for a process ended by that signal."""
        return 128 + int(self.signal or signal.SIGTERM)
