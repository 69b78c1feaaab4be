"""Check the whole GPU path in one command (`make gpu-check`): the GPU-marked tests, the step benchmark at
the paper's sizes, GRIT's grouping cost and a tiny pre-training with zero-shot retrieval on the GPU, into
one JSON report; with --quick, the step's speed in about 9 minutes.

    python -m tools.gpu_check [--output_dir output/gpu_check] [--device cuda]
    python -m tools.gpu_check --quick [--output_dir output/gpu_check_quick] [--batch_size 128]

On a CUDA machine, in order (each part's output in <output_dir>/<part>.txt, a failed part recorded and the
others still run; about 10 minutes on one GPU):
  tests          pytest -m gpu tests/test_gpu.py: bf16 and fp16 autocast with the scaler, fused AdamW,
                 torch.compile, gradient checkpointing, an NCCL group of one, the GRIT collector and
                 grouping against the CPU's, bad-sample masks on the device, save and exact resume
  step_bench     tools.step_bench, configs/Pretrain.yaml (ViT-B/16 at 256 px, BERT-base: 6 text + 6 fusion
                 layers), bf16, with and without gradient checkpointing, at batch 64 and 128: samples/s,
                 MFU, peak memory
  grit_bench     tools.grit_bench on the device at the paper's sizes (L = 48,000, M = 1,920, N = 128, d =
                 256): one queue fill's grouping, as a share of the steps that fill it (L / N steps)
  selection_bench
                 tools.selection_bench: online selection (JEST, RHO-LOSS) at k = 2, 4, 10 and N = 128, its
                 scoring FLOPs' share of the step and its draw timed on the device
  tiny_pretrain  the tiny pre-training (configs/tiny/Pretrain.yaml) on the GPU, then its zero-shot
                 retrieval (configs/tiny/Retrieval.yaml): R@1 and seconds
and the issue-27 targets judged: bf16 MFU >= 0.45, batch 128 with gradient checkpointing under 24 GB,
GRIT collection + grouping <= 1 % of step time. The report (<output_dir>/gpu_check.json) names the device.

--quick (issue 33; the report is rewritten after every part, so a run cut short keeps what it measured):
  step_eager     tools.step_bench at --batch_size (128), bf16: the step as shipped, ALBEF's step (albef),
                 each speed change off alone, gradient checkpointing (its peak memory), and image-token
                 dropout at 0.5 and 0.75 (drop50, drop75: FLIP's masked step)
  step_compiled  the same step compiled (inductor), and compiled with CUDA graphs (reduce-overhead)
  attention      tools.attention_bench: every SDPA backend at the step's four attention shapes
  tests          the GPU-marked tests, as above
and the issue-33 targets judged: MFU in model FLOPs >= 0.40 eager and >= 0.50 compiled, gradient
checkpointing under 24 GB; each change's effect is the step's samples/s over that of the step without it.
It needs only what tools.step_bench and the tests import (torch, timm, transformers < 5, tokenizers,
huggingface_hub, ruamel.yaml, numpy, pillow; wids, webdataset and braceexpand for the tests): on a
machine without a package registry carry them as wheels (docs/speed-and-scale.md, "The GPU check").

Without CUDA it runs the GPU-marked tests anyway, which skip with their reason, prints why nothing else
ran, writes the report with status "skipped" and exits 0 (--quick skips at once); a failed part makes the
exit status 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from tools.cli import emit_record, tool_parser
from tools.runs import last_checkpoint, read_log, read_retrieval
from training.cli import Parser, run_main

__all__ = ["GB", "QUICK_COMPILED", "QUICK_EAGER", "QUICK_TARGETS", "TARGETS", "build_parser", "judge",
           "judge_quick", "main", "pytest_summary", "quick_parts"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1024 ** 3
TINY_PRETRAIN, TINY_RETRIEVAL = 'configs/tiny/Pretrain.yaml', 'configs/tiny/Retrieval.yaml'
TARGETS = {'bf16_mfu_min': 0.45, 'batch128_checkpointed_memory_max_bytes': 24 * GB, 'grit_share_max': 0.01}
# --quick: the step as shipped, ALBEF's, each change of issue 33 off alone, checkpointing; then compiled.
# Each change of issue 33 off alone (its effect: the shipped step's samples/s over this one's).
# itm_cls_only and share_caption_attention (2026-12-03) are off only in bf16+albef: two more variants would
# take step_eager past what a lent machine's minutes allow (tests/test_gpu_check.py bounds the parts).
QUICK_CHANGES_OFF = ('bf16+albef', 'bf16+no_share_image_kv', 'bf16+no_fused_qkv', 'bf16+no_mlm_masked_only',
                     'bf16+fp32_layer_norm')
# Image-token dropout (issue 51): the masked step's speed-up over the shipped one.
QUICK_DROPS = ('bf16+drop50', 'bf16+drop75')
QUICK_EAGER = ('bf16', *QUICK_CHANGES_OFF, 'bf16+grad_checkpointing', *QUICK_DROPS)
QUICK_COMPILED = ('bf16+compile', 'bf16+compile+cudagraphs')
QUICK_TARGETS = {'eager_mfu_min': 0.40, 'compiled_mfu_min': 0.50, 'checkpointed_memory_max_bytes': 24 * GB,
                 'executed_gflop_per_sample_max': 210.0}
# The paper's GRIT sizes (S.M.): queue L, search space M, batch N per GPU, ITC feature width.
GRIT_SIZES = {'queue_size': 48000, 'search_space': 1920, 'batch_size': 128, 'dim': 256}


def _run(name: str, args: list[str], out_dir: str, timeout: int, env: dict | None = None) -> dict:
    """Run `python <args>` in the repository root, its output into out_dir/<name>.txt; status and seconds."""
    log = os.path.join(out_dir, f'{name}.txt')
    start = time.time()
    with open(log, 'w', encoding='utf-8') as f:
        try:
            code = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout, env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = 'timeout'
    return {'status': 'passed' if code == 0 else 'failed', 'exit': code,
            'seconds': round(time.time() - start, 1), 'log': log}


def pytest_summary(text: str) -> dict:
    """Counts from pytest's summary line ('3 passed, 2 skipped in 1.2s') and the -rs skip reasons."""
    counts = {k: int(n) for n, k in re.findall(r'(\d+) (passed|failed|skipped|errors?|xfailed)', text)}
    reasons = sorted(set(re.findall(r'^SKIPPED \[\d+\] [^:]+:\d+: (.*)$', text, flags=re.M)))
    return {**counts, 'skip_reasons': reasons}


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding='utf-8') as f:
        return json.load(f)


