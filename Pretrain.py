"""GRIT-VLP pre-training (paper Sec. 4): ALBEF_Base trained with ITC_cons + ITM_hard + MLM_50 on GRIT batches.

    python Pretrain.py --config configs/tiny/Pretrain.yaml --output_dir output/pretrain_tiny
    python -m torch.distributed.launch --nproc_per_node=4 --use_env Pretrain.py \
        --config configs/Pretrain.yaml --output_dir output/Pretrain
    torchrun --nproc_per_node=4 Pretrain.py --config configs/Pretrain.yaml --output_dir output/Pretrain
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Subset

from dataset import ImageTextCollate, create_dataset, prepare_data
from dataset.bad_samples import SkipBadCollate, SkipBadSamples, device_valid
from grit import GritSampler
from models.loading import load_weights
from models.pretrain import ALBEF_Base
from models.tokenization import build_tokenizer
from training.bad_samples import BadSampleLog
from training.checkpoints import (
    checkpoint_path,
    resolve_resume,
    restore_training,
    save_checkpoint,
    training_state,
)
from training.cli import run_main, start
from training.config import get_max_epoch, to_plain
from training.distributed import barrier, cleanup, print_main, unwrap, wrap_ddp
from training.loaders import create_loader
from training.logger import append_log, setup_output_dir
from training.loop import train_one_epoch
from training.optimizer import build_optimizer, build_scaler, build_scheduler
from training.reproducibility import make_generator
from training.step_guard import StepGuard
from training.validation import check_global_batch

LOSSES = ('loss_itc', 'loss_cons', 'loss_itm', 'loss_mlm')


def build_dataset(config: dict) -> SkipBadSamples:
    """The pre-training dataset over config['train_file'] with ALBEF's pre-training augmentation;
    bad entries come back as placeholders marked invalid (dataset.bad_samples)."""
    return SkipBadSamples(create_dataset('pretrain', config))


def naive_pass_fn(model: torch.nn.Module, dataset: SkipBadSamples, collate: SkipBadCollate,
                  config: dict, device: torch.device):
    """The extra no-grad pass of the uni-modal encoders that GRIT's naive mode runs per epoch (Remark 2)."""

    def run(indices: torch.Tensor):
        loader = DataLoader(Subset(dataset, indices.tolist()), batch_size=int(config['batch_size']),
                            num_workers=int(config.get('num_workers', 0)), collate_fn=collate)
        net = unwrap(model)
        was_training = net.training
        net.eval()
        with torch.no_grad():
            for image, text, idx, valid, _ in loader:
                image_feat, text_feat = net.unimodal_features(image.to(device), text.to(device))
                yield image_feat, text_feat, idx.to(device), valid.to(device)
        net.train(was_training)

    return run


