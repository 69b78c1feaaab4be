"""Time full pre-training steps of ALBEF_Base (forward, backward, AdamW) and print one JSON object.

    python -m tools.step_bench --config configs/Pretrain.yaml --batch_size 64 --steps 10 --warmup 3 \
        --device cuda --variants default,bf16,bf16+albef,bf16+compile+cudagraphs [--output_dir DIR] \
        [--set key=value ...]

A step is Pretrain.py's: forward of ALBEF_Base on (image, text, image_key), loss = the sum of the four
losses, zero_grad, backward, gradient clipping when the config sets clip_grad, AdamW step (and the ITC
temperature's clamp after it). The model has random weights (text_encoder and vision_init are ignored) and
the batch is synthetic: B random images at image_res and B random token sequences of max_tokens ids, no
padding (the longest a batch gets). K steps are timed after W warm-up steps, with the device synchronised
only before and after the K steps.

A variant is the set of switches its name joins with '+' ('default': none; 'bf16_compile' is bf16+compile).
Each runs in a fresh subprocess (the tool re-invokes itself with --one_variant), so that on CPU the peak RSS
(ru_maxrss, which never resets) is that variant's own. The switches:
  bf16                torch.autocast(device, bfloat16) around the forward and the loss
  grad_checkpointing  config key grad_checkpointing: true (the JSON says whether the model acted on it)
  compile             torch.compile(model); the first step (compilation) is timed apart as compile_seconds
  cudagraphs          compile in mode 'reduce-overhead' (CUDA graphs; compile implied)
  albef               ALBEF's step: every change below off
  no_share_image_kv   share_image_kv: false (each fusion layer's image keys and values once per row)
  no_fused_qkv        fused_qkv: false (separate query, key and value products)
  no_mlm_masked_only  mlm_masked_only: false (MLM vocabulary logits at every position)
  no_itm_cls_only     itm_cls_only: false (the last fusion layer at every position of ITM's pairs)
  no_share_caption_attention  share_caption_attention: false (the first fusion layer's self-attention once
                      per ITM pair, not once per caption)
  fp32_layer_norm     amp_layer_norm: float32 (torch's autocast default; acts only with bf16)
  drop50, drop75      image_token_drop: 0.5 / 0.75 (FLIP's image-token dropout: half / a quarter of each
                      image's patch tokens kept)
FLOPs are counted with torch.utils.flop_counter.FlopCounterMode over one step's forward + backward: the
variant's own (executed FLOPs; a checkpointed model's recomputed forward included) and ALBEF_Base's step as
the paper defines it (model FLOPs: the albef step without checkpointing, 241.0 GFLOP per sample at the
paper's sizes), so that removed work shows as a gain. matmul_peak_flops is the best FLOP/s of large square
products (torch.mm and F.linear, the op nn.Linear runs) in the same process, device and dtype (the
practical peak); mfu = model FLOPs per second / matmul_peak_flops (null for a step that drops image
tokens: it does less than the paper's step per sample), mfu_executed the same with the executed FLOPs.
The JSON object is also written to DIR/step_bench.json with --output_dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from collections.abc import Sequence

import torch

from tools.cli import add_config_args, add_output_dir, emit_record, tool_config, tool_parser
from tools.step_bench_runs import alternate, spawn_variant
from tools.step_measure import (
    count_flops,
    device_name,
    forward_loss,
    matmul_peak,
    random_model,
    sync,
    synthetic_batch,
)
from training.cli import Parser, run_main
from training.config import PretrainConfig
from training.reporting import peak_memory_bytes

# The switches a variant name joins with '+', and the names kept for the variants they stood for.
# Image-token dropout's rates (issue 51): what the step costs with FLIP's masking, beside the speed changes.
DROPS = {'drop50': 0.5, 'drop75': 0.75}
SWITCHES = ('bf16', 'grad_checkpointing', 'compile', 'cudagraphs', 'albef', 'no_share_image_kv',
            'no_fused_qkv', 'no_mlm_masked_only', 'no_itm_cls_only', 'no_share_caption_attention',
            'fp32_layer_norm', *DROPS)
ALIASES = {'default': '', 'bf16_compile': 'bf16+compile'}
# Each speed change of the step (docs/speed-and-scale.md) as the config keys that turn it off.
CHANGES_OFF: dict[str, dict] = {
    'no_share_image_kv': {'share_image_kv': False}, 'no_fused_qkv': {'fused_qkv': False},
    'no_mlm_masked_only': {'mlm_masked_only': False}, 'no_itm_cls_only': {'itm_cls_only': False},
    'no_share_caption_attention': {'share_caption_attention': False},
    'fp32_layer_norm': {'amp_layer_norm': 'float32'},
}
DEFAULT_VARIANTS = ('default', 'bf16', 'grad_checkpointing', 'compile')


def variant_switches(name: str) -> frozenset[str]:
    """The switches of variant `name` ('bf16+compile', an alias such as 'default'); ValueError if unknown."""
    parts = frozenset(p for p in ALIASES.get(name, name).split('+') if p)
    unknown = sorted(parts - set(SWITCHES))
    if unknown or not (parts or name in ALIASES):
        raise ValueError(f'variant {name!r}: unknown switch(es) {unknown or [name]}')
    return parts | ({'compile'} if 'cudagraphs' in parts else set())


def load_bench_config(args: argparse.Namespace, variant: str = 'default') -> PretrainConfig:
    """The typed pre-training config of --config and --set, with the variant's keys set (grad_checkpointing,
    the changes it turns off). No data is read: its paths need not exist."""
    switches = variant_switches(variant)
    config = tool_config('pretrain', args)
    changes = {}
    for name, keys in CHANGES_OFF.items():
        if name in switches or 'albef' in switches:
            changes.update(keys)
    if 'grad_checkpointing' in switches:
        changes['grad_checkpointing'] = True
    drops = [rate for name, rate in DROPS.items() if name in switches]
    if len(drops) > 1:
        raise ValueError(f'variant {variant!r}: one image-token dropout rate at a time ({", ".join(DROPS)})')
    if drops:
        changes['image_token_drop'] = drops[0]
    return dataclasses.replace(config, **changes)


def build_bench_tokenizer(config: PretrainConfig, workdir: str):
    """(tokenizer, note): the config's vocab_file, a local text_encoder tokenizer, else a built vocab.

    The fallback is a word-level vocab.txt of the bert_config's vocab size (BERT's 5 special tokens, then
    w5, w6, ...) written under workdir: the model's shapes are those of the real vocabulary.
    """
    from transformers import BertTokenizerFast

    from models.bert import load_bert_config
    from models.tokenization import tokenizer_from_vocab

    if config.vocab_file:
        return tokenizer_from_vocab(config.vocab_file), f"vocab_file {config.vocab_file}"
    name, why = config.text_encoder, 'no text_encoder'
    if name:
        try:
            return BertTokenizerFast.from_pretrained(name, local_files_only=True), f'text_encoder {name}'
        except Exception as e:  # noqa: BLE001 (not on disk, or unreadable: the built vocab has its size)
            why = f'text_encoder {name!r} has no local tokenizer ({type(e).__name__})'
    size = load_bert_config(config.bert_config).vocab_size
    words = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + [f'w{i}' for i in range(5, size)]
    path = os.path.join(workdir, 'vocab.txt')
    with open(path, 'w', encoding='utf-8') as f:
        f.write('\n'.join(words) + '\n')
    return (BertTokenizerFast(vocab_file=path, do_lower_case=True),
            f'built word-level vocab of {size} tokens, the bert_config vocab_size ({why})')


def run_variant(args: argparse.Namespace, variant: str) -> dict:
    """Build, warm up, time and count one variant in this process -> its JSON fields."""
    from models.losses import WithObjectives
    from training.optimizer import build_optimizer

    device = torch.device(args.device)
    switches = variant_switches(variant)
    dtype = torch.bfloat16 if 'bf16' in switches else None
    torch.manual_seed(args.seed)
    config = load_bench_config(args, variant)
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer, vocab_note = build_bench_tokenizer(config, workdir)
    batch = synthetic_batch(config, tokenizer, args.batch_size, device, args.seed)
    baseline_rss = peak_memory_bytes(torch.device("cpu"))
    model = random_model(config, tokenizer).to(device)  # random weights: nothing to download or read
    optimizer = build_optimizer(model, config.optimizer)
    clip = config.clip_grad
    fields = {'tokenizer': vocab_note, 'vocab_size': len(tokenizer),
              'optimizer': f"{type(optimizer).__name__} fused={optimizer.defaults.get('fused')}",
              'parameters': sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if 'grad_checkpointing' in switches:
        fields['model_grad_checkpointing'] = any(
            bool(getattr(m, a, False)) for m in model.modules()
            for a in ('grad_checkpointing', 'gradient_checkpointing'))
    compiled, graphs = 'compile' in switches, 'cudagraphs' in switches
    # Pretrain.py's step: the model and its objectives in one forward, compiled together (as the trainer).
    net = WithObjectives(model)
    net = torch.compile(net, mode='reduce-overhead' if graphs else None) if compiled else net

    def step() -> dict:
        if graphs:  # the last step's outputs may be overwritten (training.trainer does the same)
            torch.compiler.cudagraph_mark_step_begin()
        out = forward_loss(net, batch, device, dtype)
        optimizer.zero_grad(set_to_none=True)
        out['loss'].backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
        optimizer.step()
        return out

    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
    warmup = max(args.warmup, 1 if compiled else 0)
    for i in range(warmup):
        t0 = time.perf_counter()
        step()
        if i == 0:
            sync(device)
            fields['compile_seconds' if compiled else 'first_step_seconds'] = round(
                time.perf_counter() - t0, 4)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = step()
    sync(device)
    seconds = (time.perf_counter() - t0) / args.steps
    fields['peak_memory_bytes'] = peak_memory_bytes(device)
    if device.type != 'cuda':
        fields['baseline_rss_bytes'] = baseline_rss  # Python + torch + the batch, before the model
    losses = {k: float(out[k].detach()) for k in (*model.objectives.loss_names, 'loss')}

    flops, by_op = count_flops(model, batch, device, dtype)  # eager, also for compile
    peak = matmul_peak(device, dtype or torch.float32, args.peak_sizes)
    samples_per_s = args.batch_size / seconds
    achieved = flops / args.batch_size * samples_per_s
    return {
        'samples_per_s': samples_per_s, 'step_seconds': seconds, 'warmup_steps': warmup,
        'flops_per_step': flops, 'flops_per_sample': flops / args.batch_size,
        'flops_share_by_op': {k: round(v / flops, 4) for k, v in by_op.items()} if flops else {},
        'achieved_flops': achieved, 'matmul_peak_flops': peak, 'mfu_executed': achieved / peak,
        'dtype': 'bfloat16 autocast' if dtype else 'float32', 'losses': losses,
        'threads': torch.get_num_threads(), 'config_changes': changed_keys(config, args),
        'image_token_drop': config.image_token_drop, **fields,
    }


def changed_keys(config: PretrainConfig, args: argparse.Namespace) -> dict:
    """The step's keys that this variant sets apart from --config and --set (what the variant measures)."""
    base = tool_config('pretrain', args)
    keys = ('grad_checkpointing', 'image_token_drop',
            *sorted({k for keys in CHANGES_OFF.values() for k in keys}))
    return {k: getattr(config, k) for k in keys if getattr(config, k) != getattr(base, k)}


