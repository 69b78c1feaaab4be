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
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

from dataset import QACollate, QuestionCollate, VQADataset, load_json_list
from dataset.bad_samples import SkipBadCollate, SkipBadSamples
from models.loading import load_task_checkpoint
from models.vqa import ALBEF_VQA, vqa_accuracy
from training.bad_samples import BadSampleLog
from training.cli import run_main, script_parser
from training.config import VQAConfig
from training.distributed import DistInfo, all_gather_objects, is_main_process, print_main
from training.finetune import Finetune, FinetuneTask, set_up, train_or_evaluate
from training.loaders import create_loader

PARSER = script_parser("VQA.py", __doc__.splitlines()[0],
                       evaluate="answer the test questions with --checkpoint only (writes vqa_result.json)")


def build_model(config: VQAConfig, tokenizer, checkpoint: str | None) -> ALBEF_VQA:
    """ALBEF_VQA with --checkpoint loaded (a pre-training checkpoint initialises the decoder)."""
    model = ALBEF_VQA(config, tokenizer)
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
    likelihood. The loader's batches are QuestionBatches (dataset.collate); bad ones go to `bad`."""
    model.eval()
    results = []
    for batch in loader:
        bad.record([f"{split} {reason}" for reason in batch.reasons])
        question = batch.question.to(device)
        states = model.encode_question(batch.image.to(device), question.input_ids, question.attention_mask)
        ranked, _ = model.rank_answers(states, question.attention_mask, answers["input_ids"],
                                       answers["attention_mask"], k)
        # A bad question (its placeholder was ranked with the batch) gets no answer at all.
        results.extend({"question_id": qid, "answer": answer_list[best]} for qid, best, ok
                       in zip(batch.question_ids, ranked[:, 0].tolist(), batch.valid.tolist()) if ok)
    return results


def evaluate(model: ALBEF_VQA, dataset: VQADataset, tokenizer, config: VQAConfig, info: DistInfo,
             gts: dict, result_path: str | None, split: str = "test") -> tuple[float | None, int]:
    """Answer every good question of dataset (ranks take disjoint strides); write result_path on the
    main process. Returns (VQA accuracy over the answered questions when gts, ground-truth answers, are
    given, else None; bad questions summed over ranks). A bad question (unreadable image, empty
    question; dataset.bad_samples) gets no answer in the result file."""
    # The stride is taken of the wrapped dataset, so that a reason names the question's json index.
    part = Subset(SkipBadSamples(dataset), range(info.rank, len(dataset), info.world_size))
    collate = SkipBadCollate(QuestionCollate(tokenizer, config.max_tokens))
    loader = create_loader(part, None, config.batch_size_test, config.num_workers, collate_fn=collate,
                           drop_last=False)
    answers = tokenizer(dataset.answer_list, padding="longest", return_tensors="pt").to(info.device)
    bad = BadSampleLog()
    results = predict(model, loader, dataset.answer_list, answers, config.k_test, info.device, bad, split)
    # One collective for answers and counts; every rank takes part, bad questions or not.
    parts = all_gather_objects((results, bad.count))
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


class VQATask(FinetuneTask):
    """Answer-decoder fine-tuning; val accuracy every epoch (when val_file is set), the test answers
    (vqa_result.json) from the final model."""

    name = "VQA"

    def __init__(self, setup: Finetune) -> None:
        super().__init__(setup, QACollate)
        self.val_set, self.test_set = setup.val_set, setup.test_set
        self.val_gts = ground_truth(self.config.val_file) if self.val_set is not None else {}
        self.test_gts = ground_truth(self.config.test_file)

    def step(self, model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The answer loss of one batch of questions (answers grouped by question, weighted by score)."""
        question, answer = batch.question.to(self.device), batch.answer.to(self.device)
        loss = model(batch.image.to(self.device, non_blocking=True), question.input_ids,
                     question.attention_mask, answer.input_ids, answer.attention_mask,
                     batch.weights.to(self.device, non_blocking=True),
                     batch.counts.to(self.device, non_blocking=True), valid=batch.valid_on(self.device))
        return loss, {"train_loss_vqa": loss.detach()}

    def evaluate(self, epoch: int | None, output_dir: str) -> dict:
        """val_acc after every epoch (with val_file); the test answers after the last epoch and for
        --evaluate (epoch None), test_acc when the test json has answers."""
        start, record = time.time(), {}
        if epoch is not None and self.val_set is not None:
            record["val_acc"], record["val_bad_samples"] = evaluate(
                self.model, self.val_set, self.tokenizer, self.config, self.info, self.val_gts, None, "val")
        if epoch is None or epoch == self.config.max_epoch - 1:  # the answers come from the final model
            acc, bad = evaluate(self.model, self.test_set, self.tokenizer, self.config, self.info,
                                self.test_gts, os.path.join(output_dir, "vqa_result.json"), "test")
            if acc is not None:
                record["test_acc"] = acc
            record["test_bad_samples"] = bad
        if record:
            record["eval_seconds"] = round(time.time() - start, 3)
        return record


def main(argv: Sequence[str] | None = None) -> dict:
    """Fine-tune (or with --evaluate only answer) from the command line; returns the last log record."""
    setup = set_up(argv, PARSER, "vqa", build_model, unit="questions")
    return train_or_evaluate(setup, VQATask(setup))


if __name__ == "__main__":
    run_main(main)