def judge(step: dict[str, dict], grit: dict | None) -> dict:
    """The targets against the measurements: each {'value', 'target', 'met'} (None where not measured)."""
    out: dict[str, dict | None] = {}
    bf16 = [v['mfu'] for k, v in step.items()
            if not k.endswith('_checkpointed') and v and v.get('mfu') is not None]
    out['bf16_mfu'] = ({'value': max(bf16), 'target': f">= {TARGETS['bf16_mfu_min']}",
                        'met': max(bf16) >= TARGETS['bf16_mfu_min']} if bf16 else None)
    ckpt = step.get('batch128_checkpointed') or {}
    memory = ckpt.get('peak_memory_bytes')
    out['batch128_checkpointed_memory'] = (
        {'value_gb': round(memory / GB, 2), 'target': '< 24 GB',
         'met': memory < TARGETS['batch128_checkpointed_memory_max_bytes']} if memory else None)
    plain = step.get('batch128') or {}
    if grit and 'collector_fill_s' in grit and plain.get('step_seconds'):
        steps_per_fill = GRIT_SIZES['queue_size'] / GRIT_SIZES['batch_size']
        share = grit['collector_fill_s'] / (steps_per_fill * plain['step_seconds'])
        out['grit_share_of_step_time'] = {'value': round(share, 5), 'target': '<= 0.01',
                                          'met': share <= TARGETS['grit_share_max']}
    else:
        out['grit_share_of_step_time'] = None
    return out