def model_flops(args: argparse.Namespace) -> int:
    """FLOPs of one step of ALBEF_Base as the paper defines it (the albef variant, fp32, no checkpointing),
    on the same synthetic batch: the fixed work that mfu divides by."""

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = load_bench_config(args, 'albef')
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer, _ = build_bench_tokenizer(config, workdir)
    batch = synthetic_batch(config, tokenizer, args.batch_size, device, args.seed)
    # The paper's step sees every image token, whatever --set image_token_drop says.
    model = random_model(config, tokenizer, grad_checkpointing=False, image_token_drop=0.0,
                         unmasked_epochs=0).to(device)
    return count_flops(model, batch, device, None)[0]


def add_model_flops(variants: dict[str, dict], child_argv: list[str], batch_size: int) -> float | None:
    """Add model_flops_per_sample and mfu (model FLOPs per second / peak) to every measured variant, and
    recompute_flops_per_sample to a checkpointed one whose unchecked twin ran; returns the model FLOPs per
    sample (None when they could not be counted). An fp32 or bf16 albef variant's count is ALBEF's step;
    otherwise a child counts it."""
    model = next((v['flops_per_sample'] for name, v in variants.items()
                  if variant_switches(name) - {'bf16'} == {'albef'} and 'flops_per_sample' in v), None)
    if model is None:
        counted = spawn_variant(child_argv, '')
        model = counted['model_flops_per_step'] / batch_size if 'model_flops_per_step' in counted else None
    by_switches = {variant_switches(name): v for name, v in variants.items()}
    for name, v in variants.items():
        if 'samples_per_s' not in v:
            continue
        if model is not None:
            v['model_flops_per_sample'] = model
            # A step that drops image tokens does less than the paper's step per sample: its samples/s times
            # the paper's FLOPs is no utilisation (mfu_executed is its own).
            paper = model * v['samples_per_s'] / v['matmul_peak_flops']
            v['mfu'] = None if v.get('image_token_drop') else paper
        switches = variant_switches(name)
        twin = by_switches.get(switches - {'grad_checkpointing'}, {})
        if 'grad_checkpointing' in switches and 'flops_per_sample' in twin:
            v['recompute_flops_per_sample'] = v['flops_per_sample'] - twin['flops_per_sample']
    return model


