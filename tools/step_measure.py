"""What the step benchmark measures with: a synthetic pre-training batch, Pretrain.py's forward and loss,
the FLOPs of one step (torch's FlopCounterMode, the CPU attention kernel added), the device's practical
matmul peak, its name, and the synchronisation a timer needs (tools.step_bench runs the variants and
times them; tools.gpu_check reuses it; tools.efficiency counts each arm's step with it)."""

from __future__ import annotations

import dataclasses
import time

import torch

from training.config import PretrainConfig
from training.flops import flop_counter_mode

__all__ = ["count_flops", "device_name", "equal_compute_epochs", "forward_loss", "matmul_peak",
           "random_model", "selection_flops_per_candidate", "step_flops_per_sample", "sync",
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
    """FlopCounterMode over one forward + backward -> (total FLOPs, {op: FLOPs}); the CPU attention kernel
    counted too (training.flops)."""
    counter = flop_counter_mode()
    with counter:
        forward_loss(model, batch, device, dtype)['loss'].backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops(), {str(op): n for op, n in counter.get_flop_counts()['Global'].items()}


def random_model(config: PretrainConfig, tokenizer, **changes):
    """The config's ALBEF_Base with random weights (nothing read or downloaded: no ViT or BERT weights, no
    synthetic ViT trained first), `changes` applied to the config; in train mode, on the CPU."""
    from models.pretrain import ALBEF_Base

    return ALBEF_Base(dataclasses.replace(config, vision_init=None, text_encoder=None, **changes),
                      tokenizer).train()


def step_flops_per_sample(config: PretrainConfig, tokenizer=None) -> float:
    """Executed FLOPs per sample of one pre-training step (forward + backward, count_flops) of the config's
    model with random weights, on the CPU, on a synthetic batch of its batch_size at max_tokens (the longest
    a batch gets), as tools.step_bench counts them; image_token_drop counted as the config sets it. tokenizer:
    the config's (build_tokenizer) when None."""
    from models.tokenization import build_tokenizer

    torch.manual_seed(0)
    tokenizer = tokenizer or build_tokenizer(config)
    model = random_model(config, tokenizer)
    batch = synthetic_batch(config, tokenizer, config.batch_size, torch.device('cpu'))
    return count_flops(model, batch, torch.device('cpu'), None)[0] / config.batch_size


def selection_flops_per_candidate(config: PretrainConfig, tokenizer=None) -> float:
    """Executed FLOPs per candidate of online selection's scoring by one model (ALBEF_Base.contrastive_logits:
    the uni-modal encoders, no grad, every image token), counted as step_flops_per_sample counts the step:
    random weights, the CPU, a synthetic batch of batch_size at max_tokens; tokenizer as there."""
    from transformers import BatchEncoding

    from models.tokenization import build_tokenizer

    torch.manual_seed(0)
    tokenizer = tokenizer or build_tokenizer(config)
    model = random_model(config, tokenizer)
    image, text, _ = synthetic_batch(config, tokenizer, config.batch_size, torch.device('cpu'))
    counter = flop_counter_mode()
    with counter:
        model.contrastive_logits(image, BatchEncoding(text))
    return counter.get_total_flops() / config.batch_size


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


def equal_compute_epochs(config: PretrainConfig, dataset_len: int, base_epochs: int, super_batch: int,
                         scorers: int) -> tuple[int, dict]:
    """The epochs of an online selection run (super_batch k, `scorers` scoring forwards per candidate: 2
    with a reference model, 1 without) whose executed FLOPs are at most those of `base_epochs` epochs of
    plain batches of the config's size on `dataset_len` examples, one process -> (epochs, the counts).

    A plain epoch is D // N steps of N x f_train; an online one D // (k N) steps of N x f_train + scorers x
    k N x f_score (step_flops_per_sample, selection_flops_per_candidate). Rounded down: never more compute."""
    N = config.batch_size
    train = step_flops_per_sample(config)
    score = selection_flops_per_candidate(config)
    plain = dataset_len // N * N * train
    online = dataset_len // (super_batch * N) * (N * train + scorers * super_batch * N * score)
    epochs = int(base_epochs * plain // online)
    return epochs, {'train_flops_per_sample': train, 'score_flops_per_candidate': score,
                    'plain_epoch_flops': plain, 'online_epoch_flops': online, 'base_epochs': base_epochs,
                    'epochs': epochs, 'compute_ratio': epochs * online / (base_epochs * plain)}
