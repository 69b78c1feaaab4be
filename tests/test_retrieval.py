"""Retrieval: metrics by hand, batched re-ranking, fine-tuning gain, 1 vs 2 process equality."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port

from dataset import ImageCollate, create_dataset, ensure_synthetic
from dataset.bad_samples import SkipBadCollate, SkipBadSamples
from models.losses import WithObjectives
from models.retrieval import ALBEF_Retrieval
from models.retrieval_eval import MISSED_RANK, itr_metrics, rerank_topk, retrieval_ranks
from models.tokenization import build_tokenizer
from Retrieval import build_model
from Retrieval import main as retrieval_main
from training.config import RetrievalConfig
from training.config_resolve import resolve_config
from training.retrieval_eval import compute_itr_scores, encode_eval_set

pytestmark = pytest.mark.usefixtures("one_thread", "in_repo")  # tests/conftest.py: configs name repo paths

# 4 images; captions: img0 -> t0,t1,t2; img1 -> t3; img2 -> t4,t5; img3 -> t6..t11.
TXT2IMG = [0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 3, 3]
NEG = float("-inf")


def _row_from_order(order: list[int], n: int) -> list[float]:
    """Scores that rank the listed candidates first, in that order; the rest are unscored (-inf)."""
    row = [NEG] * n
    for pos, cand in enumerate(order):
        row[cand] = 1.0 - pos / 100
    return row


def _hand_scores() -> tuple[torch.Tensor, torch.Tensor]:
    i2t = torch.tensor([
        _row_from_order([7, 1, 3, 0, 2, 4, 5, 6, 8, 9, 10, 11], 12),  # best caption t1 at rank 1
        _row_from_order([0, 1, 2, 4, 5, 6, 3, 7, 8, 9, 10, 11], 12),  # t3 at rank 6
        _row_from_order([0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 4, 5], 12),  # t4 at rank 10: a miss
        _row_from_order([6, 0, 1], 12),  # rank 0, the rest unscored
    ])
    t2i_orders = [[0, 1, 2, 3], [1, 0, 2, 3], [0, 3], [0, 2, 3, 1], [2, 0], [0, 1],  # t5: image 2 unscored
                  [0, 1, 3, 2], [3], [3, 2], [3, 0, 1, 2], [3, 1], [3, 0]]
    t2i = torch.tensor([_row_from_order(o, 4) for o in t2i_orders])
    return i2t, t2i


def test_metrics_match_hand_computed_ranks():
    i2t, t2i = _hand_scores()
    txt_rank, img_rank = retrieval_ranks(i2t, t2i, TXT2IMG)
    assert txt_rank.tolist() == [1, 6, 10, 0]
    assert img_rank.tolist() == [0, 1, 0, 3, 0, MISSED_RANK, 2, 0, 0, 0, 0, 0]  # t5 never scored
    m = itr_metrics(i2t, t2i, {t: i for t, i in enumerate(TXT2IMG)})
    assert m["txt_r1"] == pytest.approx(25.0)
    assert m["txt_r5"] == pytest.approx(50.0)
    assert m["txt_r10"] == pytest.approx(75.0)
    assert m["img_r1"] == pytest.approx(100 * 8 / 12)
    assert m["img_r5"] == pytest.approx(100 * 11 / 12)
    assert m["img_r10"] == pytest.approx(100 * 11 / 12)
    assert m["txt_r_mean"] == pytest.approx(50.0)
    assert m["img_r_mean"] == pytest.approx(100 * 30 / 36)
    assert m["r_mean"] == pytest.approx((50.0 + 100 * 30 / 36) / 2)


def test_metrics_agree_with_argsort_reference():
    g = torch.Generator().manual_seed(0)
    num_images, per_image = 30, 5
    txt2img = torch.arange(num_images).repeat_interleave(per_image)
    i2t = torch.randn(num_images, num_images * per_image, generator=g)
    t2i = torch.randn(num_images * per_image, num_images, generator=g)
    txt_rank, img_rank = retrieval_ranks(i2t, t2i, txt2img, chunk=7)
    for i in range(num_images):
        order = torch.argsort(i2t[i], descending=True).tolist()
        assert txt_rank[i] == min(order.index(t) for t in range(i * per_image, (i + 1) * per_image))
    for t in range(len(txt2img)):
        assert img_rank[t] == torch.argsort(t2i[t], descending=True).tolist().index(int(txt2img[t]))


def test_ties_are_broken_by_index_not_in_the_ground_truths_favour():
    # Image 1's caption (t1) ties with t0; image 0's caption t0 ties with t1.
    i2t = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    t2i = torch.tensor([[0.3, 0.3], [0.3, 0.3]])
    txt_rank, img_rank = retrieval_ranks(i2t, t2i, [0, 1])
    assert txt_rank.tolist() == [0, 1]
    assert img_rank.tolist() == [0, 1]


def test_metrics_reject_bad_input():
    i2t, t2i = _hand_scores()
    with pytest.raises(ValueError, match="txt2img"):
        itr_metrics(i2t, t2i, TXT2IMG[:-1])
    with pytest.raises(ValueError, match="without any ground-truth caption"):
        itr_metrics(i2t, t2i, [0] * 12)


def test_rerank_is_batched_and_split_exactly_across_ranks():
    g = torch.Generator().manual_seed(1)
    sim = torch.randn(11, 9, generator=g)
    topk = sim.topk(4, dim=1).indices
    table = torch.randn(11, 9, generator=g)
    calls = []

    def score_fn(anchors, cands):
        calls.append(tuple(anchors.tolist()))
        assert cands.shape == (len(anchors), 4)
        return table[anchors[:, None], cands]

    full = rerank_topk(topk, score_fn, anchors_per_forward=3)
    assert calls == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10)]  # several anchors per forward
    assert torch.equal(full, table.gather(1, topk))
    parts = [rerank_topk(topk, score_fn, anchors_per_forward=3, rank=r, world_size=3) for r in range(3)]
    assert torch.equal(sum(parts), full)


# ---------------------------------------------------------------------------------------------
# Model, loading and the script on a small synthetic split
# ---------------------------------------------------------------------------------------------

REPO = Path(__file__).parents[1]
TINY = str(REPO / "configs" / "tiny" / "Retrieval.yaml")


N_TEST = 16  # test images used: as many as val (the generator writes 5n/3 = 160 at n=96)


def _test_subset(root: str) -> str:
    return os.path.join(os.path.dirname(root), f"retrieval_test_{N_TEST}.json")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("retrieval") / "synthetic")
    ensure_synthetic(root, n=96, seed=1)  # 96 train images (~4 captions each), 16 val, 160 test
    with open(os.path.join(root, "retrieval_test.json"), encoding="utf-8") as f:
        test = json.load(f)
    with open(_test_subset(root), "w", encoding="utf-8") as f:
        json.dump(test[:N_TEST], f)
    return root


def overrides(root: str, **extra) -> list[str]:
    values = {"synthetic_root": "null", "image_root": root, "vocab_file": f"{root}/vocab.txt",
              "train_file": f"[{root}/retrieval_train.json]", "val_file": f"{root}/retrieval_val.json",
              "test_file": _test_subset(root), "queue_size": 128, "k_test": 8, "rerank_pairs": 32,
              "batch_size_train": 24, **extra}
    return ["--set", *(f"{k}={v}" for k, v in values.items())]


def retrieval_config(root: str) -> RetrievalConfig:
    """The typed config the script resolves from TINY and overrides(root) (data paths exist)."""
    return resolve_config("retrieval", TINY, overrides(root)[1:])


def test_parameter_names_and_momentum_init(data, tmp_path):
    config = retrieval_config(data)
    tokenizer = build_tokenizer(config)
    torch.manual_seed(0)
    model = ALBEF_Retrieval(config, tokenizer)
    keys = set(model.state_dict())
    for key in ("temp", "image_queue", "text_queue", "idx_queue", "queue_ptr", "itm_head.weight",
                "vision_proj_m.weight", "text_proj_m.bias", "visual_encoder_m.pos_embed",
                "text_encoder.bert.embeddings.word_embeddings.weight",
                "text_encoder_m.bert.encoder.layer.0.attention.self.query.weight"):
        assert key in keys, key
    assert not any(k.startswith("text_encoder.cls.") for k in keys)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.split(".")[0].endswith("_m"))

    # A "pre-training checkpoint": different weights, an MLM head, no momentum copies.
    torch.manual_seed(1)
    other = ALBEF_Retrieval(config, tokenizer)
    ckpt = {k: v for k, v in other.state_dict().items() if not k.split(".")[0].endswith("_m")}
    ckpt["text_encoder.cls.predictions.bias"] = torch.zeros(len(tokenizer))
    path = str(tmp_path / "pretrain.pth")
    torch.save({"model": ckpt}, path)
    initial = model.visual_encoder.pos_embed.detach().clone()
    for mode, expected in (("initial", initial), ("checkpoint", other.visual_encoder.pos_embed)):
        torch.manual_seed(0)
        loaded = build_model(dataclasses.replace(config, momentum_init=mode), tokenizer, path)
        assert torch.equal(loaded.visual_encoder.pos_embed, other.visual_encoder.pos_embed)
        assert torch.equal(loaded.visual_encoder_m.pos_embed, expected), mode


def test_training_step_uses_queue_and_image_id_positives(data):
    config = retrieval_config(data)
    tokenizer = build_tokenizer(config)
    torch.manual_seed(0)
    model = ALBEF_Retrieval(config, tokenizer)
    images = torch.randn(6, 3, 48, 48)
    text = tokenizer(["a red circle", "a red circle", "a blue square", "a green star", "a big dot", "x"],
                     padding="longest", return_tensors="pt")
    ids = torch.tensor([3, 3, 5, 7, 9, 11])
    out = WithObjectives(model)(images, text, ids)  # the forward and its objectives (models.losses)
    (out["loss_itc"] + out["loss_itm"]).backward()
    assert torch.isfinite(out["loss_itc"]) and torch.isfinite(out["loss_itm"])
    assert model.queue_ptr.item() == 6 and model.idx_queue[0, :6].tolist() == ids.tolist()
    assert model.temp.grad is not None and model.visual_encoder_m.pos_embed.grad is None
    # EMA: momentum weights moved toward the (unchanged) online weights, i.e. stayed equal here.
    assert torch.allclose(model.vision_proj_m.weight, model.vision_proj.weight)


def test_rerank_batching_does_not_change_scores(data):
    config = retrieval_config(data)
    tokenizer = build_tokenizer(config)
    _, val, _ = create_dataset("retrieval", config)
    torch.manual_seed(0)
    model = ALBEF_Retrieval(config, tokenizer)
    # Named ImageBatches (.image, .index, .valid), as Retrieval.py's evaluation loader yields them.
    loader = torch.utils.data.DataLoader(SkipBadSamples(val), batch_size=7,
                                         collate_fn=SkipBadCollate(ImageCollate()))
    one = compute_itr_scores(model, loader, val.text, tokenizer, torch.device("cpu"), 8, rerank_pairs=8)
    many = compute_itr_scores(model, loader, val.text, tokenizer, torch.device("cpu"), 8, rerank_pairs=40)
    assert one["itm_pairs"] == 8 * (len(val) + len(val.text))
    assert torch.equal(one["i2t_idx"], many["i2t_idx"]) and torch.equal(one["t2i_idx"], many["t2i_idx"])
    torch.testing.assert_close(one["i2t_score"], many["i2t_score"], rtol=0, atol=1e-5)
    torch.testing.assert_close(one["t2i_score"], many["t2i_score"], rtol=0, atol=1e-5)
    # One pair scored on its own agrees with its batched score.
    enc = encode_eval_set(model, loader, val.text, tokenizer, torch.device("cpu"))
    i, t = 3, int(one["i2t_idx"][3, 2])
    length = int(enc["text_mask"][t].sum())
    itm = model.itm_logits(enc["text_embeds"][t:t + 1, :length], enc["text_mask"][t:t + 1, :length],
                           enc["image_embeds"][i:i + 1])[0, 1]
    cosine = enc["image_feat"][i] @ enc["text_feat"][t]
    torch.testing.assert_close(one["i2t_score"][3, 2], itm + cosine, rtol=0, atol=1e-5)
    # The ITC-only ranking (Retrieval.py's itc_* metrics) scores the candidates by the cosine alone.
    sim = enc["image_feat"] @ enc["text_feat"].t()
    torch.testing.assert_close(one["i2t_itc"], sim.gather(1, one["i2t_idx"]), rtol=0, atol=1e-6)
    torch.testing.assert_close(one["t2i_itc"], sim.t().gather(1, one["t2i_idx"]), rtol=0, atol=1e-6)


# From random init the momentum copy is random too, and with momentum 0.995 it would lag hundreds
# of steps behind; momentum 0 makes it track the online model, so that a CPU-seconds fine-tune
# learns. lr 1e-4: higher rates collapse the tiny random-init ViT's CLS features.
FT_EPOCHS = 3  # bookkeeping only (see the test below), so a few epochs suffice
FT_SETTINGS = {"max_epoch": FT_EPOCHS, "schedular.epochs": FT_EPOCHS, "optimizer.lr": 1e-4,
               "schedular.lr": 1e-4, "schedular.min_lr": 1e-5, "momentum": 0.0, "queue_size": 16,
               "batch_size_train": 8}


@pytest.fixture(scope="module")
def finetuned(data, tmp_path_factory) -> tuple[str, list[dict]]:
    out = str(tmp_path_factory.mktemp("finetune"))
    args = ["--config", TINY, "--output_dir", out, "--device", "cpu", *overrides(data, **FT_SETTINGS)]
    zero = retrieval_main([*args, "--evaluate"])
    retrieval_main(args)
    with open(os.path.join(out, "log.txt"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert records[0] == json.loads(json.dumps(zero))
    return out, records


def test_finetuning_writes_outputs_and_keeps_the_best_epoch(finetuned):
    # That fine-tuning raises recall is checked from a tiny pre-trained checkpoint in the slow
    # tests/test_downstream.py (1,000 test images). From random init, as here, the ITC loss stays at
    # ln(batch + queue) and the old "+5 r_mean on 16 images" check passed on noise (format 3) or failed
    # on it (format 4); see docs/downstream.md.
    out, records = finetuned
    zero, epochs = records[0], records[1:]
    assert [r["epoch"] for r in epochs] == list(range(FT_EPOCHS))
    for key in ("test_txt_r1", "test_txt_r5", "test_txt_r10", "test_img_r1", "test_img_r_mean", "val_r_mean",
                "test_itc_txt_r1", "test_itc_img_r1", "val_itc_r_mean"):
        assert key in zero and key in epochs[-1]
    # The step's losses and the ITM objective's own metrics, as Pretrain logs them.
    for key in ("loss_itc", "loss_itm", "itm_accuracy", "itm_match_accuracy"):
        assert 0 <= epochs[-1][key], key
    assert epochs[-1]["itm_accuracy"] <= 1 and epochs[-1]["itm_match_accuracy"] <= 1
    best = max(epochs, key=lambda r: r["val_r_mean"])
    assert epochs[-1]["best_epoch"] == best["epoch"]
    state = torch.load(os.path.join(out, "checkpoint_best.pth"), weights_only=True)
    assert state["epoch"] == best["epoch"] and state["metrics"]["val_r_mean"] == best["val_r_mean"]
    last = torch.load(os.path.join(out, f"checkpoint_{FT_EPOCHS - 1:02d}.pth"), weights_only=True)
    assert {"model", "optimizer", "lr_scheduler", "scaler", "sampler", "config", "epoch", "step"} <= set(last)
    with open(os.path.join(out, "rankings_test.json"), encoding="utf-8") as f:
        rankings = json.load(f)
    first = rankings["image_to_text"][0]
    assert len(first["text_ids"]) == 8 and first["scores"] == sorted(first["scores"], reverse=True)
    # The last epoch's test recalls, recomputed from its rankings: a hit is a ground truth among the top k.
    for k in (1, 5):
        txt = [bool(set(r["text_ids"][:k]) & set(r["gt_text_ids"])) for r in rankings["image_to_text"]]
        img = [r["gt_image_id"] in r["image_ids"][:k] for r in rankings["text_to_image"]]
        assert epochs[-1][f"test_txt_r{k}"] == pytest.approx(100 * sum(txt) / len(txt)), k
        assert epochs[-1][f"test_img_r{k}"] == pytest.approx(100 * sum(img) / len(img)), k
    assert rankings["text_to_image"][0]["gt_image_id"] == 0


def _evaluate_on_rank(rank: int, world_size: int, port: int, argv: list[str]) -> None:
    """One rank of a gloo job, launched the way torchrun would (environment variables)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    retrieval_main(argv)


def _last_record(out: str) -> dict:
    with open(os.path.join(out, "log.txt"), encoding="utf-8") as f:
        record = json.loads(f.readlines()[-1])
    with open(os.path.join(out, "rankings_test.json"), encoding="utf-8") as f:
        record["rankings"] = json.load(f)
    record.pop("eval_seconds")
    return record


def test_one_and_two_processes_give_identical_results(finetuned, data, tmp_path):
    out, _ = finetuned
    common = ["--config", TINY, "--checkpoint", os.path.join(out, "checkpoint_best.pth"), "--evaluate",
              "--device", "cpu", *overrides(data, rerank_pairs=16)]
    retrieval_main([*common, "--output_dir", str(tmp_path / "one")])
    mp.spawn(_evaluate_on_rank, args=(2, free_port(), [*common, "--output_dir", str(tmp_path / "two")]),
             nprocs=2, join=True)
    assert _last_record(str(tmp_path / "one")) == _last_record(str(tmp_path / "two"))
