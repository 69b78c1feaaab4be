"""SigLIP's sigmoid loss (models.losses.sigmoid) as an objective composed from the config: its value against
the paper's O(B^2) sum written out pair by pair, the guard's positives and bad samples, the same loss and
gradient on one process and on two for the same global batch, its temperature and bias learnt and kept in
the checkpoint, and the settings that cannot act with it refused."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import HANG_GUARD_S, tiny_config, word_tokenizer

from models.losses import WithObjectives
from models.losses.sigmoid import SigmoidITC, sigmoid_loss
from models.pretrain import ALBEF_Base
from training.config_resolve import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _feats(n: int, d: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    text = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    return image, text


def _reference(image, text, t, b, positive=None, valid=None) -> float:
    """The paper's loss, pair by pair: -1/|B| sum_i sum_j log sigmoid(z_ij (exp(t) x_i.y_j + b))."""
    n = image.shape[0]
    rows = [i for i in range(n) if valid is None or valid[i]]
    total = 0.0
    for i in rows:
        for j in range(n):
            if valid is not None and not valid[j]:
                continue
            match = (i == j) if positive is None else bool(positive[i, j])
            z = 1.0 if match else -1.0
            logit = math.exp(t) * float(image[i] @ text[j]) + b
            total += -math.log(1 / (1 + math.exp(-z * logit)))
    return total / len(rows)


@pytest.mark.parametrize("scale, bias", [(math.log(10.0), -10.0), (1.3, 0.7)])
def test_the_loss_equals_the_papers_sum(scale, bias):
    image, text = _feats(5)
    got = sigmoid_loss(image, text, torch.tensor(scale), torch.tensor(bias))
    assert got.item() == pytest.approx(_reference(image, text, scale, bias), rel=1e-6)


def test_the_logits_stay_fp32_under_autocast():
    image, text = (x.float() for x in _feats(6, seed=2))
    scale, bias = torch.tensor(math.log(100.0)), torch.tensor(-10.0)  # a learnt scale: bf16 would round
    plain = sigmoid_loss(image, text, scale, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = sigmoid_loss(image, text, scale, bias)
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, plain, rtol=0, atol=0)


def test_positives_are_matches_and_bad_samples_leave_rows_and_columns():
    image, text = _feats(6, seed=1)
    positive = torch.eye(6, dtype=torch.bool)
    positive[0, 3] = positive[3, 0] = True  # one image, two captions
    valid = torch.tensor([True, True, False, True, True, True])
    t, b = torch.tensor(0.9), torch.tensor(-1.5)
    got = sigmoid_loss(image, text, t, b, positive=positive, valid=valid)
    assert got.item() == pytest.approx(_reference(image, text, 0.9, -1.5, positive, valid), rel=1e-6)
    plain = sigmoid_loss(image, text, t, b)
    assert not torch.allclose(got, plain)  # the masks act


def test_the_objective_learns_its_temperature_and_bias_and_keeps_them_in_the_checkpoint(tmp_path):
    tokenizer = word_tokenizer(tmp_path, ["a", "dog", "cat", "red", "blue"])
    config = tiny_config("pretrain", image_res=32, vision_depth=2, vision_init=None, text_encoder=None,
                         contrastive_loss="sigmoid", lambda_cons=0.0)
    torch.manual_seed(0)
    model = ALBEF_Base(config, tokenizer).double().train()
    assert isinstance(model.objectives["sigmoid"], SigmoidITC) and "itc" not in model.objectives
    assert not model.uses_every_parameter  # the softmax temperature is not trained: DDP must know
    state = model.state_dict()
    assert state["objectives.sigmoid.log_scale"].item() == pytest.approx(math.log(10.0))
    assert state["objectives.sigmoid.bias"].item() == -10.0
    ids = tokenizer(["a red dog", "a blue cat", "a dog", "a cat"], padding=True, return_tensors="pt")
    image = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    text = {"input_ids": ids.input_ids, "attention_mask": ids.attention_mask}
    out = WithObjectives(model)(image, text, image_key=torch.arange(4))
    want = sigmoid_loss(out["image_feat"], out["text_feat"], model.objectives["sigmoid"].log_scale,
                        model.objectives["sigmoid"].bias)
    assert torch.equal(out["loss_itc"], want) and out["loss_cons"].item() == 0.0
    out["loss"].backward()
    sigmoid = model.objectives["sigmoid"]
    assert sigmoid.log_scale.grad is not None and sigmoid.bias.grad != 0
    assert model.temp.grad is None
    model.objectives["sigmoid"].bias.data.fill_(-3.0)
    torch.save({"model": model.state_dict()}, tmp_path / "checkpoint.pth")
    fresh = ALBEF_Base(config, tokenizer).double()
    fresh.load_state_dict(torch.load(tmp_path / "checkpoint.pth")["model"])
    assert fresh.objectives["sigmoid"].bias.item() == -3.0


