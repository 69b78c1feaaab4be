"""Bad samples in the models (dataset.bad_samples): placeholders of the task datasets, and `valid` in
ALBEF_Base, ALBEF_Retrieval, ALBEF_NLVR and ALBEF_VQA.

For every model: valid=None computes what the model computed before `valid` existed, valid all True
the same to float tolerance; a batch with invalid rows gives the losses of the batch without them;
invalid rows' inputs get no gradient; an all-invalid batch gives a finite 0 that still backpropagates.
Retrieval also: invalid momentum features never count as queue entries (valid_queue).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config, word_tokenizer
from PIL import Image
from transformers import BatchEncoding

import models.pretrain as pretrain_module
import models.retrieval as retrieval_module
from dataset.bad_samples import SkipBadCollate, SkipBadSamples
from dataset.collate import ImageTextCollate, QACollate
from dataset.nlvr import NLVRDataset
from dataset.pretrain import PLACEHOLDER_CAPTION
from dataset.retrieval import RetrievalTrainDataset
from dataset.transforms import test_transform as eval_transform  # not collected as a test
from dataset.vqa import VQADataset
from models.losses import WithObjectives
from models.mlm import mask_tokens
from models.momentum import FeatureQueue
from models.negatives import mine_negatives
from models.nlvr import ALBEF_NLVR, assign_texts, nlvr_loss
from models.objectives import itc_loss
from models.pretrain import ALBEF_Base
from models.retrieval import QUEUE_KEYS, ALBEF_Retrieval
from models.vqa import ALBEF_VQA

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REPO = Path(__file__).parents[1]
TINY_BERT = str(REPO / "configs" / "tiny" / "config_bert.json")
WORDS = ["a", "dog", "cat", "red", "blue", "ball", "on", "the", "grass", "left", "right", "of", "big",
         "small", "bad", "sample", "yes", "no"]
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("vocab"), WORDS)


# One small model shape for every task; each task's config takes the keys its model reads.
MODEL_KEYS = dict(bert_config=TINY_BERT, image_res=32, patch_size=8, vision_width=64, vision_depth=2,
                  vision_heads=4, vision_init=None, embed_dim=32, text_encoder=None, vision_stem="linear",
                  grad_checkpointing=False)
OBJECTIVE_KEYS = dict(temp=0.07, lambda_cons=0.2, itm_negatives="hard", hard_sampling="argmax", itm=True)
TASK_KEYS = {
    "pretrain": dict(OBJECTIVE_KEYS, mlm_probability=0.5, itc_gather=False, itc=True, mlm=True,
                     guard_false_negatives=False),
    "retrieval": dict(OBJECTIVE_KEYS, queue_size=32, momentum=0.995),
    "nlvr": dict(text_assignment=False, ta_head="linear"),
    "vqa": {},
}


def model_config(task: str, **overrides):
    """The typed config (tests/conftest.py tiny_config) of `task` with the small model's keys."""
    return tiny_config(task, **{**MODEL_KEYS, **TASK_KEYS[task], **overrides})


# Rows 2 and 5 are bad samples: placeholders (blank image, PLACEHOLDER_CAPTION) as SkipBadSamples makes.
VALID = torch.tensor([True, True, False, True, True, False, True, True])
KEEP = VALID.nonzero().squeeze(1)


def batch(tokenizer, n: int = 8, valid: torch.Tensor = VALID):
    """n image-caption pairs (distinct images and captions); invalid rows look like placeholders."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, 32, 32, generator=gen) * 0.5 + 2 * torch.randn(n, 3, 1, 1, generator=gen)
    captions = [" ".join(WORDS[j] for j in torch.randint(14, (int(k),), generator=gen))
                for k in torch.randint(3, 9, (n,), generator=gen)]
    for i in (~valid).nonzero().squeeze(1).tolist():
        images[i] = 0.0
        captions[i] = PLACEHOLDER_CAPTION
    return images, tokenizer(captions, padding="longest", return_tensors="pt")


def run(model, *args, **kwargs) -> dict[str, torch.Tensor]:
    """The model's forward and its objectives (models.losses.WithObjectives): outputs, losses, 'loss'."""
    return WithObjectives(model)(*args, **kwargs)


