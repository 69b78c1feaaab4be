"""Image-text retrieval (paper S.M. D, IRTR): fine-tuning with queue ITC + ITM_hard, and evaluation.

    python -m torch.distributed.launch --nproc_per_node=4 --use_env Retrieval.py \
        --config configs/Retrieval_coco.yaml --output_dir output/Retrieval_coco \
        --checkpoint output/Pretrain/checkpoint_19.pth
    # evaluation only (a pre-training checkpoint gives zero-shot numbers)
    python Retrieval.py --config configs/Retrieval_flickr.yaml --output_dir output/Retrieval_eval \
        --checkpoint output/Retrieval_flickr/checkpoint_best.pth --evaluate
    # tiny CPU run on the synthetic data; --bench times the ITM re-ranking and prints JSON
    python Retrieval.py --config configs/tiny/Retrieval.yaml --output_dir output/retrieval_tiny [--bench]

log.txt gets one JSON line per epoch (training.trainer: train losses, val_* and test_* metrics: txt_r1/5/10,
img_r1/5/10, txt_r_mean, img_r_mean, r_mean, the same with itc_ for the ITC cosine's ranking alone,
bad_samples: unreadable images and empty captions left out of the scoring) and one for --evaluate;
checkpoint_best.pth is the best val r_mean;
rankings_{val,test}.json hold every image's top-k texts and every text's top-k images with scores.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dataset import ImageCollate, ImageTextCollate, RetrievalEvalDataset
from dataset.bad_samples import SkipBadCollate, SkipBadSamples
from models.loading import load_weights, read_checkpoint
from models.retrieval import MOMENTUM_PREFIXES, QUEUE_KEYS, RETRIEVAL_IGNORED_PREFIXES, ALBEF_Retrieval
from models.retrieval_eval import dense_scores, itr_metrics, topk_rankings
from training.bad_samples import BadSampleLog
from training.cli import run_main, script_parser
from training.config import RetrievalConfig
from training.distributed import DistInfo, cleanup, is_main_process, print_main
from training.finetune import Finetune, FinetuneTask, set_up, train_or_evaluate
from training.loaders import create_loader
from training.retrieval_eval import compute_itr_scores

PARSER = script_parser("Retrieval.py", __doc__.splitlines()[0],
                       evaluate="evaluate --checkpoint on the val and test splits only (zero-shot for a "
                                "pre-training checkpoint)")
PARSER.add_argument("--bench", action="store_true",
                    help="time the ITM re-ranking on the test split, print one JSON line, exit (writes "
                         "nothing: --output_dir is not needed)")
PARSER.optional_with["output_dir"] |= {"--bench"}


def build_model(config: RetrievalConfig, tokenizer, checkpoint: str | None) -> ALBEF_Retrieval:
    """ALBEF_Retrieval (momentum copies of the initial weights), then --checkpoint into the online model.

    momentum_init 'initial': the momentum model keeps the initial weights and a checkpoint's own
    momentum weights are skipped; 'checkpoint': momentum weights come from the checkpoint (its
    momentum copies if it has them, else its online weights). The feature queues always start fresh
    (random columns, as ALBEF); --resume, not --checkpoint, restores a run's queues.
    """
    model = ALBEF_Retrieval(config, tokenizer)
    if not checkpoint:
        print_main("no --checkpoint: the model starts from its initial weights")
        return model
    state = read_checkpoint(checkpoint)
    has_momentum = any(k.startswith(MOMENTUM_PREFIXES) for k in state)
    # Not loaded although the model has them; reported as ignored with the reason.
    skip = dict.fromkeys(QUEUE_KEYS, "feature queue (starts fresh; --resume, not --checkpoint, restores it)")
    mode = config.momentum_init
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
                   config: RetrievalConfig, device: torch.device, output_dir: str | None = None
                   ) -> tuple[dict, dict]:
    """Metrics of one split (prefixed `split_`, with `split_bad_samples`) and timing stats; writes
    rankings_{split}.json if asked.

    Bad samples (unreadable images, empty captions) are left out, with the captions of a bad image and
    an image without captions (models.retrieval_eval): R@K is over the remaining queries.
    """
    loader = create_loader(SkipBadSamples(dataset), None, config.batch_size_test, config.num_workers,
                           collate_fn=SkipBadCollate(ImageCollate()), drop_last=False)
    result = compute_itr_scores(
        model, loader, dataset.text, tokenizer, device, config.k_test, text_batch_size=config.text_batch_size,
        rerank_pairs=config.rerank_pairs, max_tokens=config.max_tokens, amp=bool(config.amp),
        rerank=config.itm, txt2img=dataset.txt2img,
    )
    def recall(i2t: str, t2i: str) -> dict[str, float]:
        return itr_metrics(dense_scores(result["i2t_idx"], result[i2t], len(result["text_ids"])),
                           dense_scores(result["t2i_idx"], result[t2i], len(result["image_ids"])),
                           result["txt2img"])

    metrics = recall("i2t_score", "t2i_score")
    # The same candidates ranked by the ITC cosine alone: which objective a pre-training helped (itc_*;
    # equal to the above when itm is false). R@K is exact for K <= k_test.
    metrics.update({f"itc_{k}": v for k, v in recall("i2t_itc", "t2i_itc").items()})
    # Every rank reads every image and the ranks agreed on image_valid, so this count is already the
    # split's (a sum over ranks would count each bad image once per rank); main names the first few.
    metrics["bad_samples"] = len(dataset.bad_texts) + int((~result["image_valid"]).sum())
    if is_main_process():
        BadSampleLog().record([f"{split} {reason}" for reason in dataset.bad_texts + result["bad"]])
    if output_dir and config.save_rankings and is_main_process():
        rankings = topk_rankings(result, dataset.image, dataset.text, dataset.txt2img)
        with open(os.path.join(output_dir, f"rankings_{split}.json"), "w", encoding="utf-8") as f:
            json.dump({"split": split, "k_test": config.k_test, "metrics": metrics, **rankings}, f)
    stats = {k: result[k] for k in ("itm_pairs", "encode_seconds", "rerank_seconds")}
    return {f"{split}_{k}": v for k, v in metrics.items()}, stats


def bench(model: ALBEF_Retrieval, dataset: RetrievalEvalDataset, tokenizer, config: RetrievalConfig,
          info: DistInfo) -> dict:
    """Time the evaluation of the test split: ITM pairs re-scored per second (all ranks together)."""
    _, stats = evaluate_split(model, dataset, "test", tokenizer, config, info.device)
    return {"images": len(dataset), "texts": len(dataset.text), "k_test": config.k_test,
            "rerank_pairs": config.rerank_pairs, "world_size": info.world_size,
            "device": str(info.device), "threads": torch.get_num_threads(), "itm_pairs": stats["itm_pairs"],
            "rerank_seconds": round(stats["rerank_seconds"], 3),
            "encode_seconds": round(stats["encode_seconds"], 3),
            "itm_pairs_per_s": round(stats["itm_pairs"] / max(stats["rerank_seconds"], 1e-9), 1)}


class RetrievalTask(FinetuneTask):
    """Queue ITC against the momentum encoder + ITM_hard; recall on the val and test splits every epoch."""

    name = "Retrieval"
    best_key = "val_r_mean"
    best_summary = "best val r_mean {val_r_mean:.2f} at epoch {epoch} (test r_mean {test_r_mean:.2f})"
    # Every rank enqueues the same gathered features, so the queues agree without re-sending
    # 2 x (embed_dim x queue_size) floats every step.
    broadcast_buffers = False

    def __init__(self, setup: Finetune) -> None:
        super().__init__(setup, ImageTextCollate)
        self.splits = {"val": setup.val_set, "test": setup.test_set}

    def step(self, model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The three losses of one batch (ids: image ids, so captions of one image are positives)."""
        out = model(batch.image.to(self.device, non_blocking=True), batch.text.to(self.device),
                    batch.ids.to(self.device, non_blocking=True), valid=batch.valid_on(self.device))
        objectives = self.model.objectives
        # The objectives' own metrics too (ITM: itm_accuracy, itm_match_accuracy), as Pretrain logs them.
        return out["loss"], ({k: out[k].detach() for k in objectives.loss_names}
                             | {k: out[k] for k in objectives.metric_names})

    def evaluate(self, epoch: int | None, output_dir: str) -> dict:
        """Recall metrics of the val and test splits (rankings_{split}.json written when configured)."""
        start, record = time.time(), {}
        for split, dataset in self.splits.items():
            metrics, _ = evaluate_split(self.model, dataset, split, self.tokenizer, self.config, self.device,
                                        output_dir)
            record.update(metrics)
        record["eval_seconds"] = round(time.time() - start, 3)
        return record


def main(argv: Sequence[str] | None = None) -> dict:
    """Fine-tune and/or evaluate from the command line; returns the last log record (bench: its JSON)."""
    setup = set_up(argv, PARSER, "retrieval", build_model)
    if setup.args.bench:
        record = bench(setup.model, setup.test_set, setup.tokenizer, setup.config, setup.info)
        print_main(json.dumps(record))
        cleanup()
        return record
    return train_or_evaluate(setup, RetrievalTask(setup))


if __name__ == "__main__":
    run_main(main)
