"""NLVR2 (paper S.M. D): text-assignment pre-training (stage 1), then fine-tuning (stage 2).

The config's `text_assignment` key picks the stage:

    # stage 1: 1 epoch on the pre-training data (captions -> first image / second image / neither)
    python -m torch.distributed.launch --nproc_per_node=4 --use_env NLVR.py \
        --config configs/NLVR_pretrain.yaml --output_dir output/NLVR_pretrain \
        --checkpoint output/Pretrain/checkpoint_19.pth
    # stage 2: fine-tune on NLVR2, keep the best dev epoch (checkpoint_best.pth), report dev and test-P
    python -m torch.distributed.launch --nproc_per_node=4 --use_env NLVR.py \
        --config configs/NLVR.yaml --output_dir output/NLVR \
        --checkpoint output/NLVR_pretrain/checkpoint_00.pth
    # evaluation only
    python NLVR.py --config configs/NLVR.yaml --output_dir output/NLVR_eval \
        --checkpoint output/NLVR/checkpoint_best.pth --evaluate

log.txt gets one JSON line per epoch (training.trainer: train metrics, val_acc, test_acc) and one for
--evaluate.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import Subset

from dataset import ImageTextCollate, NLVRCollate
from dataset.bad_samples import SkipBadCollate, SkipBadSamples
from models.loading import load_task_checkpoint
from models.nlvr import ALBEF_NLVR, nlvr_loss
from models.objectives import masked_mean
from training.bad_samples import BadSampleLog
from training.cli import Run, run_main, script_parser
from training.config import NLVRConfig
from training.config_files import ConfigError
from training.distributed import DistInfo, print_main, reduce_sum
from training.finetune import Finetune, FinetuneTask, set_up, train_or_evaluate
from training.loaders import create_loader

PARSER = script_parser("NLVR.py", __doc__.splitlines()[0],
                       evaluate="evaluate --checkpoint on the dev and test-P splits only (stage 2)")


def build_model(config: NLVRConfig, tokenizer, checkpoint: str | None) -> ALBEF_NLVR:
    """ALBEF_NLVR of the config's stage with --checkpoint loaded (pre-training layout duplicated, stage-1
    layout as is)."""
    model = ALBEF_NLVR(config, tokenizer)
    load_task_checkpoint(model, checkpoint, log=print_main)
    return model


@torch.no_grad()
def evaluate(model: ALBEF_NLVR, dataset, collate: NLVRCollate, config: NLVRConfig, info: DistInfo,
             split: str = "val") -> tuple[float, int]:
    """(NLVR2 accuracy over the good pairs, bad pairs) summed over ranks; every rank classifies a
    disjoint stride of the dataset (no padding: exact). A bad pair (dataset.bad_samples) is skipped."""
    model.eval()
    # The stride is taken of the wrapped dataset, so that a reason names the pair's json index.
    part = Subset(SkipBadSamples(dataset), range(info.rank, len(dataset), info.world_size))
    loader = create_loader(part, None, config.batch_size_test, config.num_workers,
                           collate_fn=SkipBadCollate(collate), drop_last=False)
    device = info.device
    bad = BadSampleLog()
    correct = torch.zeros((), dtype=torch.float64, device=device)
    good = torch.zeros((), dtype=torch.float64, device=device)
    for batch in loader:
        bad.record([f"{split} {reason}" for reason in batch.reasons])
        text, valid = batch.text.to(device), batch.valid.to(device)
        logits = model.classify(batch.image0.to(device), batch.image1.to(device), text.input_ids,
                                text.attention_mask)
        correct += ((logits.argmax(dim=1) == batch.label.to(device)) & valid).sum()
        good += valid.sum()
    stats = torch.stack([correct, good, torch.tensor(float(bad.count), dtype=torch.float64, device=device)])
    correct_all, total, bad_all = reduce_sum(stats).tolist()
    return correct_all / max(total, 1.0), int(bad_all)


def accuracy(logits: Tensor, labels: Tensor, valid: Tensor | None) -> Tensor:
    """Share of correct rows among the good samples: logits (B,C), labels (B,), valid (B,) | None -> 0-dim."""
    correct = (logits.argmax(dim=1) == labels).float()
    return correct.mean() if valid is None else masked_mean(correct, valid)


class TextAssignmentTask(FinetuneTask):
    """Stage 1: each pre-training caption is assigned to the first image, the second or neither."""

    name = "NLVR text assignment"

    def __init__(self, setup: Finetune) -> None:
        super().__init__(setup, ImageTextCollate)
        # (N,) the image of each caption entry: captions of one image are one image, never a wrong one
        self.image_ids = torch.as_tensor(setup.train_set.image_keys, dtype=torch.long, device=self.device)

    def step(self, model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        """Text-assignment loss and accuracy of one batch of captions (ids: dataset indices)."""
        valid = batch.valid_on(self.device)
        ids = self.image_ids[batch.ids.to(self.device, non_blocking=True)]
        text = batch.text.to(self.device)
        loss, logits, labels = model(batch.image.to(self.device, non_blocking=True), text.input_ids,
                                     text.attention_mask, image_ids=ids, valid=valid)
        acc = accuracy(logits, labels, valid)
        return loss, {"train_loss_ta": loss.detach(), "train_ta_acc": acc.detach()}


class NLVRTask(FinetuneTask):
    """Stage 2: NLVR2 fine-tuning; dev and test-P accuracy every epoch, the best dev epoch kept."""

    name = "NLVR"
    best_key = "val_acc"
    best_summary = "best dev accuracy {val_acc:.4f} at epoch {epoch} (test-P {test_acc:.4f})"

    def __init__(self, setup: Finetune) -> None:
        super().__init__(setup, NLVRCollate)
        self.splits = {"val": setup.val_set, "test": setup.test_set}

    def step(self, model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        """NLVR2 loss and accuracy of one batch of image pairs."""
        text = batch.text.to(self.device)
        labels = batch.label.to(self.device, non_blocking=True)
        valid = batch.valid_on(self.device)
        logits = model(batch.image0.to(self.device, non_blocking=True),
                       batch.image1.to(self.device, non_blocking=True), text.input_ids, text.attention_mask)
        loss = nlvr_loss(logits, labels, valid)
        acc = accuracy(logits, labels, valid)
        return loss, {"train_loss_nlvr": loss.detach(), "train_acc": acc.detach()}

    def evaluate(self, epoch: int | None, output_dir: str) -> dict:
        """Accuracy and bad pairs of the dev (val_) and test-P (test_) splits."""
        start, record = time.time(), {}
        for split, dataset in self.splits.items():
            record[f"{split}_acc"], record[f"{split}_bad_samples"] = evaluate(
                self.model, dataset, self.task_collate, self.config, self.info, split)
        record["eval_seconds"] = round(time.time() - start, 3)
        return record


def no_stage_one_evaluation(run: Run) -> None:
    """NLVR.py's own refusal, before any input is prepared: stage 1 has nothing to evaluate."""
    if run.config.text_assignment and run.args.evaluate:
        raise ConfigError("NLVR.py --evaluate is for NLVR2 (text_assignment: false); stage 1 has no "
                          "evaluation split")


def main(argv: Sequence[str] | None = None) -> dict:
    """Run stage 1 or stage 2 (or --evaluate) from the command line; returns the last log record."""
    setup = set_up(argv, PARSER, "nlvr", build_model, check=no_stage_one_evaluation)
    task = TextAssignmentTask(setup) if setup.config.text_assignment else NLVRTask(setup)
    return train_or_evaluate(setup, task)


if __name__ == "__main__":
    run_main(main)
