"""Training plumbing shared by the task scripts: one module per concern, each importing only those above.

    config           YAML config, overrides, required keys (ConfigError)
    schema           the config keys each script accepts, with their types
    validation       start-up checks: unknown keys, types, GRIT sizes, missing files, global batch
    distributed      process group, ranks, metric reductions, DDP wrapper
    reproducibility  seeds, deterministic kernels, reseed on checkpoint/resume, worker seeds
    optimizer        AdamW parameter groups, warm-up + cosine schedule, mixed precision
    checkpoints      checkpoint files, --resume, the training state dict, checkpoint_best.pth
    logger           TrainLogger, log.txt, the output directory
    loaders          DataLoader settings, the resumable fine-tuning sampler
    bad_samples      per-epoch bad-sample counts and the max_bad_fraction stop
    step_guard       non-finite steps skipped; SIGTERM/SIGINT: save and stop (one decision per step)
    cli              command-line flags, the start of every script, one-line config errors
    loop             train_one_epoch, the fine-tuning epoch loop, --evaluate

Nothing here imports models/, dataset/ or a script; validation reads grit's config parser (lazily,
for pre-training only).
"""
