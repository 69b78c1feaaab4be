"""The GPU-marked tests (issue 27): everything CUDA-specific, each compared with a reference where one
exists: bf16 and fp16 autocast with the gradient scaler, fused AdamW, torch.compile, gradient
checkpointing, an NCCL group of one, GRIT's collector and grouping against the CPU's, bad-sample masks on
the device, and save and exact resume of a tiny pre-training.

    make gpu-check                                     # on a CUDA machine: these tests, then benchmarks
    python -m pytest -m gpu -rs tests/test_gpu.py      # these tests alone

Without CUDA every test skips with the reason. GRIT_GPU_TEST_DEVICE=cpu runs them on the CPU instead, to
check the tests themselves (the CUDA-only ones, NCCL, skip with their reason there).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import types
from collections import Counter

import pytest
import torch
import torch._inductor.config
import torch.distributed as dist
import torch.nn.functional as F
from conftest import HANG_GUARD_S, ROOT, small_pretrain_sets, tiny_config, word_tokenizer
from timm.models.vision_transformer import Block
from transformers import BatchEncoding

import models.pretrain
from dataset.collate import ImageTextBatch
from grit import GritSampler
from models.bert_layers import BertLayer
from models.losses import WithObjectives
from models.mlm import mask_tokens
from models.pretrain import ALBEF_Base
from tools.launch import child_env
from training.distributed import DistInfo, all_reduce_mean, reduce_sum, unwrap, wrap_ddp
from training.optimizer import autocast_dtype, build_optimizer, build_scaler
from training.trainer import Trainer

DEVICE = os.environ.get("GRIT_GPU_TEST_DEVICE", "cuda")
DEV = torch.device(DEVICE)
ON_CUDA = DEV.type == "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(),
                       reason="no CUDA device: torch.cuda.is_available() is False "
                              "(make gpu-check runs these on a GPU machine)"),
    pytest.mark.usefixtures("one_thread", "ieee_fp32"),
]
cuda_only = pytest.mark.skipif(not ON_CUDA, reason=f"CUDA only (GRIT_GPU_TEST_DEVICE={DEVICE})")

WORDS = ["a", "dog", "cat", "red", "blue", "ball", "on", "the", "grass", "left", "right", "of", "big",
         "small"]
N = 8
LOSSES = ("loss_itc", "loss_cons", "loss_itm", "loss_mlm")
# Across devices and batch sizes the kernels sum in other orders: equal up to float32 rounding.
CLOSE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def ieee_fp32():
    """No TF32 while the module runs: CUDA convolutions (the ViT's patch embedding) default to it, and
    float32 results are compared with the CPU's."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("vocab"), WORDS)


def config(**values):
    """The typed tiny pre-training config at 32 px, random ViT weights (no synthetic ViT to make)."""
    return tiny_config("pretrain", vision_init=None, image_res=32, **values)


def model_on(device, tokenizer, **values) -> ALBEF_Base:
    """ALBEF_Base from seed 0, built on the CPU and moved: the same weights on every device."""
    torch.manual_seed(0)
    return ALBEF_Base(config(**values), tokenizer).to(device)


def pairs(tokenizer, n: int = N) -> tuple[torch.Tensor, BatchEncoding, torch.Tensor]:
    """n random images and captions (3-8 words) with their image keys, on the CPU."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, 32, 32, generator=gen)
    captions = [" ".join(WORDS[j] for j in torch.randint(len(WORDS), (int(k),), generator=gen))
                for k in torch.randint(3, 9, (n,), generator=gen)]
    return images, tokenizer(captions, padding="longest", return_tensors="pt"), torch.arange(n)


def seeded_step(model, image, text, keys) -> tuple[dict, dict]:
    """Forward + backward of the four losses from seed 1 (the same MLM masks) -> (losses, grads by name).

    An ALBEF_Base runs with its objectives (models.losses.WithObjectives, as the trainer runs it); a
    wrapped WithObjectives (compile, DDP) runs as it is. Gradients by the ALBEF_Base's parameter names."""
    net = WithObjectives(model) if isinstance(model, ALBEF_Base) else model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = net(image, text, image_key=keys)
    sum(out[k] for k in LOSSES).backward()
    module = unwrap(net)
    module = module.model if isinstance(module, WithObjectives) else module
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return {k: out[k].detach() for k in (*LOSSES, "hardness")}, grads


def named(name: str):
    """assert_close's msg: the tensor's name, then torch's own report (the largest difference, where)."""
    return lambda report: f"{name}: {report}"


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 where both are 0)."""
    a, b = a.double(), b.double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-300)


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten().float() for g in grads.values()])


# ----------------------------------------------------------------------------- mixed precision


def trainer_update(model, loss, optimizer, scaler) -> None:
    """The trainer's backward + step (scaled for fp16, unscaled before clipping; clip_grad 5.0)."""
    optimizer.zero_grad(set_to_none=True)  # as Trainer._train_epoch does before _update
    owner = types.SimpleNamespace(config=types.SimpleNamespace(clip_grad=5.0),
                                  task=types.SimpleNamespace(model=model))
    Trainer._update(owner, loss, optimizer, scaler)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_autocast_training_step_with_the_scaler_is_close_to_fp32(tokenizer, amp):
    """One training step under autocast: fp32 losses and features, close to fp32's, the same gradient
    direction, weights updated and finite (fp16: through the GradScaler's scaled update)."""
    image, text, keys = (x.to(DEV) for x in pairs(tokenizer))
    ref = model_on(DEV, tokenizer)
    model = copy.deepcopy(ref)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_config = config().optimizer

    torch.manual_seed(1)
    fp32 = WithObjectives(ref)(image, text, image_key=keys)
    trainer_update(ref, sum(fp32[k] for k in LOSSES), build_optimizer(ref, opt_config),
                   build_scaler(False, DEV))
    if amp == "bf16":
        dtype, scaler = autocast_dtype("bf16", DEV), build_scaler("bf16", DEV)
        assert dtype is torch.bfloat16 and not scaler.is_enabled()  # bf16 needs no loss scaling
        if ON_CUDA:  # `amp: true`: bf16 where the GPU has it, else fp16 with the scaler
            bf16 = torch.cuda.is_bf16_supported()
            assert autocast_dtype(True, DEV) is (torch.bfloat16 if bf16 else torch.float16)
            assert build_scaler(True, DEV).is_enabled() is not bf16
    else:
        dtype, scaler = torch.float16, torch.amp.GradScaler(DEV.type)
        assert scaler.is_enabled()
    optimizer = build_optimizer(model, opt_config)
    for _ in range(8):  # the default initial scale (2**16) overflows here (unscaled gradients reach ~10 in
        # fp16): each such step is skipped and the scale halved
        scale = scaler.get_scale() if scaler.is_enabled() else None
        torch.manual_seed(1)
        with torch.autocast(DEV.type, dtype=dtype):
            out = WithObjectives(model)(image, text, image_key=keys)
        trainer_update(model, sum(out[k] for k in LOSSES), optimizer, scaler)
        if scale is None or scaler.get_scale() >= scale:
            break
        assert all(torch.equal(p, start[n]) for n, p in model.named_parameters()), "a skipped step moved"
    else:
        pytest.fail(f"{amp}: every scaled step overflowed (scale now {scaler.get_scale()})")

    for key in LOSSES:
        assert out[key].dtype == torch.float32 and torch.isfinite(out[key]), key
        assert out[key].item() == pytest.approx(fp32[key].item(), rel=2e-2, abs=2e-2), key
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and grads
    assert torch.isfinite(flat(grads)).all()
    assert F.cosine_similarity(flat(grads), flat(ref_grads), dim=0) > 0.99  # unscaled, as fp32's
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())
    # GRIT's features, fp32 under autocast too: the model's projections keep their graph and the autocast
    # dtype; Pretrain.py's step detaches them and makes them fp32 for the sampler's queues.
    import Pretrain

    task = types.SimpleNamespace(device=DEV, image_keys=keys, model=model, scene_ids=None, shown=None,
                                 features={}, online=False,
                                 config=types.SimpleNamespace(batch_pictures=False, itm=True))
    batch = ImageTextBatch(image=image, text=text, ids=keys, valid=torch.ones(N, dtype=torch.bool),
                           reasons=[])
    with torch.autocast(DEV.type, dtype=dtype):
        Pretrain.PretrainTask.step(task, WithObjectives(model), batch)
    assert task.features["image"].dtype == torch.float32 and task.features["text"].dtype == torch.float32


