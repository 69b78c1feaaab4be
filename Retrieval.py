"""Image-text retrieval (paper S.M. D, IRTR): fine-tuning with queue ITC + ITM_hard, and evaluation.

    python -m torch.distributed.launch --nproc_per_node=4 --use_env Retrieval.py \
        --config configs/Retrieval_coco.yaml --output_dir output/Retrieval_coco \
        --checkpoint output/Pretrain/checkpoint_19.pth
    # evaluation only (a pre-training checkpoint gives zero-shot numbers)
    python Retrieval.py --config configs/Retrieval_flickr.yaml --output_dir output/Retrieval_eval \
        --checkpoint output/Retrieval_flickr/checkpoint_best.pth --evaluate
    # tiny CPU run on the synthetic data; --bench times the ITM re-ranking and prints JSON
    python Retrieval.py --config configs/tiny/Retrieval.yaml --output_dir output/retrieval_tiny [--bench]

log.txt gets one JSON line per epoch (train losses, val_* and test_* metrics: txt_r1/5/10, img_r1/5/10,
txt_r_mean, img_r_mean, r_mean, bad_samples: unreadable images and empty captions left out of the
scoring) and one for --evaluate; checkpoint_best.pth is the best val r_mean;
rankings_{val,test}.json hold every image's top-k texts and every text's top-k images with scores.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.utils.data import default_collate

from dataset import ImageTextCollate, RetrievalEvalDataset, create_dataset, prepare_data
from dataset.bad_samples import SkipBadCollate, SkipBadSamples, device_valid
from models.loading import load_weights, read_checkpoint
from models.retrieval import MOMENTUM_PREFIXES, QUEUE_KEYS, RETRIEVAL_IGNORED_PREFIXES, ALBEF_Retrieval
from models.retrieval_eval import compute_itr_scores, dense_scores, itr_metrics, topk_rankings
from models.tokenization import build_tokenizer
from training.bad_samples import BadSampleLog
from training.checkpoints import resolve_resume
from training.cli import build_parser, run_main, start
from training.distributed import DistInfo, cleanup, is_main_process, print_main
from training.loaders import create_loader
from training.logger import setup_output_dir
from training.loop import evaluate_only, run_finetune
from training.reproducibility import build_on_every_rank
from training.validation import check_global_batch

LOSSES = ("loss_itc", "loss_cons", "loss_itm")


def build_model(config: Mapping, tokenizer, checkpoint: str | None) -> ALBEF_Retrieval:
    """ALBEF_Retrieval (momentum copies of the initial weights), then --checkpoint into the online model.

    momentum_init 'initial': the momentum model keeps the initial weights and a checkpoint's own
    momentum weights are skipped; 'checkpoint': momentum weights come from the checkpoint (its
    momentum copies if it has them, else its online weights). The feature queues always start fresh
    (random columns, as ALBEF); --resume, not --checkpoint, restores a run's queues.
    """
    mode = config.get("momentum_init", "initial")
    if mode not in ("initial", "checkpoint"):
        raise ValueError(f"config key 'momentum_init' must be 'initial' or 'checkpoint', got {mode!r}")
    model = ALBEF_Retrieval(dict(config), text_encoder=config.get("text_encoder"), tokenizer=tokenizer)
    if not checkpoint:
        print_main("no --checkpoint: the model starts from its initial weights")
        return model
    state = read_checkpoint(checkpoint)
    has_momentum = any(k.startswith(MOMENTUM_PREFIXES) for k in state)
    # Not loaded although the model has them; reported as ignored with the reason.
    skip = dict.fromkeys(QUEUE_KEYS, "feature queue (starts fresh; --resume, not --checkpoint, restores it)")
    if mode == "initial" and has_momentum:
        skip.update(dict.fromkeys(MOMENTUM_PREFIXES,
                                  "momentum copy (momentum_init initial: kept as initialised)"))
        print_main("momentum_init initial: the checkpoint's momentum weights are not used")
    report = load_weights(model, state, ignore=RETRIEVAL_IGNORED_PREFIXES, skip=skip)
    if mode == "checkpoint" and not has_momentum:
        model.copy_momentum()
    fresh = (*MOMENTUM_PREFIXES, *QUEUE_KEYS)  # initialised here by design, not "missing"
    report.missing = [k for k in report.missing if not k.startswith(fresh)]
    print_main(f"loaded {checkpoint} (momentum_init {mode}): {report.summary()}")
    return model


def evaluate_split(model: ALBEF_Retrieval, dataset: RetrievalEvalDataset, split: str, tokenizer,
                   config: Mapping, device: torch.device, output_dir: str | None = None) -> tuple[dict, dict]:
    """Metrics of one split (prefixed `split_`, with `split_bad_samples`) and timing stats; writes
    rankings_{split}.json if asked.

    Bad samples (unreadable images, empty captions) are left out, with the captions of a bad image and
    an image without captions (models.retrieval_eval): R@K is over the remaining queries.
    """
    loader = create_loader(SkipBadSamples(dataset), None, int(config.get("batch_size_test", 64)),
                           int(config.get("num_workers", 0)), collate_fn=SkipBadCollate(default_collate),
                           drop_last=False)
    result = compute_itr_scores(
        model, loader, dataset.text, tokenizer, device, int(config["k_test"]),
        text_batch_size=int(config.get("text_batch_size", 256)),
        rerank_pairs=int(config.get("rerank_pairs", 256)), max_tokens=int(config.get("max_tokens", 40)),
        amp=bool(config.get("amp", False)), rerank=bool(config.get("itm", True)), txt2img=dataset.txt2img,
    )
    metrics = itr_metrics(dense_scores(result["i2t_idx"], result["i2t_score"], len(result["text_ids"])),
                          dense_scores(result["t2i_idx"], result["t2i_score"], len(result["image_ids"])),
                          result["txt2img"])
    # Every rank reads every image and the ranks agreed on image_valid, so this count is already the
    # split's (a sum over ranks would count each bad image once per rank); main names the first few.
    metrics["bad_samples"] = len(dataset.bad_texts) + int((~result["image_valid"]).sum())
    if is_main_process():
        BadSampleLog().record([f"{split} {reason}" for reason in dataset.bad_texts + result["bad"]])
    if output_dir and config.get("save_rankings", True) and is_main_process():
        rankings = topk_rankings(result, dataset.image, dataset.text, dataset.txt2img)
        with open(os.path.join(output_dir, f"rankings_{split}.json"), "w", encoding="utf-8") as f:
            json.dump({"split": split, "k_test": int(config["k_test"]), "metrics": metrics, **rankings}, f)
    stats = {k: result[k] for k in ("itm_pairs", "encode_seconds", "rerank_seconds")}
    return {f"{split}_{k}": v for k, v in metrics.items()}, stats


def bench(model: ALBEF_Retrieval, dataset: RetrievalEvalDataset, tokenizer, config: Mapping,
          info: DistInfo) -> dict:
    """Time the evaluation of the test split: ITM pairs re-scored per second (all ranks together)."""
    _, stats = evaluate_split(model, dataset, "test", tokenizer, config, info.device)
    return {"images": len(dataset), "texts": len(dataset.text), "k_test": int(config["k_test"]),
            "rerank_pairs": int(config.get("rerank_pairs", 256)), "world_size": info.world_size,
            "device": str(info.device), "threads": torch.get_num_threads(), "itm_pairs": stats["itm_pairs"],
            "rerank_seconds": round(stats["rerank_seconds"], 3),
            "encode_seconds": round(stats["encode_seconds"], 3),
            "itm_pairs_per_s": round(stats["itm_pairs"] / max(stats["rerank_seconds"], 1e-9), 1)}


def main(argv: list[str] | None = None) -> dict:
    """Fine-tune and/or evaluate from the command line; returns the last log record (bench: its JSON)."""
    parser = build_parser(__doc__.splitlines()[0], default_output_dir="output/Retrieval")
    parser.add_argument("--bench", action="store_true",
                        help="time the ITM re-ranking on the test split, print one JSON line, exit")
    args, config, info, seed = start(
        argv, parser, required=("train_file", "val_file", "test_file", "k_test", "queue_size", "momentum"),
        task="retrieval")
    device = info.device
    prepare_data(config)

    tokenizer = build_tokenizer(config)
    train_set, val_set, test_set = create_dataset("retrieval", config)
    if not (args.evaluate or args.bench):
        check_global_batch(len(train_set), config, "batch_size_train", info.world_size)
    # The same seed on every rank while building, so that an un-loaded model is identical everywhere.
    model = build_on_every_rank(
        lambda: build_model(config, tokenizer, args.checkpoint), seed, info.rank).to(device)

    if args.bench:
        record = bench(model, test_set, tokenizer, config, info)
        print_main(json.dumps(record))
        cleanup()
        return record

    output_dir = setup_output_dir(args, config)

    def evaluate(epoch_record: dict, epoch: int | None = None) -> None:
        start = time.time()
        for split, dataset in (("val", val_set), ("test", test_set)):
            metrics, _ = evaluate_split(model, dataset, split, tokenizer, config, device, output_dir)
            epoch_record.update(metrics)
        epoch_record["eval_seconds"] = round(time.time() - start, 3)

    if args.evaluate:
        return evaluate_only(output_dir, args.checkpoint, evaluate)

    def step_fn(net: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        image, text, img_id, valid, _ = batch  # valid: bad samples (dataset.bad_samples)
        out = net(image.to(device, non_blocking=True), text.to(device), img_id.to(device, non_blocking=True),
                  valid=device_valid(valid, device))
        loss = out["loss_itc"] + out["loss_cons"] + out["loss_itm"]
        return loss, {k: out[k].detach() for k in LOSSES}

    # broadcast_buffers=False: every rank enqueues the same gathered features, so the queues
    # agree without re-sending 2 x (embed_dim x queue_size) floats every step.
    return run_finetune(
        model, SkipBadSamples(train_set), info=info, config=config, output_dir=output_dir,
        resume=resolve_resume(args.resume, output_dir), step_fn=step_fn,
        collate_fn=SkipBadCollate(ImageTextCollate(tokenizer, int(config.get("max_tokens", 40)))),
        log_stats={k: k for k in LOSSES}, desc="Retrieval", evaluate=evaluate, best_key="val_r_mean",
        best_summary="best val r_mean {val_r_mean:.2f} at epoch {epoch} (test r_mean {test_r_mean:.2f})",
        broadcast_buffers=False)


if __name__ == "__main__":
    run_main(main)
