"""Issue 14 for the evaluation splits: an entry whose image is missing, not an image or empty, or whose
text is empty after cleaning, is skipped and counted (`<split>_bad_samples`), and the metrics are those
of the same split without the bad entries (Retrieval R@K, NLVR2 accuracy, VQA answers and accuracy).

Random-init tiny models on data/synthetic, CPU; the bad entries sit among good ones, so that the index
bookkeeping (candidates, queries, result files) is exercised, not only the counts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port

from models.vqa import vqa_accuracy

pytestmark = pytest.mark.usefixtures("in_repo")  # tests/conftest.py: repo paths, one thread, data

EMPTY = " ?! .. "  # empty after cleaning


@pytest.fixture(scope="module")
def unreadable(tmp_path_factory) -> dict[str, str]:
    """Absolute paths of a missing image, a text file named .jpg and a zero-byte png."""
    root = tmp_path_factory.mktemp("bad_images")
    (root / "text.jpg").write_text("this is not an image\n")
    (root / "zero.png").write_bytes(b"")
    return {"missing": str(root / "missing.png"), "text": str(root / "text.jpg"),
            "zero": str(root / "zero.png")}


def _write(path: Path, entries: list[dict]) -> str:
    path.write_text(json.dumps(entries))
    return str(path)


def _first(name: str, n: int) -> list[dict]:
    with open(f"data/synthetic/{name}", encoding="utf-8") as f:
        return json.load(f)[:n]


def _with_bad(good: list[dict], bad: dict[int, dict]) -> list[dict]:
    """good with bad[p] inserted so that it ends up at position p."""
    entries = list(good)
    for position in sorted(bad):
        entries.insert(position, bad[position])
    return entries


def _retrieval_files(tmp_path: Path, unreadable: dict[str, str]) -> tuple[str, str, list[dict], list[int]]:
    """(bad list, clean list, the clean entries, positions of the left-out entries in the bad list)."""
    good = _first("retrieval_val.json", 10)
    spoiled = [dict(e) for e in good]
    # An empty caption among an image's good ones (entry 3 of the bad list): only the caption goes.
    spoiled[2] = dict(good[2], caption=[*good[2]["caption"][:2], EMPTY, *good[2]["caption"][2:]])
    bad = {
        0: {"image": unreadable["missing"], "caption": good[5]["caption"][:2]},
        4: {"image": unreadable["text"], "caption": [good[1]["caption"][0]]},
        7: {"image": good[3]["image"], "caption": [EMPTY, "?"]},  # readable, but no caption left
        12: {"image": unreadable["zero"], "caption": good[8]["caption"]},
    }
    return (_write(tmp_path / "retrieval_bad.json", _with_bad(spoiled, bad)),
            _write(tmp_path / "retrieval_clean.json", good), good, sorted(bad))


def _retrieval_args(out: str, bad_file: str, clean_file: str) -> list[str]:
    return ["--config", "configs/tiny/Retrieval.yaml", "--output_dir", out, "--device", "cpu", "--evaluate",
            "--set", f"val_file={bad_file}", f"test_file={clean_file}", "k_test=4", "rerank_pairs=16"]


RETRIEVAL_BAD = 3 + 1 + 2  # three unreadable images, one empty caption, an entry of two empty captions


def _same_retrieval_metrics(record: dict) -> None:
    """val (the bad list) and test (the clean list) agree on every R@K."""
    metrics = [k[len("test_"):] for k in record if k.startswith("test_") and k != "test_bad_samples"]
    assert len(metrics) == 18  # R@1/5/10 and means, re-ranked and ITC-only (itc_*)
    assert {k: record[f"val_{k}"] for k in metrics} == {k: record[f"test_{k}"] for k in metrics}


def test_retrieval_leaves_out_bad_images_with_their_captions_and_empty_captions(tmp_path, unreadable, capsys):
    import Retrieval

    bad_file, clean_file, good, left_out = _retrieval_files(tmp_path, unreadable)
    out = str(tmp_path / "out")
    record = Retrieval.main(_retrieval_args(out, bad_file, clean_file))
    assert record["val_bad_samples"] == RETRIEVAL_BAD and record["test_bad_samples"] == 0
    _same_retrieval_metrics(record)
    err = capsys.readouterr().err
    assert "skipped bad sample: val entry 0: cannot read image" in err and "file not found" in err
    assert "val entry 3: caption" in err and "empty after cleaning" in err

    # The rankings name split indices of the bad list; the bad images and their captions are absent.
    with open(os.path.join(out, "rankings_val.json"), encoding="utf-8") as f:
        rankings = json.load(f)
    kept = [i for i in range(len(good) + len(left_out)) if i not in left_out]
    assert [r["image_index"] for r in rankings["image_to_text"]] == kept
    kept_texts = {t for r in rankings["image_to_text"] for t in r["gt_text_ids"]}
    assert [r["text_index"] for r in rankings["text_to_image"]] == sorted(kept_texts)
    assert len(kept_texts) == sum(len(e["caption"]) for e in good)
    assert all(set(r["text_ids"]) <= kept_texts for r in rankings["image_to_text"])
    assert all(set(r["image_ids"]) <= set(kept) for r in rankings["text_to_image"])


def _nlvr_files(tmp_path: Path, unreadable: dict[str, str]) -> tuple[str, str]:
    good = _first("nlvr_dev.json", 12)
    bad = {
        0: dict(good[0], images=[unreadable["missing"], good[0]["images"][1]]),
        5: dict(good[1], images=[good[1]["images"][0], unreadable["text"]]),
        9: dict(good[2], images=[unreadable["zero"], unreadable["zero"]]),
        15: dict(good[3], sentence=EMPTY),
    }
    return (_write(tmp_path / "nlvr_bad.json", _with_bad(good, bad)),
            _write(tmp_path / "nlvr_clean.json", good))


def _nlvr_args(out: str, bad_file: str, clean_file: str) -> list[str]:
    return ["--config", "configs/tiny/NLVR.yaml", "--output_dir", out, "--device", "cpu", "--evaluate",
            "--set", f"val_file=[{bad_file}]", f"test_file=[{clean_file}]"]


def test_nlvr_accuracy_is_over_the_good_pairs(tmp_path, unreadable, capsys):
    import NLVR

    bad_file, clean_file = _nlvr_files(tmp_path, unreadable)
    record = NLVR.main(_nlvr_args(str(tmp_path / "out"), bad_file, clean_file))
    assert record["val_bad_samples"] == 4 and record["test_bad_samples"] == 0
    assert record["val_acc"] == record["test_acc"]
    err = capsys.readouterr().err
    assert all(f"val entry {i}: " in err for i in (0, 5, 9, 15)) and "empty after cleaning" in err


def _evaluate_on_rank(rank: int, world_size: int, jobs: list[tuple[str, int, list[str]]]) -> None:
    """One rank of gloo jobs (script, port, argv), launched the way torchrun would (environment)."""
    import importlib

    torch.set_num_threads(1)
    for script, port, argv in jobs:  # each main starts and ends its own process group
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        importlib.import_module(script).main(argv)


def _last_record(out: str) -> dict:
    with open(os.path.join(out, "log.txt"), encoding="utf-8") as f:
        return json.loads(f.readlines()[-1])


def test_two_ranks_sum_sharded_counts_and_agree_on_retrieval_candidates(tmp_path, unreadable):
    # NLVR: rank 0 takes entries 0, 2, ..., rank 1 the odd ones, so both hold bad pairs and the counts
    # are summed. Retrieval: every rank reads every image, so the count is not multiplied by 2.
    nlvr_bad, nlvr_clean = _nlvr_files(tmp_path, unreadable)
    retrieval_bad, retrieval_clean, _, _ = _retrieval_files(tmp_path, unreadable)
    nlvr_out, retrieval_out = str(tmp_path / "nlvr"), str(tmp_path / "retrieval")
    jobs = [("NLVR", free_port(), _nlvr_args(nlvr_out, nlvr_bad, nlvr_clean)),
            ("Retrieval", free_port(), _retrieval_args(retrieval_out, retrieval_bad, retrieval_clean))]
    mp.spawn(_evaluate_on_rank, args=(2, jobs), nprocs=2, join=True)
    nlvr = _last_record(nlvr_out)
    assert nlvr["val_bad_samples"] == 4 and nlvr["test_bad_samples"] == 0
    assert nlvr["val_acc"] == nlvr["test_acc"]
    retrieval = _last_record(retrieval_out)
    assert retrieval["val_bad_samples"] == RETRIEVAL_BAD and retrieval["test_bad_samples"] == 0
    _same_retrieval_metrics(retrieval)


def test_vqa_bad_questions_get_no_answer(tmp_path, unreadable, capsys):
    import VQA

    good = _first("vqa_test.json", 10)
    question = {"question": "what colour is the circle?", "answer": ["red"] * 10, "dataset": "vqa"}
    bad = {
        1: dict(question, question_id=90001, image=unreadable["missing"]),
        4: dict(question, question_id=90002, image=unreadable["text"]),
        8: dict(question, question_id=90003, image=unreadable["zero"]),
        13: dict(good[0], question_id=90004, question=EMPTY),
    }
    bad_file = _write(tmp_path / "vqa_bad.json", _with_bad(good, bad))
    train_file = _write(tmp_path / "vqa_train.json", _first("vqa_train.json", 8))
    out = str(tmp_path / "out")
    # One training epoch: evaluation runs before the epoch checkpoint is saved, so it must not stop.
    record = VQA.main(["--config", "configs/tiny/VQA.yaml", "--output_dir", out, "--device", "cpu", "--set",
                       f"train_file=[{train_file}]", f"val_file=[{bad_file}]", f"test_file=[{bad_file}]",
                       "batch_size_train=8", "max_epoch=1", "schedular.epochs=1", "schedular.warmup_steps=0"])
    assert os.path.isfile(os.path.join(out, "checkpoint_00.pth"))
    assert record["val_bad_samples"] == record["test_bad_samples"] == 4
    with open(os.path.join(out, "vqa_result.json"), encoding="utf-8") as f:
        results = json.load(f)
    assert [r["question_id"] for r in results] == [e["question_id"] for e in good]
    predictions = {r["question_id"]: r["answer"] for r in results}
    gts = {e["question_id"]: e["answer"] for e in good}  # a bad question is no zero in the accuracy
    assert record["test_acc"] == pytest.approx(vqa_accuracy(predictions, gts))
    assert record["val_acc"] == pytest.approx(record["test_acc"])
    err = capsys.readouterr().err
    assert all(f"{split} entry {i}: " in err for split in ("val", "test") for i in (1, 4, 8, 13))