def main(argv: list[str] | None = None) -> None:
    args, config, info, seed = start(argv, description=__doc__.splitlines()[0], task='pretrain',
                                     required=('batch_size', 'embed_dim'))
    output_dir = setup_output_dir(args, config)
    device = info.device

    prepare_data(config)
    tokenizer = build_tokenizer(config)
    dataset = build_dataset(config)
    check_global_batch(len(dataset), config, 'batch_size', info.world_size)
    batch_size = int(config['batch_size'])
    sampler = GritSampler(dataset, num_replicas=info.world_size, rank=info.rank, seed=seed,
                          batch_size=batch_size, grit=to_plain(config.get('grit')),
                          dim=int(config['embed_dim']), device=device)
    collate = SkipBadCollate(ImageTextCollate(tokenizer, int(config.get('max_tokens', 40))))
    # The loader draws its workers' base seed from its own generator, not the global stream, so that
    # creating the iterator on resume does not shift the random numbers the model draws.
    loader = create_loader(dataset, sampler, batch_size, int(config.get('num_workers', 0)),
                           collate_fn=collate, drop_last=True,
                           generator=make_generator(seed + info.rank))

    model = ALBEF_Base(config, text_encoder=config.get('text_encoder'), tokenizer=tokenizer).to(device)
    if args.checkpoint and not args.resume:
        print(load_weights(model, args.checkpoint).summary())
    model_ddp = wrap_ddp(model, info, find_unused_parameters=not model.uses_every_parameter,
                         compile=bool(config.get('compile', False)))
    optimizer = build_optimizer(model, config['optimizer'], zero=bool(config.get('zero', False)),
                                fused=config.get('fused_adamw'))
    scheduler = build_scheduler(optimizer, config, steps_per_epoch=sampler.batches_per_epoch)
    scaler = build_scaler(config, device)

    guard = StepGuard(int(config.get('max_skipped_steps', 10)))
    bad_log = BadSampleLog(float(config.get('max_bad_fraction', 0.01)), output_dir=output_dir)
    start_epoch, global_step = 0, 0
    resume = resolve_resume(args.resume, output_dir)
    if resume:
        state, start_epoch, global_step = restore_training(resume, model, optimizer, scheduler, scaler,
                                                           seed=seed, rank=info.rank, guard=guard,
                                                           bad_samples=bad_log)
        sampler.load_state_dict(state['sampler'])

    def checkpoint_state(epoch: int, step: int, complete: bool = False, reseed_rng: bool = True) -> dict:
        return training_state(model, optimizer, scheduler, scaler, config=config, epoch=epoch,
                              step=step, sampler_state=sampler.state_dict(), seed=seed, rank=info.rank,
                              complete=complete, guard=guard, bad_samples=bad_log, reseed_rng=reseed_rng)

    grit_seconds = [0.0]
    feats: dict[str, torch.Tensor] = {}
    # Per-entry image ids on the device: a step looks its batch up by a gather, without a host sync
    # (used by the model's false-negative guard, config key guard_false_negatives).
    image_keys = torch.as_tensor(dataset.image_keys, dtype=torch.long, device=device)

    def step_fn(net, batch):
        image, text, idx, valid, _ = batch
        idx = idx.to(device, non_blocking=True)  # once per step: the guard's lookup and GRIT's collect
        valid = device_valid(valid, device)  # None without bad samples: the paper's computation
        out = net(image.to(device, non_blocking=True), text.to(device), image_key=image_keys[idx],
                  valid=valid)
        loss = out['loss_itc'] + out['loss_cons'] + out['loss_itm'] + out['loss_mlm']
        metrics = {k: out[k].detach() for k in LOSSES}
        metrics['grit_hardness'] = out['hardness']
        feats.update(image=out['image_feat'], text=out['text_feat'], idx=idx, valid=valid)
        return loss, metrics

    def after_step(metrics, batch, skipped):
        # Phase 1 (and, when the queue is full, phases 2-3) on the step's detached CLS projections.
        # Bad samples, and the whole batch of a skipped step, are collected as invalid: never grouped,
        # they come back next epoch like unseen indices.
        t0 = time.perf_counter()
        valid = feats['valid']
        if skipped:
            valid = torch.zeros_like(feats['idx'], dtype=torch.bool)
        sampler.collect(feats['image'], feats['text'], feats['idx'], valid)
        grit_seconds[0] += time.perf_counter() - t0

    max_epoch = get_max_epoch(config)
    naive = naive_pass_fn(model, dataset, collate, config, device)
    with guard:  # SIGTERM/SIGINT: finish the step, save, exit (training.step_guard)
        for epoch in range(start_epoch, max_epoch):
            grit_seconds[0] = 0.0
            t0 = epoch_start = time.perf_counter()
            sampler.set_epoch(epoch, naive_pass=naive if sampler.grit['mode'] == 'naive' else None)
            grit_seconds[0] += time.perf_counter() - t0
            stats, global_step = train_one_epoch(
                model_ddp, loader, optimizer, scheduler, epoch=epoch, global_step=global_step,
                step_fn=step_fn, config=config, device=device, output_dir=output_dir, scaler=scaler,
                after_step=after_step,
                checkpoint_state=checkpoint_state, start_batch=sampler.start_batch,
                total_batches=sampler.batches_per_epoch - sampler.start_batch,
                desc='Pretrain', guard=guard, bad_samples=bad_log)
            t0 = time.perf_counter()
            sampler.end_epoch()
            grit_seconds[0] += time.perf_counter() - t0
            stats['grit_seconds'] = round(grit_seconds[0], 3)
            # The whole epoch as a user waits for it: the steps plus GRIT's work outside them (naive mode's
            # extra pass in set_epoch, end_epoch); `seconds` counts the steps only (Table 4's time column).
            stats['epoch_seconds'] = round(time.perf_counter() - epoch_start, 3)
            stats['bad_samples'], stats['skipped_steps'] = bad_log.epoch_total(), guard.skipped
            bad_log.start_epoch()
            guard.start_epoch()
            save_checkpoint(checkpoint_path(output_dir, epoch=epoch),
                            **checkpoint_state(epoch, global_step, complete=True))
            keys = ('epoch', 'step', 'lr', *LOSSES, 'seconds', 'samples_per_s', 'grit_hardness',
                    'grit_seconds', 'epoch_seconds', 'bad_samples', 'skipped_steps')
            append_log(output_dir, {k: stats[k] for k in keys})
            print_main(f'epoch {epoch}: ' + '  '.join(f'{k} {stats[k]:.4f}' for k in keys[3:8]))
            bad_log.check(stats['bad_samples'], sampler.batches_per_epoch * batch_size * info.world_size,
                          f'epoch ({epoch})')
            barrier()
    cleanup()


if __name__ == '__main__':
    run_main(main)
