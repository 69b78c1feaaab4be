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

log.txt gets one JSON line per epoch (train metrics, val_acc, test_acc) and one for --evaluate.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.utils.data import Subset

from dataset import ImageTextCollate, create_dataset, prepare_data
from dataset.bad_samples import SkipBadCollate, SkipBadSamples, device_valid
from models.loading import load_task_checkpoint
from models.nlvr import ALBEF_NLVR, nlvr_loss
from models.objectives import masked_mean
from models.tokenization import build_tokenizer
from training.bad_samples import BadSampleLog
from training.checkpoints import resolve_resume
from training.cli import build_parser, run_main, start
from training.distributed import DistInfo, is_dist, print_main
from training.loaders import create_loader
from training.logger import setup_output_dir
from training.loop import evaluate_only, run_finetune
from training.reproducibility import build_on_every_rank
from training.validation import check_global_batch


class NLVRCollate:
    """(image0, image1, sentence, label) items -> images (B,3,H,W) x2, tokenized text (B,L), labels (B,)."""

    def __init__(self, tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    def __call__(self, items: list[tuple]) -> tuple[Tensor, Tensor, dict, Tensor]:
        image0, image1, sentences, labels = zip(*items)
        text = self.tokenizer(list(sentences), padding="longest", truncation=True, max_length=self.max_tokens,
                              return_tensors="pt")
        return torch.stack(image0), torch.stack(image1), text, torch.as_tensor(labels, dtype=torch.long)


def build_model(config: Mapping, tokenizer, checkpoint: str | None, text_assignment: bool) -> ALBEF_NLVR:
    """ALBEF_NLVR with --checkpoint loaded (pre-training layout duplicated, stage-1 layout as is)."""
    model = ALBEF_NLVR(dict(config), tokenizer, text_assignment=text_assignment)
    load_task_checkpoint(model, checkpoint, log=print_main)
    return model


def image_id_table(dataset) -> Tensor:
    """(N,) integer id of each pre-training entry's image, so that captions of one image are one image."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(entry["image"], len(ids)) for entry in dataset.ann], dtype=torch.long)


@torch.no_grad()
def evaluate(model: ALBEF_NLVR, dataset, collate: NLVRCollate, config: Mapping,
             info: DistInfo, split: str = "val") -> tuple[float, int]:
    """(NLVR2 accuracy over the good pairs, bad pairs) summed over ranks; every rank classifies a
    disjoint stride of the dataset (no padding: exact). A bad pair (dataset.bad_samples) is skipped."""
    model.eval()
    # The stride is taken of the wrapped dataset, so that a reason names the pair's json index.
    part = Subset(SkipBadSamples(dataset), range(info.rank, len(dataset), info.world_size))
    loader = create_loader(part, None, int(config.get("batch_size_test", 64)),
                           int(config.get("num_workers", 0)), collate_fn=SkipBadCollate(collate),
                           drop_last=False)
    device = info.device
    bad = BadSampleLog()
    correct = torch.zeros((), dtype=torch.float64, device=device)
    good = torch.zeros((), dtype=torch.float64, device=device)
    for image0, image1, text, labels, valid, reasons in loader:
        bad.record([f"{split} {reason}" for reason in reasons])
        text, valid = text.to(device), valid.to(device)
        logits = model.classify(image0.to(device), image1.to(device), text.input_ids, text.attention_mask)
        correct += ((logits.argmax(dim=1) == labels.to(device)) & valid).sum()
        good += valid.sum()
    stats = torch.stack([correct, good, torch.tensor(float(bad.count), dtype=torch.float64, device=device)])
    if is_dist():
        torch.distributed.all_reduce(stats)
    correct_all, total, bad_all = stats.tolist()
    return correct_all / max(total, 1.0), int(bad_all)


def accuracy(logits: Tensor, labels: Tensor, valid: Tensor | None) -> Tensor:
    """Share of correct rows among the good samples: logits (B,C), labels (B,), valid (B,) | None -> 0-dim."""
    correct = (logits.argmax(dim=1) == labels).float()
    return correct.mean() if valid is None else masked_mean(correct, valid)


def make_step_fn(device: torch.device, text_assignment: bool, image_ids: Tensor | None = None):
    """step_fn(model, batch) -> (loss, metrics) for training.loop.train_one_epoch."""
    if image_ids is not None:
        image_ids = image_ids.to(device)

    def text_assignment_step(model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        image, text, index, valid, _ = batch  # valid: bad samples (dataset.bad_samples)
        text = text.to(device)
        ids = None if image_ids is None else image_ids[index.to(device, non_blocking=True)]
        valid = device_valid(valid, device)
        loss, logits, labels = model(image.to(device, non_blocking=True), text.input_ids, text.attention_mask,
                                     image_ids=ids, valid=valid)
        acc = accuracy(logits, labels, valid)
        return loss, {"loss_ta": loss.detach(), "ta_acc": acc.detach()}

    def nlvr_step(model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        image0, image1, text, labels, valid, _ = batch
        text = text.to(device)
        labels = labels.to(device, non_blocking=True)
        valid = device_valid(valid, device)
        logits = model(image0.to(device, non_blocking=True), image1.to(device, non_blocking=True),
                       text.input_ids, text.attention_mask)
        loss = nlvr_loss(logits, labels, valid)
        acc = accuracy(logits, labels, valid)
        return loss, {"loss_nlvr": loss.detach(), "acc": acc.detach()}

    return text_assignment_step if text_assignment else nlvr_step


def main(argv: list[str] | None = None) -> dict:
    """Run stage 1 or stage 2 (or --evaluate) from the command line; returns the last log record."""
    parser = build_parser(__doc__.splitlines()[0], default_output_dir="output/NLVR")
    args, config, info, seed = start(argv, parser, required=lambda config: (
        ("train_file",) if config.get("text_assignment", False) else ("train_file", "val_file", "test_file")),
        task="nlvr")
    text_assignment = bool(config.get("text_assignment", False))
    if text_assignment and args.evaluate:
        raise ValueError("--evaluate is for NLVR2 (text_assignment: false); stage 1 has no evaluation split")
    device = info.device
    prepare_data(config)

    tokenizer = build_tokenizer(config)
    max_tokens = int(config.get("max_tokens", 40))
    if text_assignment:
        train_set = create_dataset("pretrain", config)
        collate = ImageTextCollate(tokenizer, max_tokens)
    else:
        train_set, val_set, test_set = create_dataset("nlvr", config)
        collate = NLVRCollate(tokenizer, max_tokens)
    if not args.evaluate:
        check_global_batch(len(train_set), config, "batch_size_train", info.world_size)
    # The same seed on every rank while building, so that the fresh heads are identical everywhere.
    model = build_on_every_rank(
        lambda: build_model(config, tokenizer, args.checkpoint, text_assignment), seed, info.rank).to(device)
    output_dir = setup_output_dir(args, config)

    def evaluate_all(record: dict, epoch: int | None = None) -> None:
        start = time.time()
        for split, dataset in (("val", val_set), ("test", test_set)):
            record[f"{split}_acc"], record[f"{split}_bad_samples"] = evaluate(
                model, dataset, collate, config, info, split)
        record["eval_seconds"] = round(time.time() - start, 3)

    if args.evaluate:
        return evaluate_only(output_dir, args.checkpoint, evaluate_all)

    metrics = ("loss_ta", "ta_acc") if text_assignment else ("loss_nlvr", "acc")
    return run_finetune(
        model, SkipBadSamples(train_set), info=info, config=config, output_dir=output_dir,
        resume=resolve_resume(args.resume, output_dir),
        step_fn=make_step_fn(device, text_assignment, image_id_table(train_set) if text_assignment else None),
        collate_fn=SkipBadCollate(collate), log_stats={f"train_{k}": k for k in metrics},
        desc="NLVR text assignment" if text_assignment else "NLVR",
        evaluate=None if text_assignment else evaluate_all, best_key=None if text_assignment else "val_acc",
        best_summary="best dev accuracy {val_acc:.4f} at epoch {epoch} (test-P {test_acc:.4f})")


if __name__ == "__main__":
    run_main(main)