def judge_quick(step: dict[str, dict]) -> dict:
    """--quick's targets against its step benchmark: each {'value', 'target', 'met'} (None where not
    measured), and each change's effect (samples/s of the step as shipped over the step without it)."""
    def mfu(name: str) -> float | None:
        return (step.get(name) or {}).get('mfu')

    out: dict = {}
    eager = mfu('bf16')
    out['eager_mfu'] = None if eager is None else {
        'value': round(eager, 4), 'target': f">= {QUICK_TARGETS['eager_mfu_min']}",
        'met': eager >= QUICK_TARGETS['eager_mfu_min']}
    compiled = [m for m in (mfu(name) for name in QUICK_COMPILED) if m is not None]
    out['compiled_mfu'] = None if not compiled else {
        'value': round(max(compiled), 4), 'target': f">= {QUICK_TARGETS['compiled_mfu_min']}",
        'met': max(compiled) >= QUICK_TARGETS['compiled_mfu_min']}
    memory = (step.get('bf16+grad_checkpointing') or {}).get('peak_memory_bytes')
    out['checkpointed_memory'] = None if memory is None else {
        'value_gb': round(memory / GB, 2), 'target': '< 24 GB',
        'met': memory < QUICK_TARGETS['checkpointed_memory_max_bytes']}
    executed = (step.get('bf16') or {}).get('flops_per_sample')
    out['executed_gflop_per_sample'] = None if executed is None else {
        'value': round(executed / 1e9, 1), 'target': f"<= {QUICK_TARGETS['executed_gflop_per_sample_max']} "
                                                      '(at the paper\'s sizes)',
        'met': executed / 1e9 <= QUICK_TARGETS['executed_gflop_per_sample_max']}
    shipped = (step.get('bf16') or {}).get('samples_per_s')
    def ratio(name: str, inverse: bool = False) -> float | None:
        theirs = (step.get(name) or {}).get('samples_per_s')
        if not (shipped and theirs):
            return None
        return round(theirs / shipped if inverse else shipped / theirs, 3)

    out['effects'] = {name.removeprefix('bf16+'): ratio(name) for name in QUICK_CHANGES_OFF
                      if ratio(name) is not None}
    out['token_drop_speedups'] = {name.removeprefix('bf16+'): ratio(name, inverse=True)
                                  for name in QUICK_DROPS if ratio(name) is not None}
    return out


def quick_parts(args) -> list[tuple[str, list[str], int]]:
    """--quick's parts in order: (name, python arguments, timeout seconds); the step benchmarks' and the
    attention benchmark's records go into <output_dir>/<name>/."""
    out = os.path.abspath(args.output_dir)
    bench = ['--config', args.config, '--batch_size', str(args.batch_size), '--steps', str(args.steps),
             '--warmup', str(args.warmup), '--device', args.device]
    return [
        ('step_eager', ['-m', 'tools.step_bench', *bench, '--variants', ','.join(QUICK_EAGER),
                        '--output_dir', os.path.join(out, 'step_eager')], 240),
        ('step_compiled', ['-m', 'tools.step_bench', *bench, '--variants', ','.join(QUICK_COMPILED),
                           '--output_dir', os.path.join(out, 'step_compiled')], 260),
        ('attention', ['-m', 'tools.attention_bench', '--config', args.config, '--batch_size',
                       str(args.batch_size), '--device', args.device, '--output_dir',
                       os.path.join(out, 'attention')], 60),
        # 105 s on the H200 of 2026-11-26, 104 s on that of 2026-11-28 (docs/speed-and-scale.md)
        ('tests', ['-m', 'pytest', '-m', 'gpu', '-rs', '-p', 'no:cacheprovider', 'tests/test_gpu.py'], 130),
    ]


