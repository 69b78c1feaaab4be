"""Config key grad_checkpointing: the ViT (timm) and BERT layers recompute their activations in backward.

For every task model: a training step with the switch gives exactly the losses and gradients of one
without it (dropout, drop_path, MLM masking and ITM sampling draw the same numbers), each online layer
runs twice (forward + recompute), the momentum copies once; in eval mode or under no_grad nothing is
checkpointed. Pretrain.py runs with --set grad_checkpointing=true.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from conftest import ROOT, TINY_CONFIGS, run_here, small_pretrain_sets, tiny_config, word_tokenizer
from timm.models.vision_transformer import Block
from torch import Tensor, nn
from transformers import BertTokenizerFast

import models.bert
from models.bert_layers import BertLayer
from models.losses import WithObjectives
from models.nlvr import ALBEF_NLVR, nlvr_loss
from models.pretrain import ALBEF_Base
from models.retrieval import ALBEF_Retrieval
from models.vqa import ALBEF_VQA
from training.config_files import load_config, to_plain
from training.config_resolve import config_from_mapping

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REPO = Path(__file__).parents[1]
WORDS = ["a", "dog", "cat", "red", "blue", "ball", "on", "the", "grass", "left", "right", "yes", "no"]
N = 6


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> BertTokenizerFast:
    return word_tokenizer(tmp_path_factory.mktemp("vocab"), WORDS)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> dict[str, dict]:
    """Per task: keys laid over configs/tiny/<Task>.yaml for a 32 px model with dropout and drop_path on
    (the RNG must be replayed); build() adds grad_checkpointing."""
    bert = json.loads((REPO / "configs" / "tiny" / "config_bert.json").read_text())
    bert.update(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    bert_path = tmp_path_factory.mktemp("bert") / "config_bert.json"
    bert_path.write_text(json.dumps(bert))
    values = dict(bert_config=str(bert_path), image_res=32, vision_drop_path=0.1,
                  vision_init=None)  # exactness of checkpointing, not the warm start
    return {task: {**values, **({"queue_size": 16, "momentum": 0.9} if task == "retrieval" else {})}
            for task in CASES}


def text(tokenizer: BertTokenizerFast, seed: int, n: int = N):
    """n random captions (3-8 words), tokenized and padded."""
    gen = torch.Generator().manual_seed(seed)
    captions = [" ".join(WORDS[j] for j in torch.randint(len(WORDS), (int(k),), generator=gen))
                for k in torch.randint(3, 9, (n,), generator=gen)]
    return tokenizer(captions, padding="longest", return_tensors="pt")


def images(seed: int, n: int = N) -> Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def total(out: dict[str, Tensor]) -> Tensor:
    """The sum of a model output's loss_* entries (WithObjectives' 'loss' is their sum: not counted twice)."""
    return sum(v for k, v in out.items() if k.startswith("loss_"))


def base_case(config: Any, tokenizer) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    model = ALBEF_Base(config, tokenizer)
    image, caption = images(0), text(tokenizer, 0)
    keys = torch.arange(N)  # the tiny config guards false negatives
    # The forward and its objectives (models.losses), as Pretrain.py's step.
    return model, lambda m: total(WithObjectives(m)(image, caption, image_key=keys))


def retrieval_case(config: Any, tokenizer) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    model = ALBEF_Retrieval(config, tokenizer)
    image, caption, idx = images(1), text(tokenizer, 1), torch.tensor([0, 1, 2, 0, 3, 4])
    return model, lambda m: total(WithObjectives(m)(image, caption, idx))


def nlvr_case(config: Any, tokenizer) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    model = ALBEF_NLVR(config, tokenizer)
    image0, image1, sentence = images(2), images(3), text(tokenizer, 2)
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    return model, lambda m: nlvr_loss(m(image0, image1, sentence.input_ids, sentence.attention_mask), labels)


def vqa_case(config: Any, tokenizer) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    model = ALBEF_VQA(config, tokenizer)
    image, question = images(4), text(tokenizer, 4)
    counts = torch.tensor([2, 1, 1, 3, 1, 1])
    answer = text(tokenizer, 5, n=int(counts.sum()))
    weights = torch.full((int(counts.sum()),), 0.5)
    return model, lambda m: m(image, question.input_ids, question.attention_mask, answer.input_ids,
                              answer.attention_mask, weights, counts)


CASES = {"pretrain": base_case, "retrieval": retrieval_case, "nlvr": nlvr_case, "vqa": vqa_case}


def build(case: str, config: dict[str, dict], tokenizer, on: bool
          ) -> tuple[nn.Module, Callable[[nn.Module], Tensor]]:
    """The case's model (its task's typed tiny config) from seed 0 (the same weights either way) with
    grad_checkpointing `on`."""
    typed = tiny_config(case, **config[case], grad_checkpointing=on)
    torch.manual_seed(0)
    return CASES[case](typed, tokenizer)


@contextmanager
def layer_calls(model: nn.Module) -> Iterator[Counter[str]]:
    """Calls of every ViT block and BERT layer by name, counted by pre-hooks (a recompute counts too)."""
    calls: Counter[str] = Counter()
    handles = [module.register_forward_pre_hook(lambda *_, name=name: calls.update([name]))
               for name, module in model.named_modules() if isinstance(module, (Block, BertLayer))]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def train_step(model: nn.Module, loss_fn: Callable[[nn.Module], Tensor]) -> tuple[Tensor, dict, Counter]:
    """Forward + backward from seed 1: loss, gradients by parameter name, layer calls."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with layer_calls(model) as calls:
        loss = loss_fn(model)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, calls


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_step_equals_plain_step(case, config, tokenizer):
    plain, loss_fn = build(case, config, tokenizer, on=False)
    ckpt, _ = build(case, config, tokenizer, on=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ckpt.state_dict().values()))
    assert ckpt.visual_encoder.grad_checkpointing and not plain.visual_encoder.grad_checkpointing

    loss, grads, calls = train_step(plain.train(), loss_fn)
    loss_c, grads_c, calls_c = train_step(ckpt.train(), loss_fn)
    assert torch.equal(loss, loss_c)
    assert grads.keys() == grads_c.keys() and len(grads) > 0
    assert [n for n in grads if not torch.equal(grads[n], grads_c[n])] == []

    assert calls.keys() == calls_c.keys() and calls
    momentum = ("visual_encoder_m.", "text_encoder_m.")
    for name, count in calls.items():
        # Each online layer reruns once in backward; the momentum copies run under no_grad only.
        assert calls_c[name] == (count if name.startswith(momentum) else 2 * count), name
    if case == "retrieval":
        assert any(name.startswith(momentum) for name in calls)
        assert not ckpt.text_encoder_m.grad_checkpointing and not ckpt.visual_encoder_m.grad_checkpointing
    if case == "vqa":
        assert ckpt.text_decoder.grad_checkpointing
        assert any(name.startswith("text_decoder.") for name in calls)