# ----------------------------------------------------------------------------- fused AdamW


def test_fused_adamw_steps_equal_the_unfused_steps(tokenizer):
    """fused_adamw null picks the fused kernel exactly when the parameters are on CUDA, and its steps
    give the weights of the per-parameter AdamW (on the CPU the fused kernel is asked for explicitly,
    as configs/tiny/Pretrain.yaml does)."""
    model = model_on(DEV, tokenizer)
    twin = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    opt_config = config().optimizer
    default = build_optimizer(model, opt_config)
    assert default.defaults["fused"] is ON_CUDA
    fused = default if ON_CUDA else build_optimizer(model, opt_config, fused=True)
    plain = build_optimizer(twin, opt_config, fused=False)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    image, text, keys = (x.to(DEV) for x in pairs(tokenizer))
    for _ in range(2):  # the second step uses the moments of the first
        seeded_step(model, image, text, keys)
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()  # the same gradients for both
        fused.step()
        plain.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=named(name))
    assert sum(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), start)) > len(start) // 2


# ----------------------------------------------------------------------------- torch.compile


def test_compiled_training_forward_matches_eager(tokenizer, monkeypatch):
    """`compile: true` (training.distributed.wrap_ddp): the compiled forward and backward, with the default
    backend (inductor, told to draw random numbers as eager does, so the MLM masks agree), give the eager
    losses and gradients; a second step reuses the one graph (no recompilation). On the CPU a cold
    inductor compile of this tiny step takes about a minute here (a warm cache: seconds)."""
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    model = model_on(DEV, tokenizer)
    image, text, keys = (x.to(DEV) for x in pairs(tokenizer))
    eager, eager_grads = seeded_step(model, image, text, keys)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=DEV, distributed=False)
    net = WithObjectives(model)  # the trainer's unit (Task.train_module): the model and its objectives
    compiled = wrap_ddp(net, info, compile="default")
    assert compiled is not net and unwrap(compiled) is net and net.model is model
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        out, grads = seeded_step(compiled, image, text, keys)
        again, _ = seeded_step(compiled, image, text, keys)
        frames = dict(torch._dynamo.utils.counters["frames"])
        stats = dict(torch._dynamo.utils.counters["stats"])
    finally:
        torch._dynamo.reset()
    assert frames["ok"] == frames["total"] and stats["unique_graphs"] == 1, (frames, stats)
    for key in LOSSES:
        assert torch.equal(again[key], out[key]), key
    for key in (*LOSSES, "hardness"):
        torch.testing.assert_close(out[key], eager[key], rtol=1e-4, atol=1e-5, msg=named(key))
    assert grads.keys() == eager_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-3, atol=1e-5, msg=named(name))


