"""The `compile` switch: Pretrain.py's training forward goes through torch.compile and trains like the
default path. This script test compiles with dynamo's 'eager' backend (graph capture without code
generation); inductor, the backend `compile: true` uses, is tested on a tiny step against eager by
tests/test_gpu.py on a GPU and in its CPU mode under `make test-slow` (tests/test_gpu_on_cpu.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import small_pretrain_sets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory) -> str:
    from dataset.synthetic import ensure_synthetic

    return ensure_synthetic(str(tmp_path_factory.mktemp('compile_data') / 'synthetic'), n=96, seed=3)


def _args(data: str, out: str, **extra) -> list[str]:
    values = {'batching.queue_size': 40, 'batching.search_space': 16, 'max_epoch': 1, 'schedular.epochs': 1,
              'schedular.warmup_steps': 2, 'print_freq': 1000, **extra}
    return ['--config', 'configs/tiny/Pretrain.yaml', '--output_dir', out, '--device', 'cpu',
            '--set', *small_pretrain_sets(data, **values)]


def test_compiled_training_matches_default(data_dir, tmp_path, monkeypatch):
    import Pretrain
    from training.distributed import unwrap

    torch.set_num_threads(1)
    monkeypatch.chdir(ROOT)
    compiled = []
    original = torch.compile

    def eager_compile(model, **kwargs):
        compiled.append(model)
        return original(model, backend='eager', **kwargs)

    monkeypatch.setattr(torch, 'compile', eager_compile)
    Pretrain.main(_args(data_dir, str(tmp_path / 'default')))
    assert not compiled
    # static_text false: text padded as in the default run (padding to max_tokens, compile's default, gives
    # the same losses but draws the MLM masks over a longer tensor; tests/test_step_equality.py).
    Pretrain.main(_args(data_dir, str(tmp_path / 'compiled'), compile='true', static_text='false'))
    assert len(compiled) == 1 and unwrap(original(compiled[0], backend='eager')) is compiled[0]
    torch._dynamo.reset()

    def log(name: str) -> dict:
        with open(tmp_path / name / 'log.txt') as f:
            return json.loads(f.readline())

    a, b = log('default'), log('compiled')
    for key in ('loss_itc', 'loss_cons', 'loss_itm', 'loss_mlm'):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # checkpoints keep the plain module's keys (no '_orig_mod.' prefix)
    state = torch.load(tmp_path / 'compiled' / 'checkpoint_00.pth', weights_only=True)['model']
    assert not any(k.startswith('_orig_mod') for k in state)
