"""examples/open_clip_grit.py: open_clip's own model, tokenizer, transforms and ClipLoss trained with
GritSampler. Run in this process on 480 synthetic pairs for 6 epochs (~30 s): every epoch is whole
batches with no index twice, what one epoch leaves out the next one uses, and once the model learns
(the loss leaves ln 8) the batches GRIT formed are harder than random batches under the same weights."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
from conftest import ROOT


def test_open_clip_with_grit_deals_exact_epochs_of_harder_batches(in_repo, monkeypatch, capsys):
    examples = os.path.join(ROOT, "examples")
    monkeypatch.syspath_prepend(examples)  # as `python examples/open_clip_grit.py` puts it on the path
    path = os.path.join(examples, "open_clip_grit.py")
    spec = importlib.util.spec_from_file_location("open_clip_grit", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    D, N = 480, 8
    rows = example.main(["--data", "data/synthetic", "--limit", str(D), "--epochs", "6", "--batch_size",
                         str(N), "--lr", "1e-3"])["epochs"]
    assert "hardness of its batches" in capsys.readouterr().out
    left_out = set()
    for row in rows:
        batches = row["indices"]
        used = [i for b in batches for i in b]
        assert len(batches) == D // N and all(len(b) == N for b in batches)
        assert len(set(used)) == len(used) and set(used) <= set(range(D))
        assert left_out <= set(used)  # what the last epoch left out comes back
        left_out = set(range(D)) - set(used)
        assert len(left_out) < N
    assert rows[0]["loss"] == pytest.approx(math.log(N), abs=0.05)  # random init: chance
    assert rows[0]["grit_batches"] == rows[0]["random_batches"]  # epoch 0: random batches, one measure
    assert rows[-1]["loss"] < math.log(N) - 0.3  # it learns ...
    for row in rows[3:]:  # ... and from then on GRIT's groups are harder than random batches
        assert row["grit_batches"] > row["random_batches"] + 0.02, row