def run_quick(args, report: dict) -> dict:
    """--quick on a CUDA device (or a device named with --device): the parts in order, the report rewritten
    after each; exits 1 when a part failed."""
    out_dir = os.path.abspath(args.output_dir)
    step: dict[str, dict] = {}
    parts: dict[str, dict] = {}
    report.update(mode='quick', parts=parts, step_bench=step, attention=None, targets=None, status='running')
    for name, argv, timeout in quick_parts(args):
        parts[name] = _run(name, argv, out_dir, timeout)
        if name == 'tests':
            with open(parts[name]['log'], encoding='utf-8') as f:
                parts[name].update(pytest_summary(f.read()))
            if parts[name].get('failed'):
                parts[name]['status'] = 'failed'
        elif name == 'attention':
            report['attention'] = _read_json(os.path.join(out_dir, name, 'attention_bench.json'))
        else:
            record = _read_json(os.path.join(out_dir, name, 'step_bench.json')) or {}
            step.update(record.get('variants') or {})
            report['model_flops_per_sample'] = (report.get('model_flops_per_sample')
                                                or record.get('model_flops_per_sample'))
            if any('error' in v for v in (record.get('variants') or {}).values()):
                parts[name]['status'] = 'failed'
        report['targets'] = judge_quick(step)
        _write(report, out_dir)
    failed = sorted(name for name, part in parts.items() if part['status'] != 'passed')
    report.update(status='failed' if failed else 'passed', failed_parts=failed)
    emit_record(report, out_dir, 'gpu_check')
    if failed:
        print(f'gpu-check --quick: failed parts {failed}; their output is in {out_dir}/<part>.txt',
              file=sys.stderr)
        sys.exit(1)
    return report


