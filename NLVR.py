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

import json
import os
import time
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Subset

import utils
from dataset import ImageTextCollate, create_dataset, prepare_data
from models.loading import load_weights
from models.nlvr import ALBEF_NLVR
from models.tokenization import build_tokenizer


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
    if checkpoint:
        report = load_weights(model, checkpoint, key_map=model.key_map(), ignore=model.ignored_keys())
        utils.print_main(f"loaded {checkpoint}: {report.summary()}")
    else:
        utils.print_main("no --checkpoint: the model starts from random weights")
    return model


def image_id_table(dataset) -> Tensor:
    """(N,) integer id of each pre-training entry's image, so that captions of one image are one image."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(entry["image"], len(ids)) for entry in dataset.ann], dtype=torch.long)


@torch.no_grad()
def evaluate(model: ALBEF_NLVR, dataset, collate: NLVRCollate, config: Mapping,
             info: utils.DistInfo) -> float:
    """NLVR2 accuracy; every rank classifies a disjoint stride of the dataset (no padding: exact)."""
    model.eval()
    part = Subset(dataset, range(info.rank, len(dataset), info.world_size))
    loader = utils.create_loader(part, None, int(config.get("batch_size_test", 64)),
                                 int(config.get("num_workers", 0)), collate_fn=collate, drop_last=False)
    device = info.device
    correct = torch.zeros((), dtype=torch.float64, device=device)
    for image0, image1, text, labels in loader:
        text = text.to(device)
        logits = model.classify(image0.to(device), image1.to(device), text.input_ids, text.attention_mask)
        correct += (logits.argmax(dim=1) == labels.to(device)).sum()
    stats = torch.stack([correct, torch.tensor(float(len(part)), dtype=torch.float64, device=device)])
    if utils.is_dist():
        torch.distributed.all_reduce(stats)
    correct_all, total = stats.tolist()
    return correct_all / max(total, 1.0)


def make_step_fn(device: torch.device, text_assignment: bool, image_ids: Tensor | None = None):
    """step_fn(model, batch) -> (loss, metrics) for utils.train_one_epoch."""
    if image_ids is not None:
        image_ids = image_ids.to(device)

    def text_assignment_step(model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        image, text, index = batch
        text = text.to(device)
        ids = None if image_ids is None else image_ids[index.to(device, non_blocking=True)]
        loss, logits, labels = model(image.to(device, non_blocking=True), text.input_ids, text.attention_mask,
                                     image_ids=ids)
        acc = (logits.argmax(dim=1) == labels).float().mean()
        return loss, {"loss_ta": loss.detach(), "ta_acc": acc.detach()}

    def nlvr_step(model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        image0, image1, text, labels = batch
        text = text.to(device)
        labels = labels.to(device, non_blocking=True)
        logits = model(image0.to(device, non_blocking=True), image1.to(device, non_blocking=True),
                       text.input_ids, text.attention_mask)
        loss = F.cross_entropy(logits, labels)
        acc = (logits.argmax(dim=1) == labels).float().mean()
        return loss, {"loss_nlvr": loss.detach(), "acc": acc.detach()}

    return text_assignment_step if text_assignment else nlvr_step


def main(argv: list[str] | None = None) -> dict:
    """Run stage 1 or stage 2 (or --evaluate) from the command line; returns the last log record."""
    parser = utils.build_parser(__doc__.splitlines()[0], default_output_dir="output/NLVR")
    args = utils.parse_args(argv, parser=parser)
    config = utils.config_from_args(args)
    text_assignment = bool(config.get("text_assignment", False))
    required = ("train_file",) if text_assignment else ("train_file", "val_file", "test_file")
    utils.require_keys(config, required, args.config)
    if text_assignment and args.evaluate:
        raise ValueError("--evaluate is for NLVR2 (text_assignment: false); stage 1 has no evaluation split")
    info = utils.init_distributed(args)
    device = info.device
    seed = int(config.get("seed", 42))
    prepare_data(config)

    tokenizer = build_tokenizer(config)
    # The same seed on every rank while building, so that the fresh heads are identical everywhere.
    utils.seed_everything(seed, 0)
    model = build_model(config, tokenizer, args.checkpoint, text_assignment).to(device)
    utils.seed_everything(seed, info.rank)
    output_dir = utils.setup_output_dir(args, config)
    max_tokens = int(config.get("max_tokens", 40))

    if text_assignment:
        train_set = create_dataset("pretrain", config)
        collate = ImageTextCollate(tokenizer, max_tokens)
    else:
        train_set, val_set, test_set = create_dataset("nlvr", config)
        collate = NLVRCollate(tokenizer, max_tokens)

    def evaluate_all(record: dict) -> None:
        start = time.time()
        record["val_acc"] = evaluate(model, val_set, collate, config, info)
        record["test_acc"] = evaluate(model, test_set, collate, config, info)
        record["eval_seconds"] = round(time.time() - start, 3)

    if args.evaluate:
        record = {"mode": "evaluate", "checkpoint": args.checkpoint}
        evaluate_all(record)
        utils.print_main(json.dumps(record))
        utils.append_log(output_dir, record)
        utils.cleanup()
        return record

    batch_size = int(config["batch_size_train"])
    sampler, loader = utils.finetune_loader(train_set, info, seed=seed, batch_size=batch_size,
                                            num_workers=int(config.get("num_workers", 0)), collate_fn=collate)
    steps_per_epoch = len(sampler) // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"train_file has {len(train_set)} entries: fewer than one batch of {batch_size} "
                         "per rank")
    model_ddp = utils.wrap_ddp(model, info)
    optimizer = utils.build_optimizer(model, config["optimizer"])
    scheduler = utils.build_scheduler(optimizer, config, steps_per_epoch)
    scaler = utils.build_scaler(config, device)
    step_fn = make_step_fn(device, text_assignment, image_id_table(train_set) if text_assignment else None)

    start_epoch, global_step = 0, 0
    best = {"val_acc": -1.0, "epoch": -1}
    resume = utils.resolve_resume(args.resume, output_dir)
    if resume:
        state, start_epoch, global_step = utils.restore_training(resume, model, optimizer, scheduler, scaler,
                                                                 seed=seed, rank=info.rank)
        best = dict(state.get("best", best))
        sampler.start_batch = global_step - start_epoch * steps_per_epoch

    def checkpoint_state(epoch: int, step: int, complete: bool = False) -> dict:
        return utils.training_state(model, optimizer, scheduler, scaler, config=config, epoch=epoch,
                                    step=step, sampler_state={"seed": seed, "epoch": epoch},
                                    seed=seed, rank=info.rank, complete=complete, best=best)

    record: dict = {}
    for epoch in range(start_epoch, utils.get_max_epoch(config)):
        sampler.set_epoch(epoch)
        stats, global_step = utils.train_one_epoch(
            model_ddp, loader, optimizer, scheduler, epoch=epoch, global_step=global_step, step_fn=step_fn,
            config=config, device=device, output_dir=output_dir, scaler=scaler,
            checkpoint_state=checkpoint_state, start_batch=sampler.start_batch,
            total_batches=steps_per_epoch - sampler.start_batch,
            desc="NLVR text assignment" if text_assignment else "NLVR")
        sampler.start_batch = 0
        metrics = ("loss_ta", "ta_acc") if text_assignment else ("loss_nlvr", "acc")
        record = {"epoch": epoch, "step": global_step, "lr": stats["lr"],
                  **{f"train_{k}": stats[k] for k in metrics},
                  "train_seconds": stats["seconds"], "samples_per_s": stats["samples_per_s"]}
        if not text_assignment:
            evaluate_all(record)
            best = utils.keep_best(best, record, "val_acc", output_dir, model, config, epoch, global_step)
            record["best_epoch"] = best["epoch"]
        utils.save_checkpoint(utils.checkpoint_path(output_dir, epoch=epoch),
                              **checkpoint_state(epoch, global_step, complete=True))
        utils.append_log(output_dir, record)
        utils.print_main(json.dumps(record))
        utils.barrier()
    if best["epoch"] >= 0:
        path = os.path.join(output_dir, "checkpoint_best.pth")
        utils.print_main(f"best dev accuracy {best['val_acc']:.4f} at epoch {best['epoch']} "
                         f"(test-P {best['test_acc']:.4f}): {path}")
    utils.cleanup()
    return record


if __name__ == "__main__":
    utils.run_main(main)
