"""What the step benchmark measures with: a synthetic pre-training batch, Pretrain.py's forward and loss,
the FLOPs of one step (torch's FlopCounterMode, the CPU attention kernel added), the device's practical
matmul peak, its name, and the synchronisation a timer needs (tools.step_bench runs the variants and
times them; tools.gpu_check reuses it; tools.efficiency counts each arm's step with it)."""

from __future__ import annotations

import dataclasses
import time

import torch

from training.config import PretrainConfig

__all__ = ["count_flops", "device_name", "forward_loss", "matmul_peak", "step_flops_per_sample", "sync",
           "synthetic_batch"]


def synthetic_batch(config: PretrainConfig, tokenizer, batch_size: int, device: torch.device, seed: int = 0):
    """(image (B,3,R,R), {'input_ids','attention_mask'} (B,L), image_key (B,)): random, no padding."""
    g = torch.Generator().manual_seed(seed)
    res, length = config.image_res, config.max_tokens
    image = torch.randn(batch_size, 3, res, res, generator=g)
    special = torch.tensor(tokenizer.all_special_ids)
    words = torch.arange(len(tokenizer))
    words = words[~torch.isin(words, special)]
    ids = words[torch.randint(len(words), (batch_size, length), generator=g)]
    ids[:, 0], ids[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    text = {'input_ids': ids.to(device), 'attention_mask': torch.ones_like(ids).to(device)}
    return image.to(device), text, torch.arange(batch_size, device=device)


def forward_loss(model, batch, device: torch.device, dtype: torch.dtype | None) -> dict:
    """Pretrain.py's forward and losses under autocast(dtype) (None: fp32): `model` is ALBEF_Base in
    models.losses.WithObjectives (possibly compiled; a bare ALBEF_Base is wrapped here) -> its outputs,
    losses and 'loss', their sum."""
    from models.losses import WithObjectives

    if hasattr(model, 'objectives'):
        model = WithObjectives(model)
    image, text, image_key = batch
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        return model(image, text, image_key=image_key)


def count_flops(model, batch, device: torch.device, dtype: torch.dtype | None) -> tuple[int, dict]:
    """FlopCounterMode over one forward + backward -> (total FLOPs, {op: FLOPs}).

    torch counts the CUDA attention kernels but not the CPU one; it is added with torch's own formulas
    (as for flash attention on CUDA: the backward includes the recomputed scores).
    """
    from torch.utils import flop_counter

    aten = torch.ops.aten  # FlopCounterMode passes shapes
    cpu_attention = {
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, **kwargs: flop_counter.sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda grad, q, k, v, *args, **kwargs: flop_counter.sdpa_backward_flop_count(grad, q, k, v)}
    counter = flop_counter.FlopCounterMode(display=False, custom_mapping=cpu_attention)
    with counter:
        forward_loss(model, batch, device, dtype)['loss'].backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops(), {str(op): n for op, n in counter.get_flop_counts()['Global'].items()}


def step_flops_per_sample(config: PretrainConfig) -> float:
    """Executed FLOPs per sample of one pre-training step (forward + backward, count_flops) of the config's
    model with random weights, on the CPU, on a synthetic batch of its batch_size at max_tokens (the longest
    a batch gets), as tools.step_bench counts them; image_token_drop counted as the config sets it."""
    from models.pretrain import ALBEF_Base
    from models.tokenization import build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(config)
    model = ALBEF_Base(dataclasses.replace(config, vision_init=None, text_encoder=None), tokenizer).train()
    batch = synthetic_batch(config, tokenizer, config.batch_size, torch.device('cpu'))
    return count_flops(model, batch, torch.device('cpu'), None)[0] / config.batch_size


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a timer reads the work's end."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype, sizes: list[int], repeats: int = 3) -> float:
    """Best FLOP/s of an (n x n) by (n x n) product, torch.mm or F.linear, over sizes and repeats (after
    one warm-up per size and op).

    F.linear is the op nn.Linear runs; on CPUs without native bf16 it has a fast bf16 kernel (oneDNN)
    where torch.mm has none (2 against 15 GFLOP/s on one EPYC thread), so a torch.mm peak alone would put
    a bf16 model's MFU above 1.
    """
    reps = 50 if device.type == 'cuda' else 1  # one CUDA mm is too short to time alone
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        c = torch.mm(a, b)
        for op, kwargs in ((torch.mm, {'out': c}), (torch.nn.functional.linear, {})):
            op(a, b, **kwargs)
            for _ in range(repeats):
                sync(device)
                t0 = time.perf_counter()
                for _ in range(reps):
                    op(a, b, **kwargs)
                sync(device)
                best = max(best, reps * 2 * n ** 3 / (time.perf_counter() - t0))
        del a, b, c
    return best


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo."""
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    try:
        with open('/proc/cpuinfo', encoding='utf-8') as f:
            return next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    except (OSError, StopIteration):
        return 'cpu'