def test_settings_the_sigmoid_loss_cannot_use_are_refused():
    with pytest.raises(ConfigError, match="lambda_cons is 0.2 but contrastive_loss is sigmoid"):
        tiny_config("pretrain", contrastive_loss="sigmoid", lambda_cons=0.2)
    with pytest.raises(ConfigError, match="itc_hn_beta is 0.5 but contrastive_loss is sigmoid"):
        tiny_config("pretrain", contrastive_loss="sigmoid", lambda_cons=0.0, itc_hn_beta=0.5)
    with pytest.raises(ConfigError, match="contrastive_loss"):
        tiny_config("pretrain", contrastive_loss="hinge")


def _two_rank_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=HANG_GUARD_S))
    try:
        torch.set_num_threads(1)
        image, text = _feats(8, seed=3)
        local = slice(rank * 4, (rank + 1) * 4)
        image, text = image[local].clone().requires_grad_(), text[local].clone().requires_grad_()
        t = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
        valid = torch.tensor([True, True, True, True, True, False, True, True])[local]
        for name, kwargs in (("plain", {}), ("valid", {"valid": valid})):
            loss = sigmoid_loss(image, text, t, b, gather=True, **kwargs)
            image.grad = text.grad = t.grad = b.grad = None
            loss.backward()
            grads = [image.grad, text.grad, t.grad.view(1), b.grad.view(1)]
            # DDP's mean over ranks: of the losses and of the parameter gradients (t, b); the features'
            # gradients are each rank's own rows, to be laid side by side.
            summed = [loss.detach().view(1) / world, t.grad.view(1) / world, b.grad.view(1) / world]
            for x in summed:
                dist.all_reduce(x)
            rows = ([torch.empty_like(grads[0]) for _ in range(world)],
                    [torch.empty_like(grads[1]) for _ in range(world)])
            dist.all_gather(rows[0], grads[0].contiguous())
            dist.all_gather(rows[1], grads[1].contiguous())
            if rank == 0:
                torch.save({"loss": summed[0], "t": summed[1], "b": summed[2],
                            "image": torch.cat(rows[0]) / world, "text": torch.cat(rows[1]) / world},
                           f"{out_dir}/{name}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_global_batchs_loss_and_gradient(tmp_path):
    mp.spawn(_two_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    image, text = _feats(8, seed=3)
    valid = torch.tensor([True, True, True, True, True, False, True, True])
    for name, kwargs in (("plain", {}), ("valid", {"valid": valid})):
        image_, text_ = image.clone().requires_grad_(), text.clone().requires_grad_()
        t = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
        loss = sigmoid_loss(image_, text_, t, b, **kwargs)
        loss.backward()
        got = torch.load(tmp_path / f"{name}.pt")
        # DDP's mean over ranks: each rank's rows get the gradient of the global loss, W times over.
        torch.testing.assert_close(got["loss"], loss.detach().view(1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["t"], t.grad.view(1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["b"], b.grad.view(1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["image"], image_.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["text"], text_.grad, rtol=1e-12, atol=1e-12)
