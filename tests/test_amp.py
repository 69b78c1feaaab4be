"""`amp: bf16`: bf16 autocast on any device (here the CPU); losses close to fp32, GRIT features fp32."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, tiny_config

from training.optimizer import autocast_dtype


def test_autocast_dtype_choices():
    cpu = torch.device('cpu')
    assert autocast_dtype(True, cpu) is None  # `true` is GPU-only, as before
    assert autocast_dtype(False, cpu) is None
    assert autocast_dtype('bf16', cpu) is torch.bfloat16
    with pytest.raises(ValueError, match="'amp'"):
        autocast_dtype('fp8', cpu)


def test_bf16_step_close_to_fp32_and_grit_features_fp32(one_thread):
    import Pretrain
    from models.losses import WithObjectives
    from models.pretrain import ALBEF_Base
    from models.tokenization import build_tokenizer
    from training.inputs import prepare_inputs

    data = os.path.join(ROOT, 'data/synthetic')
    # A random ViT: with the synthetic ViT, whose weights follow the world's format, the hard negatives
    # ITM picks by argmax can flip between the two precisions (format 6: loss_itm 0.627 against 0.580).
    config = tiny_config('pretrain', synthetic_root=data, vocab_file=os.path.join(data, 'vocab.txt'),
                         vision_init=None)
    prepare_inputs(config)  # the synthetic data, as the scripts do
    tokenizer = build_tokenizer(config)
    torch.manual_seed(0)
    model = ALBEF_Base(config, tokenizer)
    net = WithObjectives(model)  # the forward and its objectives (models.losses), as Pretrain.py's step
    image = torch.randn(8, 3, config.image_res, config.image_res)
    text = tokenizer(['a small red circle left of a large blue square'] * 4 + ['a green cross'] * 4,
                     padding='longest', return_tensors='pt')
    keys = ('loss_itc', 'loss_cons', 'loss_itm', 'loss_mlm')
    torch.manual_seed(1)
    fp32 = net(image, text, image_key=torch.arange(8))
    torch.manual_seed(1)  # the same MLM masks
    with torch.autocast('cpu', dtype=autocast_dtype('bf16', torch.device('cpu'))):
        bf16 = net(image, text, image_key=torch.arange(8))
    for key in keys:
        assert bf16[key].dtype == torch.float32, key
        assert bf16[key].item() == pytest.approx(fp32[key].item(), rel=2e-2, abs=2e-2), key
    sum(bf16[k] for k in keys).backward()
    # GRIT's features: the projections Pretrain.py's step keeps for the sampler's queues (the model's
    # outputs keep their graph and the autocast dtype; the step detaches them and makes them fp32).
    task = SimpleNamespace(device=torch.device('cpu'), image_keys=torch.arange(8), config=config, model=model,
                           scene_ids=None, shown=None, features={}, online=False)
    batch = SimpleNamespace(ids=torch.arange(8), image=image, text=text, valid_on=lambda device: None)
    torch.manual_seed(1)
    with torch.autocast('cpu', dtype=autocast_dtype('bf16', torch.device('cpu'))):
        Pretrain.PretrainTask.step(task, net, batch)
    features = task.features
    assert features['image'].dtype == torch.float32 and features['text'].dtype == torch.float32
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