# ----------------------------------------------------------------------------- gradient checkpointing


def test_checkpointed_step_equals_the_plain_step(tokenizer, tmp_path):
    """grad_checkpointing on the device: with dropout and drop_path on (the recompute must replay the
    device's random numbers), the step's losses and gradients are the plain step's; every layer runs
    twice. Bitwise on the CPU; on CUDA up to the order of atomic adds in some backward kernels."""
    with open(os.path.join(ROOT, "configs/tiny/config_bert.json")) as f:
        bert = json.load(f)
    bert.update(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    bert_path = tmp_path / "config_bert.json"
    bert_path.write_text(json.dumps(bert))
    image, text, keys = (x.to(DEV) for x in pairs(tokenizer))
    results = {}
    for on in (False, True):
        model = model_on(DEV, tokenizer, bert_config=str(bert_path), vision_drop_path=0.1,
                         grad_checkpointing=on).train()
        calls: Counter = Counter()
        for name, module in model.named_modules():
            if isinstance(module, (Block, BertLayer)):
                module.register_forward_pre_hook(lambda *_, name=name, calls=calls: calls.update([name]))
        results[on] = (*seeded_step(model, image, text, keys), calls)
    (losses, grads, calls), (losses_c, grads_c, calls_c) = results[False], results[True]
    assert calls and calls_c == Counter({name: 2 * n for name, n in calls.items()})
    assert grads.keys() == grads_c.keys() and grads
    if not ON_CUDA:
        for key in LOSSES:
            torch.testing.assert_close(losses_c[key], losses[key], rtol=0, atol=0, msg=named(key))
        for name in grads:
            torch.testing.assert_close(grads_c[name], grads[name], rtol=0, atol=0, msg=named(name))
        return
    # On CUDA the backward's atomic adds (index_select's index_add_, attention) sum in a new order on
    # every run, so even two plain steps differ; elementwise tolerances failed on a parameter that sums
    # over the batch (visual_encoder.cls_token, H200, 2026-11-28). A recompute with other dropout masks
    # moves every gradient by a large share of its norm; rounding moves it by about 1e-7 of it. So each
    # tensor's relative distance is held to 1e-4, and a second plain step's distance is reported beside it.
    again = seeded_step(model_on(DEV, tokenizer, bert_config=str(bert_path), vision_drop_path=0.1).train(),
                        image, text, keys)[1]
    for key in LOSSES:
        torch.testing.assert_close(losses_c[key], losses[key], rtol=1e-5, atol=1e-7, msg=named(key))
    far = {name: (relative_distance(grads_c[name], grads[name]), relative_distance(again[name], grads[name]))
           for name in grads}
    assert all(c <= 1e-4 for c, _ in far.values()), {
        name: f"checkpointed {c:.2e}, second plain step {p:.2e}" for name, (c, p) in far.items() if c > 1e-4}


# ----------------------------------------------------------------------------- NCCL


@cuda_only
def test_nccl_group_of_one():
    """An NCCL process group as init_distributed makes it (device_id: eager communicator): all_reduce and
    all_gather give the expected values, and so do the trainer's metric reductions through it."""
    if not dist.is_nccl_available():
        pytest.fail("this torch build has no NCCL")
    cuda = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=cuda)
    try:
        assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
        x = torch.arange(6, dtype=torch.float32, device=cuda)
        summed = x.clone()
        dist.all_reduce(summed)
        assert torch.equal(summed, x)
        largest = torch.tensor([3, -1], device=cuda)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        assert largest.tolist() == [3, -1]
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x * 2)
        assert torch.equal(parts[0], x * 2)
        gathered = torch.empty(6, device=cuda)
        dist.all_gather_into_tensor(gathered, x + 1)
        assert torch.equal(gathered, x + 1)
        # reduce_sum moves a CPU tensor to the rank's GPU for NCCL; all_reduce_mean syncs once
        total = reduce_sum(torch.tensor([1.5, 2.0]))
        assert total.device.type == "cuda" and total.tolist() == [1.5, 2.0]
        assert all_reduce_mean({"a": torch.tensor(2.5, device=cuda), "b": 4.0}) == {"a": 2.5, "b": 4.0}
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- GRIT on the device

