"""VQA v2 fine-tuning with an answer decoder (paper S.M. D, as ALBEF).

    python -m torch.distributed.launch --nproc_per_node=4 --use_env VQA.py \
        --config configs/VQA.yaml --output_dir output/VQA --checkpoint output/Pretrain/checkpoint_19.pth
    # inference only (writes output_dir/vqa_result.json)
    python VQA.py --config configs/VQA.yaml --output_dir output/VQA_eval \
        --checkpoint output/VQA/checkpoint_07.pth --evaluate

Training: answer LM loss weighted by the VQA soft scores. Inference on test_file ranks the answer list
(first-token scores pick k_test candidates, the full answer likelihood decides) and writes
output_dir/vqa_result.json ([{"question_id", "answer"}], the official submission format). When the
test json carries ground-truth answers (lists of annotator answers) the VQA accuracy is logged as
test_acc; an optional val_file is evaluated after every epoch (val_acc).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

from dataset import VQADataset, create_dataset, load_json_list, prepare_data, test_transform, vqa_collate
from dataset.bad_samples import SkipBadCollate, SkipBadSamples, device_valid
from models.loading import load_task_checkpoint
from models.tokenization import build_tokenizer
from models.vqa import ALBEF_VQA, vqa_accuracy
from training.bad_samples import BadSampleLog
from training.checkpoints import resolve_resume
from training.cli import build_parser, run_main, start
from training.config import get_max_epoch
from training.distributed import (
    DistInfo,
    get_world_size,
    is_dist,
    is_main_process,
    print_main,
)
from training.loaders import create_loader
from training.logger import setup_output_dir
from training.loop import evaluate_only, run_finetune
from training.reproducibility import build_on_every_rank
from training.validation import check_global_batch


class QACollate:
    """Train items -> images (B,3,H,W), questions (B,Lq), answers (A,La), weights (A,), counts (B,).

    counts[b] is the number of answers of question b (answers are grouped by question, in order).

    Answers are tokenized as [CLS] answer [SEP]: [CLS] is the decoder's start token, [SEP] its end token.
    """

    def __init__(self, tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    def __call__(self, items: list[tuple]) -> tuple[Tensor, dict, dict, Tensor, Tensor]:
        images, questions, answers, weights, counts = vqa_collate(items)
        question = self.tokenizer(questions, padding="longest", truncation=True, max_length=self.max_tokens,
                                  return_tensors="pt")
        answer = self.tokenizer(answers, padding="longest", return_tensors="pt")
        return images, question, answer, weights, torch.as_tensor(counts, dtype=torch.long)


class QuestionCollate:
    """Test items -> images (B,3,H,W), tokenized questions (B,Lq), question ids (list)."""

    def __init__(self, tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    def __call__(self, items: list[tuple]) -> tuple[Tensor, dict, list]:
        images, questions, question_ids = zip(*items)
        question = self.tokenizer(list(questions), padding="longest", truncation=True,
                                  max_length=self.max_tokens, return_tensors="pt")
        return torch.stack(images), question, list(question_ids)


def build_model(config: Mapping, tokenizer, checkpoint: str | None) -> ALBEF_VQA:
    """ALBEF_VQA with --checkpoint loaded (a pre-training checkpoint initialises the decoder)."""
    model = ALBEF_VQA(dict(config), tokenizer)
    load_task_checkpoint(model, checkpoint, log=print_main)
    return model


def ground_truth(files) -> dict:
    """question_id -> annotator answers, for the entries of the json `files` that have answers."""
    gts = {}
    for entry in load_json_list(files, required=("question_id",)):
        answer = entry.get("answer")
        if answer:
            gts[entry["question_id"]] = [answer] if isinstance(answer, str) else list(answer)
    return gts


@torch.no_grad()
def predict(model: ALBEF_VQA, loader: DataLoader, answer_list: list[str], answers: dict, k: int,
            device: torch.device, bad: BadSampleLog, split: str = "test") -> list[dict]:
    """[{"question_id", "answer"}] of the loader's good questions: top-k by first token, then by
    likelihood. The loader's batches end with (valid, reasons) (SkipBadCollate); bad ones go to `bad`."""
    model.eval()
    results = []
    for image, question, question_ids, valid, reasons in loader:
        bad.record([f"{split} {reason}" for reason in reasons])
        question = question.to(device)
        states = model.encode_question(image.to(device), question.input_ids, question.attention_mask)
        ranked, _ = model.rank_answers(states, question.attention_mask, answers["input_ids"],
                                       answers["attention_mask"], k)
        # A bad question (its placeholder was ranked with the batch) gets no answer at all.
        results.extend({"question_id": qid, "answer": answer_list[best]}
                       for qid, best, ok in zip(question_ids, ranked[:, 0].tolist(), valid.tolist()) if ok)
    return results


