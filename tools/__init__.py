"""Analyses and benchmarks that are not training, each a command `python -m tools.X` (`--help` for its flags).

Commands: probe (compositional ITM probe), uov (Usage of Vision), warmstart (GRIT's first-epoch indices),
report (training curves), compare (GRIT vs random batches), ablate (the paper's ablation tables),
step_bench, loader_bench and grit_bench (benchmarks), make_synthetic (the synthetic dataset), vit_pretrain
(the synthetic ViT). Helpers, not commands: cli (the tools' shared command line and record tail), launch
(starting the task scripts as children), pretrain_checkpoint (the pre-training model of a checkpoint).
"""