DIM = 16
GRIT = dict(queue_size=160, search_space=80, seed=0, batch_size=N, dim=DIM)  # M > 64: two-level argmax


def dyadic_features(D: int, clusters: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Clustered image and text features (D, DIM) on a grid of 1/8 with |x| <= 4: every dot product, in
    any summation order, is exact in float32 (TF32 too), so the chains cannot differ by rounding, and a
    tie, should one occur, goes to the lowest index on both devices."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(clusters, DIM, generator=g)
    image = centres[torch.randint(0, clusters, (D,), generator=g)] + 0.6 * torch.randn(D, DIM, generator=g)
    text = image + 0.3 * torch.randn(D, DIM, generator=g)
    return tuple(torch.round(F.normalize(x, dim=-1) * 32) / 8 for x in (image, text))


def grit_epochs(sampler: GritSampler, feats, epochs: range, stop_after: int | None = None) -> list:
    """Train-loop use of the sampler (collect after every step, on its device): the next-epoch arrays."""
    image, text = feats
    arrays = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(sampler)))
        for k, idx in enumerate(order.split(N)):
            if stop_after is not None and epoch == epochs[-1] and k == stop_after:
                return arrays
            valid = idx % 23 != 7  # a few bad samples: left out of the grouping, back next epoch
            sampler.collect(*(x.to(sampler.device) for x in (image[idx], text[idx], idx, valid)))
        sampler.end_epoch()
        arrays.append(sampler.state_dict()["indices"])
    return arrays