def evaluate(model: ALBEF_VQA, dataset: VQADataset, tokenizer, config: Mapping, info: DistInfo,
             gts: dict, result_path: str | None, split: str = "test") -> tuple[float | None, int]:
    """Answer every good question of dataset (ranks take disjoint strides); write result_path on the
    main process. Returns (VQA accuracy over the answered questions when gts, ground-truth answers, are
    given, else None; bad questions summed over ranks). A bad question (unreadable image, empty
    question; dataset.bad_samples) gets no answer in the result file."""
    if dataset.answer_list is None:
        raise ValueError("VQA evaluation needs config key 'answer_list'")
    # The stride is taken of the wrapped dataset, so that a reason names the question's json index.
    part = Subset(SkipBadSamples(dataset), range(info.rank, len(dataset), info.world_size))
    collate = SkipBadCollate(QuestionCollate(tokenizer, int(config.get("max_tokens", 40))))
    loader = create_loader(part, None, int(config.get("batch_size_test", 16)),
                           int(config.get("num_workers", 0)), collate_fn=collate, drop_last=False)
    answers = tokenizer(dataset.answer_list, padding="longest", return_tensors="pt").to(info.device)
    k = int(config.get("k_test", 128))
    bad = BadSampleLog()
    results = predict(model, loader, dataset.answer_list, answers, k, info.device, bad, split)
    bad_count = bad.count
    if is_dist():
        # One collective for answers and counts; every rank takes part, bad questions or not.
        parts: list = [None] * get_world_size()
        torch.distributed.all_gather_object(parts, (results, bad.count))
        results = [r for part_results, _ in parts for r in part_results]
        bad_count = sum(count for _, count in parts)
    order = {entry["question_id"]: i for i, entry in enumerate(dataset.ann)}
    results.sort(key=lambda r: order[r["question_id"]])
    if result_path and is_main_process():
        tmp = f"{result_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(results, f)
        os.replace(tmp, result_path)
        skipped = f" ({bad_count} bad questions have none)" if bad_count else ""
        print_main(f"wrote {len(results)} answers to {result_path}{skipped}")
    if not gts:
        return None, bad_count
    # Over the answered questions only: vqa_accuracy scores a question without a prediction 0.
    predictions = {r["question_id"]: r["answer"] for r in results}
    answered = {q: gt for q, gt in gts.items() if q in predictions}
    return (vqa_accuracy(predictions, answered) if answered else 0.0), bad_count


def main(argv: list[str] | None = None) -> dict:
    """Fine-tune (or with --evaluate only answer) from the command line; returns the last log record."""
    parser = build_parser(__doc__.splitlines()[0], default_output_dir="output/VQA")
    args, config, info, seed = start(argv, parser, required=("train_file", "test_file", "answer_list"),
                                     task="vqa")
    device = info.device
    prepare_data(config)

    tokenizer = build_tokenizer(config)
    train_set, test_set = create_dataset("vqa", config)
    if not args.evaluate:
        check_global_batch(len(train_set), config, "batch_size_train", info.world_size, unit="questions")
    # The same seed on every rank while building, so that an un-loaded model is identical everywhere.
    model = build_on_every_rank(
        lambda: build_model(config, tokenizer, args.checkpoint), seed, info.rank).to(device)
    output_dir = setup_output_dir(args, config)
    max_tokens = int(config.get("max_tokens", 40))

    test_gts = ground_truth(config["test_file"])
    val_set, val_gts = None, {}
    if config.get("val_file"):
        val_set = VQADataset(config["val_file"], test_transform(int(config["image_res"])),
                             config.get("image_root", "") or "", "test", answer_list=config["answer_list"],
                             max_words=int(config.get("max_words", 30)))
        val_gts = ground_truth(config["val_file"])
    result_path = os.path.join(output_dir, "vqa_result.json")

    def evaluate_test(record: dict) -> None:
        start = time.time()
        acc, bad = evaluate(model, test_set, tokenizer, config, info, test_gts, result_path, "test")
        if acc is not None:
            record["test_acc"] = acc
        record["test_bad_samples"] = bad
        record["eval_seconds"] = round(time.time() - start, 3)

    if args.evaluate:
        return evaluate_only(output_dir, args.checkpoint, evaluate_test)

    max_epoch = get_max_epoch(config)

    def evaluate_epoch(record: dict, epoch: int) -> None:
        if val_set is not None:
            record["val_acc"], record["val_bad_samples"] = evaluate(model, val_set, tokenizer, config, info,
                                                                    val_gts, None, "val")
        if epoch == max_epoch - 1:  # the test answers (vqa_result.json) come from the final model
            evaluate_test(record)

    def step_fn(net: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        image, question, answer, weights, counts, valid, _ = batch  # valid: dataset.bad_samples
        question, answer = question.to(device), answer.to(device)
        loss = net(image.to(device, non_blocking=True), question.input_ids, question.attention_mask,
                   answer.input_ids, answer.attention_mask, weights.to(device, non_blocking=True),
                   counts.to(device, non_blocking=True), valid=device_valid(valid, device))
        return loss, {"loss_vqa": loss.detach()}

    return run_finetune(
        model, SkipBadSamples(train_set), info=info, config=config, output_dir=output_dir,
        resume=resolve_resume(args.resume, output_dir), step_fn=step_fn,
        collate_fn=SkipBadCollate(QACollate(tokenizer, max_tokens)), log_stats={"train_loss_vqa": "loss_vqa"},
        desc="VQA", evaluate=evaluate_epoch)


if __name__ == "__main__":
    run_main(main)