def _write(report: dict, out_dir: str) -> None:
    """The report so far, to <out_dir>/gpu_check.json (a run cut short keeps what it measured)."""
    with open(os.path.join(out_dir, 'gpu_check.json'), 'w', encoding='utf-8') as f:
        json.dump(report, f, indent=2)
        f.write('\n')


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser('tools.gpu_check', __doc__.splitlines()[0])
    p.add_argument('--output_dir', default=None,
                   help='folder of the report gpu_check.json and of each part\'s output (default: '
                        'output/gpu_check, with --quick output/gpu_check_quick)')
    p.add_argument('--device', default='cuda', help='the CUDA device to check (default: cuda); --quick also '
                                                    'takes cpu, to try the check itself on a tiny --config')
    p.add_argument('--quick', action='store_true',
                   help='the step\'s speed in about 9 minutes: step benchmark eager (each change on and '
                        'off), compiled and with CUDA graphs, the attention backends, then the GPU tests')
    p.add_argument('--config', default='configs/Pretrain.yaml',
                   help='--quick: the pre-training config benchmarked (default: configs/Pretrain.yaml)')
    p.add_argument('--batch_size', type=int, default=128, help='--quick: per-GPU batch (default: 128)')
    p.add_argument('--steps', type=int, default=10, help='--quick: timed steps per variant (default: 10)')
    p.add_argument('--warmup', type=int, default=3, help='--quick: warm-up steps per variant (default: 3)')
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the GPU check (or say why not) and write the report; returns it."""
    args = build_parser().parse_args(argv)
    args.output_dir = args.output_dir or ('output/gpu_check_quick' if args.quick else 'output/gpu_check')
    out_dir = os.path.abspath(args.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    report: dict = {'mode': 'quick' if args.quick else 'full', 'torch': torch.__version__,
                    'cuda': torch.version.cuda, 'date': time.strftime('%Y-%m-%d %H:%M:%S')}
    device = torch.device(args.device)
    if args.quick and (device.type != 'cuda' or torch.cuda.is_available()):
        report['device'] = torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'
        return run_quick(args, report)
    if args.quick:  # nothing of it can run without CUDA, the GPU tests included
        reason = 'no CUDA device: torch.cuda.is_available() is False'
        report.update(status='skipped', reason=reason, device=None)
        print(f'gpu-check --quick skipped: {reason}; nothing ran. Report: {out_dir}/gpu_check.json')
        return emit_record(report, out_dir, 'gpu_check')
    tests = _run('tests', ['-m', 'pytest', '-m', 'gpu', '-rs', '-p', 'no:cacheprovider', 'tests/test_gpu.py'],
                 out_dir, timeout=600)
    with open(tests['log'], encoding='utf-8') as f:
        tests.update(pytest_summary(f.read()))
    report['tests'] = tests
    if not torch.cuda.is_available():
        reason = 'no CUDA device: torch.cuda.is_available() is False'
        report.update(status='skipped', reason=reason, device=None)
        print(f'gpu-check skipped: {reason}; the GPU tests skipped with their reasons '
              f'({"; ".join(tests["skip_reasons"]) or "none given"}), no benchmark ran. Report: '
              f'{out_dir}/gpu_check.json')
        if tests['status'] == 'failed' and tests.get('failed'):
            report['status'] = 'failed'
        emit_record(report, out_dir, 'gpu_check')
        if report['status'] == 'failed':
            sys.exit(1)
        return report

    device = torch.device(args.device)
    report['device'] = torch.cuda.get_device_name(device)
    parts = {'tests': tests}
    step: dict[str, dict] = {}
    for batch in (64, 128):
        for checkpointed in (False, True):
            name = f'batch{batch}' + ('_checkpointed' if checkpointed else '')
            folder = os.path.join(out_dir, f'step_bench_{name}')
            parts[f'step_bench_{name}'] = _run(
                f'step_bench_{name}',
                ['-m', 'tools.step_bench', '--config', 'configs/Pretrain.yaml', '--batch_size', str(batch),
                 '--steps', '10', '--warmup', '3', '--device', args.device, '--variants', 'bf16',
                 '--output_dir', folder, *(['--set', 'grad_checkpointing=true'] if checkpointed else [])],
                out_dir, timeout=600)
            result = _read_json(os.path.join(folder, 'step_bench.json')) or {}
            step[name] = (result.get('variants') or {}).get('bf16') or {}
    grit_dir = os.path.join(out_dir, 'grit_bench')
    parts['grit_bench'] = _run('grit_bench', ['-m', 'tools.grit_bench', '--device', args.device,
                                              *[f'--{k}={v}' for k, v in GRIT_SIZES.items()],
                                              '--output_dir', grit_dir], out_dir, timeout=600)
    grit = _read_json(os.path.join(grit_dir, 'grit_bench.json'))
    selection_dir = os.path.join(out_dir, 'selection_bench')
    parts['selection_bench'] = _run(
        'selection_bench',
        ['-m', 'tools.selection_bench', '--device', args.device, '--output_dir', selection_dir],
        out_dir, timeout=600)
    selection = _read_json(os.path.join(selection_dir, 'selection_bench.json'))
    tiny = os.path.join(out_dir, 'tiny_pretrain')
    parts['tiny_pretrain'] = _run('tiny_pretrain', ['-m', 'Pretrain', '--config', TINY_PRETRAIN, '--device',
                                                    args.device, '--output_dir', tiny], out_dir, timeout=900)
    zeroshot = None
    if parts['tiny_pretrain']['status'] == 'passed' and os.path.isfile(os.path.join(tiny, 'log.txt')):
        parts['tiny_zeroshot'] = _run('tiny_zeroshot', ['-m', 'Retrieval', '--config', TINY_RETRIEVAL,
                                                        '--checkpoint', last_checkpoint(tiny), '--evaluate',
                                                        '--device', args.device, '--output_dir',
                                                        tiny + '_zeroshot'], out_dir, timeout=600)
        if os.path.isfile(os.path.join(tiny + '_zeroshot', 'log.txt')):
            rows, record = read_log(os.path.join(tiny, 'log.txt')), read_retrieval(tiny + '_zeroshot')
            zeroshot = {'pretrain_seconds': round(sum(r['epoch_seconds'] for r in rows), 1),
                        'final_loss_itm': rows[-1]['loss_itm'], 'test_mean_r1': record['test_mean_r1'],
                        'test_itc_mean_r1': record['test_itc_mean_r1']}
    report.update(parts=parts, step_bench=step, grit_bench=grit, selection_bench=selection, tiny=zeroshot,
                  targets=judge(step, grit))
    failed = [name for name, part in parts.items() if part['status'] != 'passed'] + (
        ['tests'] if tests.get('failed') else [])
    report['status'] = 'failed' if failed else 'passed'
    report['failed_parts'] = sorted(set(failed))
    emit_record(report, out_dir, 'gpu_check')
    if failed:
        print(f'gpu-check: failed parts {sorted(set(failed))}; their output is in {out_dir}/<part>.txt',
              file=sys.stderr)
        sys.exit(1)
    return report


if __name__ == '__main__':
    run_main(main)