def rows(text: BatchEncoding, keep: torch.Tensor) -> BatchEncoding:
    """The tokenized batch restricted to rows `keep` (the same padded length)."""
    return BatchEncoding({k: v[keep] for k, v in text.items()})


def recorded(real, calls: list):
    """`real` that also appends each result to calls (for monkeypatching mine_negatives)."""
    def wrapper(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]
    return wrapper


def embedding_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Outputs of the online text encoder's embeddings in every call of a forward, with retained grads."""
    outputs: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        output.retain_grad()
        outputs.append(output)

    model.text_encoder.bert.embeddings.register_forward_hook(hook)
    return outputs


def assert_zero_rows(grad: torch.Tensor, valid: torch.Tensor, every_valid_row: bool = True) -> None:
    """Invalid rows of grad are exactly 0; valid rows are not (every one, or some)."""
    assert grad is not None
    assert torch.all(grad[~valid] == 0), "an invalid row got a gradient"
    nonzero = grad.flatten(1).abs().sum(1)[valid] > 0
    assert nonzero.all() if every_valid_row else nonzero.any()


# ----------------------------------------------------------------------------- placeholders


def _png(path: Path) -> str:
    Image.new("RGB", (40, 30), (200, 40, 40)).save(path)
    return path.name


def test_placeholders_have_the_shapes_of_real_items(tmp_path, tokenizer):
    good = _png(tmp_path / "good.png")
    transform = eval_transform(32)

    def write(name: str, entries: list[dict]) -> str:
        path = tmp_path / name
        path.write_text(json.dumps(entries))
        return str(path)

    retrieval = SkipBadSamples(RetrievalTrainDataset(write("r.json", [
        {"image": good, "caption": "a red dog", "image_id": "x"},
        {"image": "missing.png", "caption": "a cat", "image_id": "y"},
        {"image": good, "caption": "  ...  ", "image_id": "z"},  # empty after cleaning
    ]), transform, str(tmp_path)))
    items = [retrieval[i] for i in range(3)]
    assert [r is None for _, r in items] == [True, False, False]
    (real, _), (hole, _), (empty, _) = items
    assert hole[0].shape == real[0].shape and hole[1] == PLACEHOLDER_CAPTION and hole[2] == -2
    assert empty[2] == -3  # -1 - index: no real img_id (0..K-1), no other placeholder's
    collated = SkipBadCollate(ImageTextCollate(tokenizer, 40))(items)
    assert collated.image.shape == (3, 3, 32, 32) and collated.text.input_ids.shape[0] == 3
    assert collated.ids.tolist() == [0, -2, -3] and collated.valid.tolist() == [True, False, False]
    assert len(collated.reasons) == 2

    nlvr = SkipBadSamples(NLVRDataset(write("n.json", [
        {"images": [good, good], "sentence": "the dog", "label": True},
        {"images": [good, "missing.png"], "sentence": "the cat", "label": "False"},
    ]), transform, str(tmp_path)))
    (real, _), (hole, reason) = nlvr[0], nlvr[1]
    assert reason is not None and len(hole) == len(real) == 4
    assert hole[0].shape == hole[1].shape == real[0].shape and hole[2] == PLACEHOLDER_CAPTION
    assert isinstance(hole[3], int) and hole[3] in (0, 1)

    train = SkipBadSamples(VQADataset(write("v.json", [
        {"image": good, "question": "what colour?", "answer": ["red", "red", "pink"]},
        {"image": "missing.png", "question": "is it a dog?", "answer": "yes"},
    ]), transform, str(tmp_path)))
    (real, _), (hole, reason) = train[0], train[1]
    assert reason is not None and hole[0].shape == real[0].shape
    assert hole[2:] == ([PLACEHOLDER_CAPTION], [1.0])
    qa = SkipBadCollate(QACollate(tokenizer, 40))([train[0], train[1]])
    assert qa.counts.tolist() == [2, 1] and qa.answer.input_ids.shape[0] == qa.weights.shape[0] == 3
    assert qa.valid.tolist() == [True, False]

    answers_file = write("answers.json", ["red", "yes"])
    test = SkipBadSamples(VQADataset(write("t.json", [
        {"image": "missing.png", "question": "why?", "question_id": 17},
    ]), transform, str(tmp_path), split="test", answer_list=answers_file))
    hole, reason = test[0]
    assert reason is not None and hole[0].shape == (3, 32, 32) and hole[1:] == (PLACEHOLDER_CAPTION, 17)


