"""Slow (`make test-slow`): tiny pre-training, then retrieval and the demo's NLVR2 and VQA chain on
held-out splits."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("in_repo")]


def test_pretrain_then_retrieval_and_vqa_beat_chance_and_nlvr_runs(tmp_path):
    from tools.downstream import run_downstream
    from tools.launch import run
    from tools.runs import last_checkpoint

    pre_dir = str(tmp_path / "pretrain")
    run(["Pretrain", "--config", "configs/tiny/Pretrain.yaml", "--output_dir", pre_dir])
    checkpoint = last_checkpoint(pre_dir)
    # Retrieval fine-tuning (2 epochs) must keep the zero-shot recall on the 1,000 test images, which
    # is already high: test r_mean 85.7 -> 85.5 (seed 42), 80.9 -> 82.5 (seed 1). A model that learned
    # nothing sits near r_mean 1.
    ret = {}
    for mode in ("zeroshot", "finetune"):
        out = str(tmp_path / f"retrieval_{mode}")
        extra = ["--evaluate"] if mode == "zeroshot" else ["--set", "max_epoch=2", "schedular.epochs=2"]
        run(["Retrieval", "--config", "configs/tiny/Retrieval.yaml", "--output_dir", out,
             "--checkpoint", checkpoint, *extra])
        with open(os.path.join(out, "log.txt")) as f:
            ret[mode] = [json.loads(line) for line in f][-1]
    assert ret["finetune"]["test_r_mean"] > max(ret["zeroshot"]["test_r_mean"] - 2, 70), ret

    result = run_downstream(str(tmp_path), checkpoint)

    # NLVR2 runs end to end (text assignment, fine-tune, best dev epoch) and its accuracies are read.
    # From this 12-epoch checkpoint it stays near chance (seed 42: dev 0.558, test-P 0.512); the
    # accuracy is asserted in test_grit_helps, from the 36-epoch checkpoints that the downstream chain
    # starts from (docs/synthetic-world.md, 'NLVR2 on the synthetic data').
    from training.config_resolve import resolve_config

    with open(tmp_path / "nlvr" / "log.txt") as f:
        nlvr_log = [json.loads(line) for line in f]
    epochs = resolve_config("nlvr", "configs/tiny/NLVR.yaml", check_paths=False).max_epoch
    assert len(nlvr_log) == epochs and result["nlvr_dev"] == max(r["val_acc"] for r in nlvr_log), result
    assert result["vqa_test"] > result["vqa_majority"] + 0.2, result
    with open(result["vqa_results"]) as f:
        assert len(json.load(f)) > 0
