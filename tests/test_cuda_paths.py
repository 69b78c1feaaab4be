"""The CUDA-only branches, exercised on the CPU where torch allows it (issue 27): the fp16 gradient-scaler
update, the `amp: true` dtype choice, device selection and the NCCL process group's arguments, pinned
memory and non-blocking copies. tests/test_gpu.py runs the same paths on a GPU (`make gpu-check`)."""

from __future__ import annotations

import datetime
import os
import types

import pytest
import torch
import torch.distributed as dist
from transformers import BatchEncoding

from dataset.collate import ImageTextBatch
from training import distributed
from training.optimizer import autocast_dtype, build_scaler
from training.trainer import Trainer

CUDA1 = torch.device("cuda", 1)


def _fake_cuda(monkeypatch, devices: int = 2, bf16: bool = True, calls: list | None = None) -> None:
    """torch.cuda answers as on a machine with `devices` GPUs (nothing is allocated on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: (calls if calls is not None else []).append(d))


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_amp_true_on_cuda_picks_bf16_where_supported_else_fp16_with_the_scaler(monkeypatch, bf16, expected):
    _fake_cuda(monkeypatch, bf16=bf16)
    cuda = torch.device("cuda", 0)
    assert autocast_dtype(True, cuda) is expected
    assert autocast_dtype("bf16", cuda) is torch.bfloat16 and autocast_dtype(False, cuda) is None
    made = []
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device, enabled: made.append((device, enabled)))
    build_scaler(True, cuda)
    build_scaler("bf16", cuda)
    assert made == [("cuda", not bf16), ("cuda", False)]  # loss scaling for fp16 only


def _model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return model, x, y


def _one_update(scaler: torch.amp.GradScaler, dtype: torch.dtype | None, scale_loss: float = 1.0):
    model, x, y = _model_and_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = types.SimpleNamespace(config=types.SimpleNamespace(clip_grad=0.5),
                                    task=types.SimpleNamespace(model=model))
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = torch.nn.functional.cross_entropy(model(x), y) * scale_loss
    Trainer._update(trainer, loss, optimizer, scaler)
    return model


def test_the_fp16_scaler_update_equals_the_plain_update_and_skips_an_overflowing_step():
    # The trainer's scaled branch (fp16 autocast on CUDA) on the CPU's GradScaler: scale, unscale before
    # clipping, step, update. With finite gradients it is the unscaled update, up to fp16 rounding.
    plain = _one_update(torch.amp.GradScaler("cpu", enabled=False), torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaled = _one_update(scaler, torch.float16)
    assert scaler.is_enabled() and scaler.get_scale() == 2.0 ** 10
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    before, _, _ = _model_and_batch()
    # An overflow (inf gradients) skips the step and halves the scale: the weights stay as they were.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    skipped = _one_update(scaler, torch.float16, scale_loss=float("inf"))
    assert scaler.get_scale() == 2.0 ** 9
    for a, b in zip(before.parameters(), skipped.parameters()):
        assert torch.equal(a, b)


def test_device_selection_gives_each_rank_the_gpu_of_its_local_rank(monkeypatch):
    _fake_cuda(monkeypatch, devices=2)
    assert distributed._resolve_device(None, 1, distributed=True) == CUDA1
    assert distributed._resolve_device("cuda", 1, distributed=True) == CUDA1
    assert distributed._resolve_device("cuda", 0, distributed=False) == torch.device("cuda", 0)
    assert distributed._resolve_device("cuda:1", 0, distributed=False) == CUDA1
    with pytest.raises(distributed.ConfigError, match="2 CUDA device"):
        distributed._resolve_device("cuda:2", 0, distributed=False)


def test_the_nccl_group_gets_the_rank_s_gpu_as_device_id(monkeypatch):
    set_devices: list = []
    _fake_cuda(monkeypatch, devices=2, calls=set_devices)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "3"}.items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    store = dist.HashStore()
    monkeypatch.setattr(dist, "rendezvous", lambda url, rank, world, timeout: iter([(store, rank, world)]))
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    info = distributed.init_distributed(None, None, timeout_minutes=7)
    assert info.device == CUDA1 and (info.rank, info.world_size, info.local_rank) == (1, 2, 1)
    assert set_devices == [CUDA1]  # before the group, so NCCL's communicator binds this GPU
    [(backend, kw)] = calls
    assert backend == "nccl" and kw["device_id"] == CUDA1 and (kw["rank"], kw["world_size"]) == (1, 2)
    assert kw["timeout"] == datetime.timedelta(minutes=7)
    assert isinstance(kw["store"], dist.PrefixStore)  # this restart attempt's own keys


def _batch() -> ImageTextBatch:
    text = BatchEncoding({"input_ids": torch.ones(2, 5, dtype=torch.long),
                          "attention_mask": torch.ones(2, 5, dtype=torch.long)})
    return ImageTextBatch(image=torch.randn(2, 3, 4, 4), text=text, ids=torch.tensor([3, 7]),
                          valid=torch.tensor([True, False]), reasons=["x: broken"])


def test_pinned_memory_pins_every_tensor_and_keeps_the_batch_s_types(monkeypatch):
    # DataLoader(pin_memory=True) calls Batch.pin_memory on CUDA machines; Tensor.pin_memory itself needs
    # a driver, so it is recorded here instead.
    pinned = []

    def pin(tensor):
        pinned.append(tensor)
        return tensor.clone()

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    batch = _batch()
    out = batch.pin_memory()
    assert type(out) is ImageTextBatch and isinstance(out.text, BatchEncoding)
    assert {id(t) for t in pinned} == {id(batch.image), id(batch.ids), id(batch.valid),
                                      id(batch.text["input_ids"]), id(batch.text["attention_mask"])}
    assert torch.equal(out.image, batch.image) and out.image is not batch.image
    assert out.reasons == ["x: broken"] and torch.equal(out.text["input_ids"], batch.text["input_ids"])


def test_the_loader_pins_memory_exactly_when_cuda_is_there(monkeypatch):
    from training.loaders import create_loader

    data = list(range(8))
    assert not create_loader(data, None, 4, 0).pin_memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert create_loader(data, None, 4, 0).pin_memory


def test_the_valid_mask_goes_to_the_device_only_when_a_sample_is_bad():
    batch = _batch()
    assert batch.valid_on("cpu").tolist() == [True, False]
    assert ImageTextBatch(image=batch.image, text=batch.text, ids=batch.ids,
                          valid=torch.ones(2, dtype=torch.bool)).valid_on("cpu") is None  # nothing to mask


def test_deterministic_runs_fix_cublas_s_workspace_and_keep_a_user_s_setting(monkeypatch):
    from training.reproducibility import use_deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        use_deterministic_kernels(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # else cuBLAS only warns, and varies
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        use_deterministic_kernels(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        use_deterministic_kernels(False)
    assert not torch.are_deterministic_algorithms_enabled()