@pytest.fixture
def checkpoint_calls(monkeypatch) -> list[int]:
    """torch.utils.checkpoint.checkpoint as models.bert and timm call it, counting its calls."""
    calls: list[int] = []
    real = torch.utils.checkpoint.checkpoint

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)  # timm looks it up per call
    monkeypatch.setattr(models.bert, "checkpoint", spy)
    return calls


def test_nothing_is_checkpointed_in_eval_mode_or_without_grad(config, tokenizer, checkpoint_calls):
    ckpt, loss_fn = build("pretrain", config, tokenizer, on=True)
    plain, _ = build("pretrain", config, tokenizer, on=False)
    with torch.no_grad():  # training mode, but no backward can follow (GRIT's feature pass)
        loss_fn(ckpt.train())
    assert not checkpoint_calls
    # Evaluation mode with a backward (a gradient probe): the layers run once, as without the switch.
    _, grads, calls = train_step(plain.eval(), loss_fn)
    _, grads_c, calls_c = train_step(ckpt.eval(), loss_fn)
    assert not checkpoint_calls and not ckpt.visual_encoder.grad_checkpointing
    assert calls == calls_c and all(torch.equal(grads[n], grads_c[n]) for n in grads)
    # The switch itself survives eval(): back in training mode the layers are checkpointed again.
    train_step(ckpt.train(), loss_fn)
    assert checkpoint_calls and ckpt.visual_encoder.grad_checkpointing


def test_the_switch_is_off_by_default(config, tokenizer):
    raw = to_plain(dict(load_config(os.path.join(ROOT, TINY_CONFIGS["retrieval"]))))
    raw.update(config["retrieval"])
    del raw["grad_checkpointing"]  # the config's default decides
    model = ALBEF_Retrieval(config_from_mapping("retrieval", raw), tokenizer).train()
    encoders = [model.visual_encoder, model.text_encoder, model.visual_encoder_m, model.text_encoder_m]
    assert not any(e.grad_checkpointing for e in encoders)
    assert copy.deepcopy(build("vqa", config, tokenizer, on=True)[0]).text_decoder.grad_checkpointing


def test_pretrain_script_with_grad_checkpointing(tmp_path, monkeypatch):
    """Pretrain.py with --set grad_checkpointing=true: every ViT block and BERT layer runs twice per step
    (forward, then recomputed in backward), and the run ends with the weights of the run without it."""
    import Pretrain
    from dataset.synthetic import ensure_synthetic

    data = ensure_synthetic(str(tmp_path / "synthetic"), n=24, seed=3)
    calls: Counter = Counter()
    for cls in (Block, BertLayer):
        def counted(self, *args, _forward=cls.forward, _name=cls.__name__, **kwargs):
            calls[_name] += 1
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", counted)
    runs = {}
    for on in ("false", "true"):
        calls.clear()
        out = str(tmp_path / f"run_{on}")
        sets = small_pretrain_sets(data, **{"batching.queue_size": 16, "batching.search_space": 8,
                                            "max_epoch": 1, "schedular.epochs": 1, "grad_checkpointing": on})
        run_here(Pretrain, ["--config", "configs/tiny/Pretrain.yaml", "--output_dir", out, "--device", "cpu",
                            "--set", *sets])
        state = torch.load(os.path.join(out, "checkpoint_00.pth"), map_location="cpu", weights_only=True)
        runs[on] = (dict(calls), state["model"])
        assert f"grad_checkpointing: {on}" in Path(out, "config.yaml").read_text()
    (plain_calls, plain), (checkpointed_calls, checkpointed) = runs["false"], runs["true"]
    assert plain_calls["Block"] > 0 and plain_calls["BertLayer"] > 0
    assert checkpointed_calls == {name: 2 * n for name, n in plain_calls.items()}
    for name, value in plain.items():
        assert torch.equal(value, checkpointed[name]), name
