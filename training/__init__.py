"""Training plumbing shared by the task scripts: one module per concern.

    config           the typed config: every key of each script, its type, default, allowed values, meaning
    config_files     YAML files: load, `base:` overlays, `--set` overrides, save (ConfigError)
    config_albef     ALBEF's own config keys: read as ours or refused with what to do instead
    config_types     a value against its key's annotation and bounds (conversion, messages)
    config_resolve   YAML + overrides -> the typed config, checked once at start-up; the config written out
    cli              one command-line style, the start of every script, one `error:` line per mistake
    inputs           what a run makes on first use: the synthetic world and its pre-trained ViT
    trainer          Task + Trainer: the one epoch loop of all four scripts
    distributed      process group (torchrun, launch, srun), ranks, metric reductions, DDP wrapper
    reproducibility  seeds, deterministic kernels, reseed on checkpoint/resume, worker seeds
    optimizer        AdamW parameter groups, warm-up + cosine schedule, mixed precision
    checkpoints      checkpoint files, --resume, the training state dict, checkpoint_best.pth
    logger           TrainLogger (per-step metrics on the device, progress lines), log.txt
    reporting        start-up summary, run record, metrics.jsonl, console copy, TensorBoard, W&B, pruning
    pictures         a batch drawn with each image's hardest in-batch negative
    loaders          DataLoader settings, the resumable fine-tuning sampler, the one-global-batch check
    bad_samples      per-epoch bad-sample counts and the max_bad_fraction stop
    step_guard       non-finite steps skipped; SIGTERM/SIGINT: save and stop (one decision per step)

training/ may import models/, grit/ and dataset/ (never the other way round) and no script.
"""