# ----------------------------------------------------------------------------- ALBEF_Base (pre-training)


def base_model(tokenizer, **overrides) -> ALBEF_Base:
    torch.manual_seed(0)
    return ALBEF_Base(model_config("pretrain", **overrides), tokenizer)


def seeded(model, *args, **kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # the same MLM masks (and multinomial draws) in every call
    return run(model, *args, **kwargs)


# Image keys: pairs 0 and 3 share an image (two captions); the placeholders keep their entries' keys.
KEYS = torch.tensor([10, 11, 12, 10, 14, 15, 16, 17])


def test_base_valid_none_equals_all_true(tokenizer):
    model = base_model(tokenizer, guard_false_negatives=True)
    images, text = batch(tokenizer)
    ref = seeded(model, images, text, image_key=KEYS)
    out = seeded(model, images, text, image_key=KEYS, valid=torch.ones(8, dtype=torch.bool))
    for name in ("loss_itc", "loss_cons", "loss_itm", "loss_mlm", "hardness"):
        torch.testing.assert_close(out[name], ref[name], **TOL)


@pytest.mark.parametrize("guard", [False, True])
def test_base_losses_equal_the_batch_without_invalid_rows(tokenizer, monkeypatch, guard):
    model = base_model(tokenizer, guard_false_negatives=guard)
    images, text = batch(tokenizer)
    # One fixed MLM mask: the full batch's rows, and the same rows for the reduced batch.
    masked_ids, labels = mask_tokens(text["input_ids"], model.vocab_size, model.mask_token_id,
                                     model.special_ids, 0.5, torch.Generator().manual_seed(3))
    fixed = {8: (masked_ids, labels), len(KEEP): (masked_ids[KEEP], labels[KEEP])}
    monkeypatch.setattr(pretrain_module, "mask_tokens", lambda ids, *a, **k: fixed[ids.shape[0]])
    full = run(model, images, text, image_key=KEYS, valid=VALID)
    reduced = run(model, images[KEEP], rows(text, KEEP), image_key=KEYS[KEEP])
    for name in ("loss_itc", "loss_cons", "loss_itm", "loss_mlm", "hardness"):
        torch.testing.assert_close(full[name], reduced[name], **TOL, msg=name)
    assert full["loss_cons"] > 0 and full["loss_mlm"] > 0


@pytest.mark.parametrize("negatives,sampling", [("hard", "argmax"), ("hard", "multinomial"),
                                                ("random", "argmax")])
def test_base_itm_never_mines_an_invalid_item(tokenizer, monkeypatch, negatives, sampling):
    model = base_model(tokenizer, itm_negatives=negatives, hard_sampling=sampling,
                       guard_false_negatives=True)
    mined: list = []
    monkeypatch.setattr(pretrain_module, "mine_negatives", recorded(pretrain_module.mine_negatives, mined))
    images, text = batch(tokenizer)
    for seed in range(5):
        torch.manual_seed(seed)
        model(images, text, image_key=KEYS, valid=VALID)
    for neg_text, neg_image in mined:
        assert VALID[neg_text[VALID]].all() and VALID[neg_image[VALID]].all()


@pytest.mark.parametrize("share_image_kv", [True, False])
def test_base_invalid_rows_get_no_gradient_and_all_invalid_is_zero(tokenizer, share_image_kv):
    model = base_model(tokenizer, guard_false_negatives=True, share_image_kv=share_image_kv)
    images, text = batch(tokenizer)
    images.requires_grad_(True)
    embedded = embedding_grads(model)
    out = seeded(model, images, text, image_key=KEYS, valid=VALID)
    sum(out[k] for k in ("loss_itc", "loss_cons", "loss_itm", "loss_mlm")).backward()
    assert_zero_rows(images.grad, VALID)
    # The plain and the masked captions: one text pass of 2B rows (share_image_kv), or ALBEF's two passes.
    assert [len(e) for e in embedded] == ([16] if share_image_kv else [8, 8])
    for e in embedded:
        assert_zero_rows(e.grad, VALID.repeat(len(e) // 8))

    model.zero_grad()
    none = torch.zeros(8, dtype=torch.bool)
    out = seeded(model, images.detach(), text, image_key=KEYS, valid=none)
    loss = sum(out[k] for k in ("loss_itc", "loss_cons", "loss_itm", "loss_mlm"))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------- ALBEF_Retrieval


def retrieval_model(tokenizer, **overrides) -> ALBEF_Retrieval:
    torch.manual_seed(0)
    return ALBEF_Retrieval(model_config("retrieval", **overrides), tokenizer)


# Image ids: pairs 0 and 3 show one image; placeholders carry -1 - index (RetrievalTrainDataset).
IDS = torch.tensor([10, 11, -3, 10, 14, -6, 16, 17])


def old_forward(model: ALBEF_Retrieval, image, text, idx) -> dict[str, torch.Tensor]:
    """ALBEF_Retrieval.forward as it was before `valid` existed, rebuilt from the model's parts."""
    with torch.no_grad():
        model.temp.clamp_(0.001, 0.5)
    batch_size = text.input_ids.shape[0]
    image_embeds = model.encode_image(image)
    text_embeds = model.encode_text(text.input_ids, text.attention_mask)
    image_feat, text_feat = model.image_feat(image_embeds), model.text_feat(text_embeds)
    with torch.no_grad():
        model.momentum_pairs.update(model.momentum)
        image_feat_m = F.normalize(model.vision_proj_m(model.visual_encoder_m.forward_features(image)[:, 0]),
                                   dim=-1)
        text_hidden_m = model.text_encoder_m(text.input_ids, text.attention_mask, mode="text")
        text_feat_m = F.normalize(model.text_proj_m(text_hidden_m[:, 0]), dim=-1)
        image_bank, text_bank, positive = model.bank(image_feat_m, text_feat_m, idx)
    itc = itc_loss(image_feat, text_feat, model.temp, model.lambda_cons, positive=positive,
                   image_bank=image_bank, text_bank=text_bank)
    FeatureQueue.enqueue(model, image_feat_m, text_feat_m, idx)
    loss_itm = old_itm_loss(model, image_embeds, text_embeds, text.attention_mask, itc,
                            positive[:, :batch_size])
    return {"loss_itc": itc["loss_itc"], "loss_cons": itc["loss_cons"], "loss_itm": loss_itm}


def old_itm_loss(model: ALBEF_Retrieval, image_embeds, text_embeds, attention_mask, itc, in_batch):
    """ALBEF_Retrieval's ITM loss as it was before `valid` existed: negatives mined from the in-batch block
    of itc's similarities (every caption of the same image a positive), one fusion pass over [positives,
    (image, negative text), (negative image, text)], the plain cross-entropy mean over the 3B pairs."""
    batch_size = text_embeds.shape[0]
    with torch.no_grad():
        neg_text_idx, neg_image_idx = mine_negatives(
            itc["sim_i2t"][:, :batch_size].detach(), itc["sim_t2i"][:, :batch_size].detach(),
            positive=in_batch, mode=model.itm_negatives, sampling=model.hard_sampling)
    hidden, mask, image_index = model.itm_pairs(text_embeds, attention_mask, neg_text_idx, neg_image_idx)
    logits = model.itm_logits(hidden, mask, image_embeds, image_index)
    labels = torch.zeros(3 * batch_size, dtype=torch.long)
    labels[:batch_size] = 1
    return F.cross_entropy(logits, labels)


def total(out: dict) -> torch.Tensor:
    return out["loss_itc"] + out["loss_cons"] + out["loss_itm"]


def test_retrieval_valid_none_is_the_old_computation_bit_for_bit(tokenizer):
    ref_model = retrieval_model(tokenizer, momentum=0.5)
    model = copy.deepcopy(ref_model)
    images, text = batch(tokenizer, valid=torch.ones(8, dtype=torch.bool))
    ids = torch.tensor([10, 11, 12, 10, 14, 15, 16, 17])
    for step in range(3):  # the queue fills with real entries, and the momentum model moves
        seed = torch.Generator().manual_seed(step)
        step_images = images + 0.1 * torch.randn(images.shape, generator=seed)
        ref_model.zero_grad()
        model.zero_grad()
        torch.manual_seed(step)
        ref = old_forward(ref_model, step_images, text, ids)
        total(ref).backward()
        torch.manual_seed(step)
        out = run(model, step_images, text, ids)
        total(out).backward()
        for name in ("loss_itc", "loss_cons", "loss_itm"):
            assert torch.equal(out[name], ref[name]), (step, name)
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), name
        with torch.no_grad():  # a training step, so that the next one sees other weights
            for p, q in zip(model.parameters(), ref_model.parameters()):
                if p.grad is not None:
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
        model.clamp_temperature()  # after every optimiser step (training.optimizer.clamp_after_steps)
    for key in ("image_queue", "text_queue", "idx_queue", "queue_ptr"):
        assert torch.equal(getattr(model, key), getattr(ref_model, key)), key
    assert model.valid_queue.all()

    # valid all True: the masked computation, equal to float tolerance.
    again = copy.deepcopy(model)
    torch.manual_seed(5)
    out = run(model, images, text, ids)
    torch.manual_seed(5)
    masked = run(again, images, text, ids, valid=torch.ones(8, dtype=torch.bool))
    for name in ("loss_itc", "loss_cons", "loss_itm"):
        torch.testing.assert_close(masked[name], out[name], **TOL, msg=name)


def test_retrieval_losses_equal_the_batch_without_invalid_rows(tokenizer):
    full_model = retrieval_model(tokenizer)
    reduced_model = copy.deepcopy(full_model)  # the same weights and the same (initial) queue
    images, text = batch(tokenizer)
    full = run(full_model, images, text, IDS, valid=VALID)
    reduced = run(reduced_model, images[KEEP], rows(text, KEEP), IDS[KEEP])
    for name in ("loss_itc", "loss_cons", "loss_itm"):  # hard argmax mining: the same negatives
        torch.testing.assert_close(full[name], reduced[name], **TOL, msg=name)
    assert full["loss_cons"] > 0


@pytest.mark.parametrize("negatives,sampling", [("hard", "argmax"), ("hard", "multinomial"),
                                                ("random", "argmax")])
def test_retrieval_itm_never_mines_an_invalid_item(tokenizer, monkeypatch, negatives, sampling):
    model = retrieval_model(tokenizer, itm_negatives=negatives, hard_sampling=sampling)
    mined: list = []
    monkeypatch.setattr(retrieval_module, "mine_negatives", recorded(retrieval_module.mine_negatives, mined))
    images, text = batch(tokenizer)
    for seed in range(5):
        torch.manual_seed(seed)
        model(images, text, IDS, valid=VALID)
    assert len(mined) == 5
    for neg_text, neg_image in mined:
        assert VALID[neg_text[VALID]].all() and VALID[neg_image[VALID]].all()


def test_retrieval_invalid_rows_get_no_gradient_and_all_invalid_is_zero(tokenizer):
    model = retrieval_model(tokenizer)
    images, text = batch(tokenizer)
    images.requires_grad_(True)
    embedded = embedding_grads(model)
    total(run(model, images, text, IDS, valid=VALID)).backward()
    assert_zero_rows(images.grad, VALID)
    assert len(embedded) == 1
    assert_zero_rows(embedded[0].grad, VALID)

    model.zero_grad()
    none = torch.zeros(8, dtype=torch.bool)
    out = run(model, images.detach(), text, -1 - torch.arange(8), valid=none)
    loss = total(out)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_retrieval_queue_never_counts_invalid_momentum_features(tokenizer):
    model = retrieval_model(tokenizer, momentum=1.0, queue_size=12)  # momentum 1: fixed momentum model
    images, text = batch(tokenizer)
    model(images, text, IDS, valid=VALID)
    assert model.queue_ptr.item() == 8
    assert model.valid_queue[0].tolist() == VALID.tolist() + [True] * 4  # initial columns stay valid
    assert model.idx_queue[0, :8].tolist() == IDS.tolist()

    # The next, all-good batch (valid=None): its ITC equals one against the queue without the invalid
    # columns, computed here by dropping them.
    good_images, good_text = batch(tokenizer, valid=torch.ones(8, dtype=torch.bool))
    good_images = good_images.flip(0)
    good_ids = torch.arange(20, 28)
    before = copy.deepcopy(model)
    out = run(model, good_images, good_text, good_ids)
    with torch.no_grad():
        image_embeds = before.encode_image(good_images)
        text_embeds = before.encode_text(good_text.input_ids, good_text.attention_mask)
        image_feat, text_feat = before.image_feat(image_embeds), before.text_feat(text_embeds)
        image_cls_m = before.visual_encoder_m.forward_features(good_images)[:, 0]
        image_m = F.normalize(before.vision_proj_m(image_cls_m), dim=-1)
        text_m = F.normalize(before.text_proj_m(
            before.text_encoder_m(good_text.input_ids, good_text.attention_mask, mode="text")[:, 0]), dim=-1)
        kept = before.valid_queue[0]
        image_bank = torch.cat([image_m, before.image_queue.t()[kept]])
        text_bank = torch.cat([text_m, before.text_queue.t()[kept]])
        positive = good_ids[:, None] == torch.cat([good_ids, before.idx_queue[0, kept]])[None, :]
        expected = itc_loss(image_feat, text_feat, before.temp, before.lambda_cons, positive=positive,
                            image_bank=image_bank, text_bank=text_bank)
        counted = itc_loss(image_feat, text_feat, before.temp, before.lambda_cons,
                           positive=good_ids[:, None] == torch.cat([good_ids, before.idx_queue[0]])[None, :],
                           image_bank=torch.cat([image_m, before.image_queue.t()]),
                           text_bank=torch.cat([text_m, before.text_queue.t()]))
    for name in ("loss_itc", "loss_cons"):
        torch.testing.assert_close(out[name], expected[name], **TOL, msg=name)
    assert not torch.allclose(out["loss_itc"], counted["loss_itc"], **TOL)  # the check is not vacuous
    # The queue wrapped (ptr 8 + 8 > 12): the good batch overwrote columns 8..11 and 0..3.
    assert model.queue_ptr.item() == 4
    assert model.valid_queue[0].tolist() == [True] * 4 + VALID[4:].tolist() + [True] * 4

    # Once the invalid columns are overwritten, valid=None is the plain computation again.
    model(good_images, good_text, good_ids)
    assert model.valid_queue.all()


def test_retrieval_valid_queue_in_checkpoints(tokenizer):
    model = retrieval_model(tokenizer)
    images, text = batch(tokenizer)
    model(images, text, IDS, valid=VALID)
    state = model.state_dict()
    assert "valid_queue" in state and "valid_queue" in QUEUE_KEYS
    restored = retrieval_model(tokenizer)
    restored.load_state_dict(state)
    assert torch.equal(restored.valid_queue, model.valid_queue)

    # A checkpoint from before valid_queue: loads strictly, every queued column valid.
    old = {k: v for k, v in state.items() if k != "valid_queue"}
    assert not model.valid_queue.all()
    model.load_state_dict(old)
    assert model.valid_queue.all() and torch.equal(model.idx_queue, state["idx_queue"])
    # A partial state dict without queues (e.g. pre-training weights) leaves the queue alone.
    model.load_state_dict(state)
    model.load_state_dict({"temp": state["temp"]}, strict=False)
    assert torch.equal(model.valid_queue, state["valid_queue"])


# ----------------------------------------------------------------------------- ALBEF_NLVR


def nlvr_model(tokenizer, text_assignment: bool = False) -> ALBEF_NLVR:
    torch.manual_seed(0)
    return ALBEF_NLVR(model_config("nlvr", text_assignment=text_assignment), tokenizer)


def test_nlvr_classification_loss(tokenizer):
    model = nlvr_model(tokenizer)
    images, text = batch(tokenizer)
    image1 = images.flip(0).contiguous()
    labels = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    logits = model.classify(images, image1, text["input_ids"], text["attention_mask"])
    assert torch.equal(nlvr_loss(logits, labels), F.cross_entropy(logits, labels))
    torch.testing.assert_close(nlvr_loss(logits, labels, torch.ones(8, dtype=torch.bool)),
                               F.cross_entropy(logits, labels), **TOL)

    images.requires_grad_(True)
    image1.requires_grad_(True)
    embedded = embedding_grads(model)
    logits = model(images, image1, text["input_ids"], text["attention_mask"])
    loss = nlvr_loss(logits, labels, VALID)
    reduced = model.classify(images[KEEP], image1[KEEP], text["input_ids"][KEEP],
                             text["attention_mask"][KEEP])
    torch.testing.assert_close(loss, F.cross_entropy(reduced, labels[KEEP]), **TOL)
    loss.backward()
    assert_zero_rows(images.grad, VALID)
    assert_zero_rows(image1.grad, VALID)
    assert_zero_rows(embedded[0].grad, VALID)

    logits = model.classify(images.detach(), image1.detach(), text["input_ids"], text["attention_mask"])
    everything_bad = nlvr_loss(logits, labels, torch.zeros(8, dtype=torch.bool))
    assert everything_bad.item() == 0.0 and everything_bad.requires_grad
    everything_bad.backward()


def test_nlvr_text_assignment_loss(tokenizer):
    model = nlvr_model(tokenizer, text_assignment=True)
    # Invalid rows at the end: the labels drawn for the first rows are those of the reduced batch.
    valid = torch.tensor([True, True, True, True, True, False, True, False])
    order = torch.cat([valid.nonzero().squeeze(1), (~valid).nonzero().squeeze(1)])
    images, text = batch(tokenizer, valid=valid)
    images, text = images[order], rows(text, order)
    valid = valid[order]
    keep = valid.nonzero().squeeze(1)
    image_ids = torch.tensor([0, 1, 2, 0, 4, 5, 6, 7])

    def run(*args, **kwargs):
        return model(*args, generator=torch.Generator().manual_seed(4), **kwargs)

    loss, logits, labels = run(images, text["input_ids"], text["attention_mask"], image_ids=image_ids)
    assert torch.equal(loss, F.cross_entropy(logits, labels))
    all_true, _, _ = run(images, text["input_ids"], text["attention_mask"], image_ids=image_ids,
                         valid=torch.ones(8, dtype=torch.bool))
    torch.testing.assert_close(all_true, loss, **TOL)

    images.requires_grad_(True)
    embedded = embedding_grads(model)
    loss, _, _ = run(images, text["input_ids"], text["attention_mask"], image_ids=image_ids, valid=valid)
    reduced, _, _ = run(images[keep], text["input_ids"][keep], text["attention_mask"][keep],
                        image_ids=image_ids[keep])
    torch.testing.assert_close(loss, reduced, **TOL)
    loss.backward()
    # A valid image may serve no pair (its own text drew "neither" and no other text picked it).
    assert_zero_rows(images.grad, valid, every_valid_row=False)
    assert_zero_rows(embedded[0].grad, valid)

    loss, _, _ = run(images.detach(), text["input_ids"], text["attention_mask"], image_ids=image_ids,
                     valid=torch.zeros(8, dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()


def test_assign_texts_never_pairs_a_valid_text_with_a_bad_image():
    feat = F.normalize(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)), dim=-1)
    feat[2] = feat[0]  # the bad images are the most similar ones: without valid they would be picked
    feat[5] = feat[1]
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        first, second, _ = assign_texts(feat, generator=generator, valid=VALID)
        assert VALID[first[VALID]].all() and VALID[second[VALID]].all()
    first, second, _ = assign_texts(feat, generator=torch.Generator().manual_seed(1))
    assert not (VALID[first[VALID]].all() and VALID[second[VALID]].all())


# ----------------------------------------------------------------------------- ALBEF_VQA


def vqa_batch(tokenizer):
    images, question = batch(tokenizer)
    # Answers grouped by question (QACollate); the placeholders (rows 2, 5) have one of weight 1.
    per_question = [["red", "blue"], ["yes"], [PLACEHOLDER_CAPTION], ["no", "yes", "dog"], ["cat"],
                    [PLACEHOLDER_CAPTION], ["ball", "grass"], ["small"]]
    weights = [[0.6, 0.4], [1.0], [1.0], [0.5, 0.3, 0.2], [1.0], [1.0], [0.7, 0.3], [1.0]]
    answer = tokenizer([a for q in per_question for a in q], padding="longest", return_tensors="pt")
    counts = torch.tensor([len(q) for q in per_question])
    return images, question, answer, torch.tensor([w for q in weights for w in q]), counts


def test_vqa_loss(tokenizer):
    torch.manual_seed(0)
    model = ALBEF_VQA(model_config("vqa"), tokenizer)
    images, question, answer, weights, counts = vqa_batch(tokenizer)
    args = (question["input_ids"], question["attention_mask"], answer["input_ids"], answer["attention_mask"],
            weights, counts)
    loss = model(images, *args)
    with torch.no_grad():  # the loss as it was: weighted answer NLLs summed, over the batch size
        states = model.encode_question(images, question["input_ids"], question["attention_mask"])
        owner = torch.arange(8).repeat_interleave(counts)
        nll = model.answer_nll(states[owner], question["attention_mask"][owner], answer["input_ids"],
                               answer["attention_mask"])
    assert torch.equal(loss, (weights * nll).sum() / 8)
    torch.testing.assert_close(model(images, *args, valid=torch.ones(8, dtype=torch.bool)), loss, **TOL)

    answer_keep = VALID.repeat_interleave(counts)
    images.requires_grad_(True)
    embedded = embedding_grads(model)
    loss = model(images, *args, valid=VALID)
    reduced = model(images[KEEP], question["input_ids"][KEEP], question["attention_mask"][KEEP],
                    answer["input_ids"][answer_keep], answer["attention_mask"][answer_keep],
                    weights[answer_keep], counts[KEEP])
    torch.testing.assert_close(loss, reduced, **TOL)
    loss.backward()
    assert_zero_rows(images.grad, VALID)
    assert_zero_rows(embedded[0].grad, VALID)

    loss = model(images.detach(), *args, valid=torch.zeros(8, dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