def test_grit_collector_and_grouping_on_the_device_equal_the_cpu():
    """GritSampler with its queues and grouping on the device deals the CPU's next-epoch batches, index
    for index, also after a mid-epoch save on the device and a resume from it."""
    D = 403  # not a multiple of N; 2 full queue fills and a partial one per epoch
    feats = dyadic_features(D)
    cpu = grit_epochs(GritSampler(D, device="cpu", **GRIT), feats, range(3))
    sampler = GritSampler(D, device=DEV, **GRIT)
    assert sampler.collector.device.type == DEV.type
    on_device = grit_epochs(sampler, feats, range(3))
    assert len(cpu) == len(on_device) == 3
    for a, b in zip(cpu, on_device):
        assert a.numel() == D // N * N and torch.equal(a, b)
    assert not torch.equal(cpu[0], cpu[1])

    interrupted = GritSampler(D, device=DEV, **GRIT)
    grit_epochs(interrupted, feats, range(2), stop_after=27)  # epoch 1, past its first queue fill
    assert interrupted.collector.ptr > 0 and interrupted.collector.partial_groups().numel() > 0
    resumed = GritSampler(D, device=DEV, **GRIT)
    resumed.load_state_dict(interrupted.state_dict())  # queues and partial G back onto the device
    after = grit_epochs(resumed, feats, range(1, 3))  # set_epoch(1) goes on at the saved batch
    assert len(after) == 2 and all(torch.equal(a, b) for a, b in zip(after, cpu[1:]))


# ----------------------------------------------------------------------------- bad samples


def test_bad_sample_mask_on_the_device(tokenizer, monkeypatch):
    """A batch with one bad sample, its mask sent as the training step sends it (Batch.valid_on): the
    device's losses equal the CPU's with the same weights and inputs, and the losses of the batch without
    that sample; the bad sample's input gets no gradient."""
    images, text, keys = pairs(tokenizer)
    valid = torch.ones(N, dtype=torch.bool)
    valid[3] = False
    images[3] = 0.0  # a placeholder's blank image
    keep = valid.nonzero().squeeze(1)
    cpu_model, model = model_on("cpu", tokenizer), model_on(DEV, tokenizer)
    # Fixed MLM masks (the devices draw different random numbers): the full batch's, and its kept rows.
    masked, labels = mask_tokens(text["input_ids"], model.vocab_size, model.mask_token_id, model.special_ids,
                                 0.5, torch.Generator().manual_seed(3))
    fixed = {N: (masked, labels), len(keep): (masked[keep], labels[keep])}
    monkeypatch.setattr(models.pretrain, "mask_tokens",
                        lambda ids, *a, **k: tuple(t.to(ids.device) for t in fixed[ids.shape[0]]))
    batch = ImageTextBatch(image=images, text=text, ids=keys, valid=valid, reasons=["3: unreadable image"])
    assert batch.valid_on(DEV).device.type == DEV.type

    on_cpu = WithObjectives(cpu_model)(images, text, image_key=keys, valid=batch.valid_on("cpu"))
    image = images.to(DEV).requires_grad_(True)
    out = WithObjectives(model)(image, text.to(DEV), image_key=keys.to(DEV), valid=batch.valid_on(DEV))
    sum(out[k] for k in LOSSES).backward()  # before the next forward, which clamps temp in place
    assert torch.all(image.grad[3] == 0)
    assert (image.grad[keep].flatten(1).abs().sum(1) > 0).all()
    kept = BatchEncoding({k: v[keep] for k, v in text.items()}).to(DEV)
    reduced = WithObjectives(model)(images[keep].to(DEV), kept, image_key=keys[keep].to(DEV))
    for name in (*LOSSES, "hardness"):
        torch.testing.assert_close(out[name].detach().cpu(), on_cpu[name].detach(), **CLOSE, msg=named(name))
        torch.testing.assert_close(out[name].detach(), reduced[name].detach(), **CLOSE, msg=named(name))
    assert out["loss_cons"] > 0 and out["loss_mlm"] > 0