def build_parser() -> Parser:
    """The tool's command line."""
    p = tool_parser('tools.step_bench', __doc__.splitlines()[0])
    add_config_args(p, 'the pre-training YAML config whose model and step are timed')
    p.add_argument('--batch_size', type=int, default=None,
                   help='samples per step (default: the config batch_size on a GPU, 8 on the CPU)')
    p.add_argument('--steps', type=int, default=10, help='timed steps (default: 10)')
    p.add_argument('--warmup', type=int, default=3, help='untimed steps before them (default: 3)')
    p.add_argument('--device', default=None, help='cpu | cuda | cuda:N (default: cuda if available)')
    p.add_argument('--variants', default=','.join(DEFAULT_VARIANTS),
                   help='comma-separated, each run in a fresh subprocess; a variant joins switches with + '
                        f'({", ".join(SWITCHES)}) or is one of {", ".join(ALIASES)} (default: '
                        f'{",".join(DEFAULT_VARIANTS)})')
    p.add_argument('--threads', type=int, default=None, help='torch intra-op threads (default: torch\'s)')
    p.add_argument('--peak_sizes', default='2048,4096',
                   help='square matrix sizes for the matmul peak, comma-separated (default: 2048,4096)')
    p.add_argument('--seed', type=int, default=0, help='seed of the weights and the batch (default: 0)')
    add_output_dir(p, 'step_bench.json (the printed record)')
    p.add_argument('--baseline', default=None,
                   help='another checkout of this repository (e.g. a git worktree of an older commit): each '
                        'variant runs there and here in turn, --rounds times, best step time of each side '
                        'and the speedup reported')
    p.add_argument('--rounds', type=int, default=3, help='--baseline: runs per side and variant (default: 3)')
    p.add_argument('--baseline_variant', default=None,
                   help='--baseline: the variant the baseline runs opposite every variant here, e.g. default '
                        'against drop50, a switch the baseline lacks (default: the same variant)')
    p.add_argument('--one_variant', default=None, help=argparse.SUPPRESS)
    p.add_argument('--model_flops', action='store_true', help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The parsed flags, checked, and the argv the variants' subprocesses get (without --output_dir:
    only this process writes)."""
    p = build_parser()
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(',') if v.strip()]
    for name in args.variants:
        try:
            variant_switches(name)
        except ValueError as e:
            p.error(f'{e}; a variant joins switches with + ({", ".join(SWITCHES)}) or is one of '
                    f'{", ".join(ALIASES)}')
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error('need --steps >= 1, --warmup >= 0 and --rounds >= 1')
    if args.baseline_variant is not None and not args.baseline:
        p.error('--baseline_variant needs --baseline')
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, 'tools', 'step_bench.py')):
        p.error(f'--baseline {args.baseline}: not a checkout of this repository (no tools/step_bench.py)')
    try:
        args.peak_sizes = [int(n) for n in args.peak_sizes.split(',')]
    except ValueError:
        p.error(f'--peak_sizes must be comma-separated integers, got {args.peak_sizes!r}')
    args.device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    if args.batch_size is None:
        # The paper's 128 per GPU would take hours and tens of GB per step on a CPU.
        args.batch_size = 8 if torch.device(args.device).type == 'cpu' else load_bench_config(args).batch_size
    # The children get the parsed values (not the spelling the user typed), the batch size included.
    child_argv = ['--config', args.config, '--batch_size', str(args.batch_size), '--steps', str(args.steps),
                  '--warmup', str(args.warmup), '--device', args.device,
                  '--peak_sizes', ','.join(map(str, args.peak_sizes)), '--seed', str(args.seed),
                  *(['--threads', str(args.threads)] if args.threads else []),
                  *(['--set', *args.set] if args.set else [])]
    return args, child_argv


def main(argv: Sequence[str] | None = None) -> dict:
    """Run every variant in its own subprocess and print one JSON object (also returned)."""
    args, child_argv = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one_variant is not None or args.model_flops:
        try:
            result = (run_variant(args, args.one_variant) if args.one_variant is not None
                      else {'model_flops_per_step': model_flops(args)})
        except Exception as e:  # noqa: BLE001 (a failed variant is reported, the others still run)
            result = {'error': f'{type(e).__name__}: {e}'[:800]}
        return emit_record(result, None, 'step_bench')  # to the parent's pipe only

    config = load_bench_config(args)  # a config mistake ends here, before any variant starts
    baseline = None
    if args.baseline:
        variants, baseline = alternate(child_argv, args.variants, args.baseline, args.rounds,
                                       args.baseline_variant)
    else:
        variants = {v: spawn_variant(child_argv, v) for v in args.variants}
    model = add_model_flops(variants, child_argv, args.batch_size)
    device = torch.device(args.device)
    result = {
        'config': args.config, 'overrides': args.set, 'device': str(device),
        'device_name': device_name(device), 'torch': torch.__version__,
        'threads': args.threads or torch.get_num_threads(), 'batch_size': args.batch_size,
        'steps': args.steps, 'warmup': args.warmup, 'image_res': config.image_res,
        'text_tokens': config.max_tokens,
        'float32_matmul_precision': torch.get_float32_matmul_precision(),
        'step': 'forward + sum of 4 losses, zero_grad, backward, clip_grad_norm_ if clip_grad '
                f"({config.clip_grad}), AdamW step; random weights, synthetic batch without padding",
        'flops': 'counted: torch.utils.flop_counter.FlopCounterMode, one step forward + backward '
                 '(matmuls, convolutions and attention, with the CPU flash-attention ops added by torch\'s '
                 'sdpa formulas; elementwise ops, norms, softmax, losses and the optimizer are not counted)',
        'matmul_peak': f'best of 3 torch.mm and 3 F.linear n x n, n in {args.peak_sizes}, same process, '
                       'device, dtype',
        'peak_memory': ('torch.cuda.max_memory_allocated over the warm-up and timed steps'
                        if device.type == 'cuda' else
                        'ru_maxrss of a fresh subprocess per variant, after the timed steps (includes '
                        'Python and torch: baseline_rss_bytes; and compilation for compile)'),
        'model_flops_per_sample': model,
        'model_flops': "ALBEF_Base's step as the paper defines it: the albef variant (share_image_kv, "
                       'fused_qkv, mlm_masked_only, itm_cls_only and share_caption_attention off), fp32, no '
                       'checkpointing, counted the same way; '
                       'mfu divides it per second by matmul_peak_flops, mfu_executed the variant\'s own',
        'variants': variants,
        **({'baseline': baseline} if baseline else {}),
    }
    return emit_record(result, args.output_dir, 'step_bench')


if __name__ == '__main__':
    run_main(main)
