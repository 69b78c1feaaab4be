"""Time scaled_dot_product_attention's backends at the four attention shapes of the pre-training step and
print one JSON object.

    python -m tools.attention_bench [--config configs/Pretrain.yaml] [--batch_size 128] [--device cuda] \
        [--dtype bf16] [--repeats 20] [--output_dir DIR]

The shapes, from the config (B = --batch_size, L = max_tokens, N = 1 + (image_res / patch_size)^2 image
tokens, heads and head width of the ViT and of bert_config), as the step with share_image_kv runs them:
  vit_self     ViT self-attention                q, k, v (B, Hv, N, dv), no mask
  text_self    text self-attention               (2B, H, L, d), additive padding mask: the plain and the
                                                 masked captions in one pass
  fusion_self  fusion self-attention             (4B, H, L, d), the mask: ITM's 3B pairs and MLM's B captions
  cross        fusion cross-attention            q (4B, H, L, d), keys and values (4B, H, N, d) gathered
                                                 from the B images, no mask
The captions' lengths are drawn uniformly from [L/3, L] (padding masked). Each backend of
torch.nn.attention.sdpa_kernel (math, efficient, flash, cudnn) and torch's own choice ('auto') runs forward
and backward; the best of --repeats timed calls after two warm-ups is reported with its TFLOP/s (torch's
SDPA FLOP formulas; a masked or padded token counts as computed). A backend that refuses a shape is listed
with torch's reason.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import flop_counter

from tools.cli import add_config_args, add_output_dir, emit_record, resolve_device, tool_config, tool_parser
from training.cli import Parser, run_main

__all__ = ["BACKENDS", "attention_shapes", "build_parser", "main", "time_backend"]

BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "auto": None}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attention_shapes(config, batch: int) -> dict[str, dict]:
    """The four attention calls of the step: {name: {q, kv (shapes (B,heads,len,width)), masked}}."""
    from models.bert import load_bert_config

    bert = load_bert_config(config.bert_config)
    heads, width = bert.num_attention_heads, bert.hidden_size // bert.num_attention_heads
    vit_heads, vit_width = config.vision_heads, config.vision_width // config.vision_heads
    tokens, image = config.max_tokens, 1 + (config.image_res // config.patch_size) ** 2
    text = (heads, tokens, width)
    return {
        "vit_self": {"q": (batch, vit_heads, image, vit_width), "kv": (batch, vit_heads, image, vit_width),
                     "masked": False},
        "text_self": {"q": (2 * batch, *text), "kv": (2 * batch, *text), "masked": True},
        "fusion_self": {"q": (4 * batch, *text), "kv": (4 * batch, *text), "masked": True},
        "cross": {"q": (4 * batch, *text), "kv": (4 * batch, heads, image, width), "masked": False},
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 backend: SDPBackend | None, repeats: int) -> dict:
    """Best seconds of forward + backward of one SDPA call on (q, k, v, mask) with `backend` (None: torch's
    choice) -> {'seconds', 'tflops'} or {'error'} when the backend refuses."""
    device = q.device
    flops = (flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)
             + flop_counter.sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape))
    grad = torch.randn_like(q)

    def call() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.backward(grad)

    context = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
    try:
        with context, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")  # torch warns each refusing kernel's reason
            for _ in range(2):
                call()
            best = float("inf")
            for _ in range(repeats):
                _sync(device)
                start = time.perf_counter()
                call()
                _sync(device)
                best = min(best, time.perf_counter() - start)
    except RuntimeError as e:  # "No available kernel...", after a warning with each kernel's reason
        reasons = [str(w.message).splitlines()[0][:200] for w in warned if "kernel" in str(w.message).lower()]
        return {"error": str(e).splitlines()[0][:200], "reasons": reasons[:4]}
    return {"seconds": best, "tflops": flops / best / 1e12}


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser("tools.attention_bench", __doc__.splitlines()[0])
    add_config_args(p, "the pre-training YAML config whose attention shapes are timed (default: "
                       "configs/Pretrain.yaml)", required=False)
    p.add_argument("--batch_size", type=int, default=128, help="B, the per-GPU batch (default: 128)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="q, k, v and mask dtype (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per backend and shape (default: 20)")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated, of {', '.join(BACKENDS)} (default: all)")
    add_output_dir(p, "attention_bench.json (the printed record)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Time every backend at every shape; print (and with --output_dir write) one JSON record."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config = args.config or "configs/Pretrain.yaml"
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    if args.repeats < 1 or args.batch_size < 1:
        parser.error("need --repeats >= 1 and --batch_size >= 1")
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    config = tool_config("pretrain", args)
    g = torch.Generator().manual_seed(0)
    shapes, results = attention_shapes(config, args.batch_size), {}
    for name, shape in shapes.items():
        q, k, v = (torch.randn(s, generator=g).to(device, dtype).requires_grad_()
                   for s in (shape["q"], shape["kv"], shape["kv"]))
        mask = None
        if shape["masked"]:
            rows, tokens = shape["kv"][0], shape["kv"][2]
            lengths = torch.randint(max(1, tokens // 3), tokens + 1, (rows,), generator=g)
            keep = torch.arange(tokens)[None, :] < lengths[:, None]
            mask = torch.zeros(rows, 1, 1, tokens).masked_fill(~keep[:, None, None, :], float("-inf"))
            mask = mask.to(device, dtype)
        results[name] = {"q": list(shape["q"]), "kv": list(shape["kv"]), "masked": shape["masked"],
                         **{b: time_backend(q, k, v, mask, BACKENDS[b], args.repeats) for b in backends}}
        del q, k, v, mask
    record = {"config": args.config, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
              "batch_size": args.batch_size, "repeats": args.repeats,
              "timing": "best of repeats, forward + backward of one scaled_dot_product_attention call",
              "shapes": results}
    return emit_record(record, args.output_dir, "attention_bench")


if __name__ == "__main__":
    run_main(main)
