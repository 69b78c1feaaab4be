"""Tests for training/: command line, config overrides, optimiser/schedule, checkpoints, logging."""

import dataclasses
import json
import math
import multiprocessing as mp
import os

import pytest
import torch
from conftest import HANG_GUARD_S, ROOT, free_port
from ruamel.yaml.comments import CommentedMap
from torch import nn

from grit_io import InputFileError
from training.checkpoints import (
    checkpoint_path,
    find_latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    restore_training,
    save_checkpoint,
    training_state,
)
from training.cli import script_parser
from training.config import Optimizer, Schedule
from training.config_files import ConfigError, load_config, save_config, to_plain
from training.config_resolve import resolve_config
from training.distributed import (
    all_reduce_mean,
    barrier,
    cleanup,
    get_rank,
    init_distributed,
    is_main_process,
)
from training.loaders import create_loader
from training.logger import TrainLogger, append_log
from training.optimizer import build_optimizer, build_scheduler, schedule_lr, split_decay_params
from training.reproducibility import make_generator, seed_everything

CONFIG_TEXT = """\
# tiny pre-training config
image_res: 32
temp: 0.07  # ITC temperature, learnable
text_encoder: null
train_file: [a.json, b.json]
batching:
  strategy: grit
  example_shuffle: true   # GRIT's phase 2 on/off
  queue_size: 64
optimizer: {opt: adamW, lr: 1e-4, weight_decay: 0.02}
schedular: {sched: cosine, lr: 1e-4, epochs: 30, min_lr: 1e-5, warmup_lr: 1e-5, warmup_steps: 5}
max_epoch: 20
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / 'cfg.yaml'
    path.write_text(CONFIG_TEXT)
    return str(path)


# ---------------------------------------------------------------- command line


def test_parser_shared_flags_and_script_flags(monkeypatch):
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    parser = script_parser('Test.py', 'test')
    parser.add_argument('--bench', action='store_true')
    args = parser.parse_args(['--config', 'c.yaml', '--output_dir', 'o', '--resume', '--bench',
                              '--set', 'a=1', 'b.c=x', '--set', 'd=[1, 2]', '--seed', '3', '--evaluate'])
    assert args.bench and args.evaluate and args.resume == 'latest' and args.seed == 3
    assert args.set == ['a=1', 'b.c=x', 'd=[1, 2]']
    assert args.local_rank == 0 and args.device is None and args.checkpoint is None
    assert parser.parse_args(['--config', 'c.yaml', '--output_dir', 'o', '--resume', 'x.pth']).resume \
        == 'x.pth'
    assert parser.parse_args(['--config', 'c.yaml', '--output_dir', 'o']).resume is None


def test_local_rank_spellings_and_env(monkeypatch):
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    parser = script_parser('Test.py', 'test')
    assert parser.parse_args(['--config', 'c', '--output_dir', 'o', '--local_rank', '3']).local_rank == 3
    assert parser.parse_args(['--config', 'c', '--output_dir', 'o', '--local-rank=2']).local_rank == 2
    monkeypatch.setenv('LOCAL_RANK', '5')
    assert parser.parse_args(['--config', 'c', '--print_config']).local_rank == 5  # no --output_dir needed


# ---------------------------------------------------------------- config


def test_overrides_nested_keys_and_yaml_values(config_file):
    cfg = load_config(config_file, [
        'batching.example_shuffle=false', 'optimizer.lr=1e-4', 'train_file=[x.json, y.json]', 'temp=null',
        'batching.queue_size=128', 'image_res=64', 'train_file.1=z.json', 'text_encoder=bert-base-uncased'])
    assert isinstance(cfg, CommentedMap) and isinstance(cfg, dict)
    assert cfg['batching']['example_shuffle'] is False
    assert isinstance(cfg['optimizer']['lr'], float) and cfg['optimizer']['lr'] == pytest.approx(1e-4)
    assert list(cfg['train_file']) == ['x.json', 'z.json']
    assert cfg['temp'] is None and cfg['batching']['queue_size'] == 128 and cfg['image_res'] == 64
    assert cfg['text_encoder'] == 'bert-base-uncased'
    assert isinstance(cfg['schedular']['min_lr'], float)  # 1e-5 in the file: YAML 1.2 float


def test_unknown_key_suggests_close_match(config_file):
    msg = r"unknown config key 'batching\.example_shufle' \(did you mean 'batching\.example_shuffle'\?\)"
    with pytest.raises(ValueError, match=msg):
        load_config(config_file, ['batching.example_shufle=false'])
    with pytest.raises(ValueError, match='cfg.yaml'):
        load_config(config_file, ['no_such_thing=1'])
    with pytest.raises(ValueError, match='key=value'):
        load_config(config_file, ['batching.example_shuffle'])


def test_missing_config_and_required_keys(tmp_path, config_file):
    with pytest.raises(FileNotFoundError, match='nope.yaml'):
        load_config(str(tmp_path / 'nope.yaml'), [])
    bad = tmp_path / 'bad.yaml'
    bad.write_text('a: [1, 2\n')
    with pytest.raises(ValueError, match='bad.yaml'):
        load_config(str(bad))
    # CONFIG_TEXT lacks the pre-training keys without a default: each is named with the file
    with pytest.raises(ConfigError) as err:
        resolve_config('pretrain', config_file, check_paths=False)
    assert f"config key 'bert_config' is required but missing in {config_file}" in str(err.value)
    assert f"config key 'batch_size' is required but missing in {config_file}" in str(err.value)


def test_cli_flags_and_max_epoch(config_file):
    sets = ['image_res=48', 'bert_config=configs/tiny/config_bert.json', 'batch_size=8', 'vocab_file=v.txt',
            'batching.search_space=32']
    cfg = resolve_config('pretrain', config_file, sets, {'seed': 7, 'text_encoder': 'my/bert'},
                         check_paths=False)
    assert cfg.image_res == 48 and cfg.seed == 7 and cfg.text_encoder == 'my/bert'
    assert cfg.max_epoch == 20
    unset = resolve_config('pretrain', config_file, [*sets, 'max_epoch=null'], check_paths=False)
    assert unset.max_epoch == 30  # null: schedular.epochs, as ALBEF


def test_comments_survive_save(tmp_path, config_file):
    cfg = load_config(config_file, ['batching.example_shuffle=false', 'temp=0.05'])
    out = tmp_path / 'out' / 'config.yaml'
    out.parent.mkdir()
    save_config(cfg, out)
    text = out.read_text()
    for comment in ('# tiny pre-training config', '# ITC temperature, learnable', "# GRIT's phase 2 on/off"):
        assert comment in text
    assert 'example_shuffle: false' in text and 'temp: 0.05' in text and 'text_encoder: null' in text
    again = load_config(str(out))
    assert to_plain(again) == to_plain(cfg)


def test_to_plain_makes_builtin_types(config_file):
    plain = to_plain(load_config(config_file))
    assert type(plain) is dict and type(plain['batching']) is dict and type(plain['train_file']) is list
    assert type(plain['temp']) is float and type(plain['optimizer']['lr']) is float


# ---------------------------------------------------------------- optimiser and schedule


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.bert = nn.Module()
        self.bert.embeddings = nn.Module()
        emb = self.bert.embeddings
        emb.word_embeddings = nn.Embedding(10, 4)
        emb.position_embeddings = nn.Embedding(8, 4)
        emb.token_type_embeddings = nn.Embedding(2, 4)
        emb.LayerNorm = nn.LayerNorm(4)
        self.bert.dense = nn.Linear(4, 4)
        self.visual_encoder = nn.Module()
        self.visual_encoder.cls_token = nn.Parameter(torch.zeros(1, 1, 4))
        self.visual_encoder.pos_embed = nn.Parameter(torch.zeros(1, 5, 4))
        self.visual_encoder.norm1 = nn.LayerNorm(4)
        self.visual_encoder.qkv = nn.Linear(4, 12)
        self.temp = nn.Parameter(torch.tensor(0.07))
        self.decoder = nn.Linear(4, 10)
        self.decoder.weight = emb.word_embeddings.weight  # tied like the MLM head
        self.momentum = nn.Linear(4, 4)
        self.momentum.requires_grad_(False)


def test_weight_decay_groups():
    model = TinyModel()
    decay, no_decay = split_decay_params(model)
    assert set(decay) == {'bert.dense.weight', 'visual_encoder.qkv.weight'}
    assert set(no_decay) == {
        'bert.embeddings.word_embeddings.weight', 'bert.embeddings.position_embeddings.weight',
        'bert.embeddings.token_type_embeddings.weight', 'bert.embeddings.LayerNorm.weight',
        'bert.embeddings.LayerNorm.bias', 'bert.dense.bias', 'visual_encoder.cls_token',
        'visual_encoder.pos_embed', 'visual_encoder.norm1.weight', 'visual_encoder.norm1.bias',
        'visual_encoder.qkv.bias', 'temp', 'decoder.bias'}
    opt = build_optimizer(model, Optimizer(lr=1e-4, weight_decay=0.02))
    assert isinstance(opt, torch.optim.AdamW)
    by_wd = {g['weight_decay']: {id(p) for p in g['params']} for g in opt.param_groups}
    assert by_wd[0.02] == {id(p) for p in decay.values()}
    assert by_wd[0.0] == {id(p) for p in no_decay.values()}
    assert all(g['lr'] == pytest.approx(1e-4) for g in opt.param_groups)
    with pytest.raises(ConfigError, match="'optimizer.opt' must be one of 'adamW'.* got 'sgd'"):
        resolve_config('pretrain', os.path.join(ROOT, 'configs/tiny/Pretrain.yaml'), ['optimizer.opt=sgd'],
                       check_paths=False)


SCHED = Schedule(sched='cosine', lr=1e-4, epochs=30, min_lr=1e-5, warmup_lr=1e-5, warmup_steps=5)
ADAMW = Optimizer(lr=1e-4, weight_decay=0.02)


def _lrs(opt, sched, n):
    """Learning rate used by each of the next n optimiser steps (all groups must agree)."""
    out = []
    for _ in range(n):
        lrs = {g['lr'] for g in opt.param_groups}
        assert len(lrs) == 1
        out.append(lrs.pop())
        opt.step()
        sched.step()
    return out


def test_scheduler_values():
    model = TinyModel()
    opt = build_optimizer(model, ADAMW)
    sched = build_scheduler(opt, SCHED, steps_per_epoch=10)
    lrs = _lrs(opt, sched, 61)
    assert lrs[0] == pytest.approx(1e-5)                     # warm-up starts at warmup_lr
    assert lrs[3] == pytest.approx(1e-5 + 9e-5 * 3 / 5)      # linear
    assert lrs[5] == pytest.approx(1e-4)                     # warm-up ends at lr
    assert lrs[9] == pytest.approx(1e-4)                     # rest of epoch 0 stays at lr
    cos5 = 1e-5 + 0.5 * 9e-5 * (1 + math.cos(math.pi * 5 / 30))
    assert lrs[50] == pytest.approx(cos5) and lrs[59] == pytest.approx(cos5)  # constant within epoch 5
    assert lrs[49] > lrs[50]
    # warm-up longer than epoch 0 continues into epoch 1; past the horizon the rate stays at min_lr
    assert schedule_lr(12, 10, 1e-4, 30, 1e-5, 1e-5, 15) == pytest.approx(1e-5 + 9e-5 * 12 / 15)
    assert schedule_lr(400, 10, 1e-4, 30, 1e-5) == pytest.approx(1e-5)
    # fine-tuning style: no warm-up, cosine per epoch from the first step
    assert schedule_lr(0, 10, 1e-5, 5, 1e-6) == pytest.approx(1e-5)


def test_scheduler_config_errors():
    opt = build_optimizer(TinyModel(), Optimizer(lr=1e-4))
    with pytest.raises(ValueError, match='differs'):
        build_scheduler(opt, dataclasses.replace(SCHED, lr=2e-4), 10)
    tiny = os.path.join(ROOT, 'configs/tiny/Pretrain.yaml')
    with pytest.raises(ConfigError, match="'schedular.epochs' is required"):
        resolve_config('pretrain', tiny, ['schedular={sched: cosine, lr: 5.0e-4}'], check_paths=False)
    with pytest.raises(ConfigError, match="'schedular.sched' must be 'cosine', got 'step'"):
        resolve_config('pretrain', tiny, ['schedular.sched=step'], check_paths=False)


def test_scheduler_state_round_trip(tmp_path):
    torch.manual_seed(0)
    model = TinyModel()
    opt = build_optimizer(model, ADAMW)
    sched = build_scheduler(opt, SCHED, steps_per_epoch=4)
    _lrs(opt, sched, 13)
    path = save_checkpoint(checkpoint_path(tmp_path, step=13), model=model.state_dict(),
                           optimizer=opt.state_dict(), lr_scheduler=sched.state_dict(), step=13)
    expected = _lrs(opt, sched, 6)

    model2 = TinyModel()
    opt2 = build_optimizer(model2, ADAMW)
    sched2 = build_scheduler(opt2, SCHED, steps_per_epoch=4)
    state = load_checkpoint(path)
    model2.load_state_dict(state['model'])
    opt2.load_state_dict(state['optimizer'])
    sched2.load_state_dict(state['lr_scheduler'])
    assert sched2.last_epoch == 13
    assert _lrs(opt2, sched2, 6) == pytest.approx(expected)


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_save_load_and_latest(tmp_path, config_file):
    cfg = load_config(config_file)
    assert checkpoint_path(tmp_path, epoch=3).endswith('checkpoint_03.pth')
    assert checkpoint_path(tmp_path, step=1234).endswith('checkpoint_step_0001234.pth')
    with pytest.raises(ValueError):
        checkpoint_path(tmp_path)
    assert find_latest_checkpoint(tmp_path) is None

    state = {'model': nn.Linear(3, 2).state_dict(), 'config': cfg, 'epoch': 0, 'step': 7}
    p0 = save_checkpoint(checkpoint_path(tmp_path, step=7), **state)
    p1 = save_checkpoint(checkpoint_path(tmp_path, epoch=0), **{**state, 'step': 10})
    save_checkpoint(tmp_path / 'checkpoint_best.pth', **state)  # not a resume candidate
    assert sorted(n for n in os.listdir(tmp_path) if n != 'cfg.yaml') == [
        'checkpoint_00.pth', 'checkpoint_best.pth', 'checkpoint_step_0000007.pth', 'latest.json']
    assert find_latest_checkpoint(tmp_path) == p1
    assert resolve_resume('latest', str(tmp_path)) == p1
    assert resolve_resume(None, str(tmp_path)) is None
    with pytest.raises(InputFileError, match='missing.pth'):
        resolve_resume(str(tmp_path / 'missing.pth'), str(tmp_path))

    raw = torch.load(p1, weights_only=True)  # plain contents: loadable by a bare weights-only load
    assert type(raw['config']) is dict and raw['config']['batching']['queue_size'] == 64
    loaded = load_checkpoint(p1)
    assert loaded['step'] == 10 and torch.equal(loaded['model']['weight'], state['model']['weight'])

    # without the sidecar the newest file wins
    os.remove(tmp_path / 'latest.json')
    os.utime(p0, (2e9, 2e9))
    assert find_latest_checkpoint(tmp_path) == p0


def test_training_state_format_and_resume(tmp_path, config_file):
    # The checkpoint format the scripts write (and resume from) is a plain dict with these keys; a file
    # written before training/ existed (by utils.training_state) has the same keys and resumes alike.
    torch.manual_seed(0)
    model, cfg = TinyModel(), load_config(config_file)
    opt = build_optimizer(model, ADAMW)
    sched = build_scheduler(opt, SCHED, steps_per_epoch=4)
    scaler = torch.amp.GradScaler('cpu', enabled=False)
    _lrs(opt, sched, 5)
    state = training_state(model, opt, sched, scaler, config=cfg, epoch=1, step=5,
                           sampler_state={'seed': 3, 'epoch': 1}, seed=3, rank=0, best={'val_acc': 0.5})
    path = save_checkpoint(checkpoint_path(tmp_path, step=5), **state)
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {'model', 'optimizer', 'lr_scheduler', 'scaler', 'sampler', 'config', 'epoch', 'step',
                        'epoch_complete', 'best'}
    assert raw['epoch_complete'] is False and raw['sampler'] == {'seed': 3, 'epoch': 1}
    assert set(raw['model']) == set(model.state_dict())

    model2 = TinyModel()
    opt2 = build_optimizer(model2, ADAMW)
    sched2 = build_scheduler(opt2, SCHED, steps_per_epoch=4)
    loaded, start_epoch, step = restore_training(path, model2, opt2, sched2, scaler, seed=3, rank=0)
    assert (start_epoch, step, loaded['best']) == (1, 5, {'val_acc': 0.5})  # mid-epoch: epoch 1 again
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert _lrs(opt2, sched2, 3) == pytest.approx(_lrs(opt, sched, 3))


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(InputFileError, match='absent.pth'):
        load_checkpoint(tmp_path / 'absent.pth')
    bad = tmp_path / 'corrupt.pth'
    bad.write_bytes(b'not a checkpoint')
    with pytest.raises(InputFileError, match='corrupt.pth'):
        load_checkpoint(bad)
    tensor = tmp_path / 'tensor.pth'
    torch.save(torch.zeros(2), tensor)
    with pytest.raises(InputFileError, match='tensor.pth holds a Tensor, not a checkpoint dict'):
        load_checkpoint(tensor)


# ---------------------------------------------------------------- logging


def test_train_logger_summary_and_lines(capsys):
    torch.manual_seed(0)
    values = torch.rand(7, 2)
    log = TrainLogger(header='Train Epoch: [0]', print_freq=3, enabled=True, use_tqdm=False)
    for i in log.log_every(range(7)):
        log.update(loss_itc=values[i, 0], loss_itm=values[i, 1], lr=1e-4 * (i + 1))
    summary = log.epoch_summary()
    assert summary['loss_itc'] == pytest.approx(values[:, 0].mean().item(), rel=1e-6)
    assert summary['loss_itm'] == pytest.approx(values[:, 1].mean().item(), rel=1e-6)
    assert summary['lr'] == pytest.approx(4e-4)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith('Train Epoch')]
    assert [ln.split(']')[1].split('/')[0].strip(' [') for ln in lines] == ['3', '6', '7']
    assert 'loss_itc' in lines[-1] and 'eta' in lines[-1]

    quiet = TrainLogger(enabled=False)
    for _ in quiet.log_every(range(4)):
        quiet.update(loss=torch.tensor(2.0))
    assert capsys.readouterr().out == '' and quiet.epoch_summary() == {'loss': 2.0}
    assert all_reduce_mean({'a': torch.tensor(1.5), 'b': 2}) == {'a': 1.5, 'b': 2.0}


def test_append_log_json_lines(tmp_path):
    append_log(tmp_path, {'epoch': 0, 'train_loss_itc': torch.tensor(0.5), 'lr': 1e-4})
    append_log(tmp_path, {'epoch': 1, 'r@1': [1.0, 2.0]})
    records = [json.loads(ln) for ln in (tmp_path / 'log.txt').read_text().splitlines()]
    assert records == [{'epoch': 0, 'train_loss_itc': 0.5, 'lr': 1e-4}, {'epoch': 1, 'r@1': [1.0, 2.0]}]


# ---------------------------------------------------------------- seeding and loading


class _RandomDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import random

        import numpy as np
        return torch.tensor([i, np.random.rand(), random.random()], dtype=torch.float64)


def test_seed_and_loader():
    seed_everything(1, rank=1)
    a = torch.rand(3)
    seed_everything(2, rank=0)
    assert torch.equal(a, torch.rand(3))
    loader = create_loader(_RandomDataset(), None, batch_size=2, num_workers=2, drop_last=True,
                           generator=make_generator(0))
    assert loader.persistent_workers and not loader.pin_memory
    batches = list(loader)
    assert len(batches) == 4
    rows = torch.cat(batches)
    assert sorted(rows[:, 0].tolist()) == list(range(8))
    # worker 0 loads batches 0 and 2, worker 1 batches 1 and 3: their numpy streams must differ
    assert not torch.equal(batches[0][:, 1], batches[1][:, 1])
    again = torch.cat(list(create_loader(_RandomDataset(), None, 2, 2,
                                         generator=make_generator(0))))
    assert torch.equal(rows, again)  # same generator seed -> same worker seeds


# ---------------------------------------------------------------- distributed (2 processes, gloo)


def _dist_worker(rank, port, out_dir, queue):
    """One rank of a 2-process CPU job, launched the way torchrun sets the environment."""
    os.environ.update({'WORLD_SIZE': '2', 'RANK': str(rank), 'LOCAL_RANK': str(rank),
                       'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(port)})
    try:
        info = init_distributed('cpu')
        assert info.distributed and info.world_size == 2 and info.device.type == 'cpu'
        assert info.local_rank == rank and get_rank() == rank
        mean = all_reduce_mean({'x': torch.tensor(float(rank))})
        log = TrainLogger(enabled=is_main_process(), use_tqdm=False)
        for step in range(3):
            log.update(loss=torch.tensor(float(rank * 10 + step)))
        summary = log.epoch_summary()
        path = save_checkpoint(os.path.join(out_dir, 'checkpoint_00.pth'), step=3)
        barrier()
        cleanup()
        queue.put((rank, mean['x'], summary['loss'], path is not None))
    except BaseException as e:  # report instead of hanging the parent
        queue.put((rank, repr(e)))


def test_two_process_gloo(tmp_path):
    port = free_port()
    # fork: the children reuse the imported torch, so the test costs well under a second
    ctx = mp.get_context('fork')
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dist_worker, args=(r, port, str(tmp_path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=HANG_GUARD_S) for _ in procs)
    for p in procs:
        p.join(timeout=HANG_GUARD_S)
    # mean of ranks 0,1 = 0.5; loss mean over {0,1,2,10,11,12} = 6; only rank 0 saves
    assert results == [(0, 0.5, 6.0, True), (1, 0.5, 6.0, False)]
    assert find_latest_checkpoint(tmp_path).endswith('checkpoint_00.pth')
