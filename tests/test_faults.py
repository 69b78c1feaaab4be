"""GRIT_VLP_FAULT (training/faults.py): the value read, refused with the variable named, and what a hold does.
The kill and the hold in real runs: tests/test_launch.py, test_pretrain.py and test_robustness.py."""

from __future__ import annotations

import signal

import pytest

from training.config_files import ConfigError
from training.faults import ENV, Fault
from training.step_guard import StepGuard


def test_the_variable_names_step_action_and_rank():
    assert Fault.from_env({}) is None and Fault.from_env({ENV: " "}) is None
    assert Fault.from_env({ENV: "9:kill:1"}) == Fault(step=9, action="kill", rank=1)
    assert Fault.from_env({ENV: "4:hold"}) == Fault(step=4, action="hold", rank=0)
    for bad in ("9", "9:stop", "x:kill", "9:kill:y", "9:kill:1:2", "0:kill", "3:hold:-1"):
        with pytest.raises(ConfigError, match=f'^{ENV}="{bad}": expected STEP:ACTION'):
            Fault.from_env({ENV: bad})


def test_a_hold_waits_for_the_guards_signal_and_other_steps_and_ranks_pass(capsys):
    guard = StepGuard()
    fault = Fault(step=5, action="hold", rank=1)
    fault.after_step(4, 1, guard)  # another step
    fault.after_step(5, 0, guard)  # another rank
    assert capsys.readouterr().out == ""
    guard.signal = signal.SIGTERM  # as the guard's handler sets it: the hold returns at once
    fault.after_step(5, 1, guard)
    assert capsys.readouterr().out == f"{ENV}: rank 1 holds after step 5 until SIGTERM or SIGINT\n"
