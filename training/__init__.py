"""Training plumbing shared by the task scripts: one module per concern, each importing only those above.

    config           YAML config, overrides, required keys (ConfigError)
    distributed      process group, ranks, metric reductions, DDP wrapper
    reproducibility  seeds, deterministic kernels, reseed on checkpoint/resume, worker seeds
    optimizer        AdamW parameter groups, warm-up + cosine schedule, mixed precision
    checkpoints      checkpoint files, --resume, the training state dict, checkpoint_best.pth
    logger           TrainLogger, log.txt, the output directory
    loaders          DataLoader settings, the resumable fine-tuning sampler
    cli              command-line flags, the start of every script, one-line config errors
    loop             train_one_epoch, the fine-tuning epoch loop, --evaluate

Nothing here imports models/, dataset/, grit/ or a script.
"""