# ----------------------------------------------------------------------------- save and resume


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> str:
    from dataset.synthetic import ensure_synthetic

    return ensure_synthetic(str(tmp_path_factory.mktemp("gpu_data") / "synthetic"), n=48, seed=3)


def pretrain(data: str, out: str, epochs: int, *flags: str) -> subprocess.CompletedProcess:
    """Pretrain.py on the device: 57 entries, 7 steps an epoch, two GRIT queue fills; deterministic."""
    sets = small_pretrain_sets(data, **{"batching.queue_size": 24, "batching.search_space": 8,
                                        "max_epoch": epochs, "schedular.epochs": 2,
                                        "schedular.warmup_steps": 2, "print_freq": 1000,
                                        "deterministic": "true",
                                        # the pictures' copies of device outputs run on the device too
                                        "batch_pictures": "true"})
    # cuBLAS repeats its results only with this workspace setting (torch's reproducibility notes);
    # `deterministic: true` alone only warns about it.
    # child_env keeps a PYTHONPATH the machine already has (a GPU image's packages may come through it).
    env = {**child_env(threads=1), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "Pretrain.py", "--config", "configs/tiny/Pretrain.yaml",
                           "--output_dir", out, "--device", DEVICE, *flags, "--set", *sets],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_save_and_resume_on_the_device_equals_the_unbroken_run(synthetic, tmp_path):
    """Two epochs on the device, and one epoch then --resume for the second: the second epoch's log
    record, the final weights and GRIT's next-epoch batches are the unbroken run's."""
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    pretrain(synthetic, full, 2)
    pretrain(synthetic, split, 1)
    resumed = pretrain(synthetic, split, 2, "--resume")
    assert "resumed from" in resumed.stdout

    def records(out: str) -> list[dict]:
        with open(os.path.join(out, "log.txt")) as f:
            return [json.loads(line) for line in f]

    a, b = records(full), records(split)
    assert [r["epoch"] for r in a] == [r["epoch"] for r in b] == [0, 1]
    assert a[1]["step"] == b[1]["step"] == 14 and a[1]["lr"] == b[1]["lr"]
    # Bitwise on the CPU. On CUDA deterministic kernels make the runs repeat, but torch only warns about
    # an op without a deterministic kernel (warn_only), so equal up to float32 rounding.
    tol = dict(rel=1e-5, abs=1e-7) if ON_CUDA else dict(rel=0, abs=0)
    for key in (*LOSSES, "hardness"):
        assert b[1][key] == pytest.approx(a[1][key], **tol), key
    first, second = (torch.load(os.path.join(out, "checkpoint_01.pth"), map_location="cpu",
                                weights_only=True) for out in (full, split))
    assert torch.equal(first["sampler"]["indices"], second["sampler"]["indices"])
    for name, value in first["model"].items():
        torch.testing.assert_close(second["model"][name], value, rtol=0, atol=1e-6 if ON_CUDA else 0,
                                   msg=named(name))
