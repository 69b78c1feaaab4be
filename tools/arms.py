"""The arms the comparison tools run: what each is (ARMS: overrides of configs/tiny/Pretrain.yaml), the
hyper-parameter grid of those that have one (GRIDS), and what each sweep selected on val (SELECTED_LR;
SELECTED_LR_REAL on the real corpora; SELECTED_LR_24 at 24 epochs; SELECTED_SETTING). tools.compare sweeps
and reports them; tools.efficiency, tools.downstream and `make demo` run them at their selection.

The arms: GRIT-VLP at the paper's ratio of search space to batch, M/N = 120/8 = 15, which is the tiny
config's; GRIT-VLP at the earlier tiny config's M/N = 768/8 = 96; random batches (batching.strategy=random);
ALBEF_Base and ALBEF_Base50 (Tables 2 and 4's baselines); the batch-construction strategies B3, GCBS and
random walk; HN-NCE on random and on GRIT batches; GRIT with S-ITC; SigLIP's sigmoid loss on GRIT and on
random batches; FLIP's image-token dropout on GRIT and on random batches; the remedies for GRIT's stalled
ITM (multinomial hard negatives, later grouping, a rank skip, a longer warm-up); the guard by scene (the
real corpora's families) on GRIT and on random batches; and JEST's and RHO-LOSS's
online selection at equal compute, with their reference model (REFERENCE). An arm with a
hyper-parameter gets the same two-setting grid size as every other such arm, each setting swept with every
learning rate.
"""

from __future__ import annotations

from collections.abc import Sequence

from tools.launch import in_root
from tools.runs import CORPORA, PRETRAIN_CONFIG, lr_overrides
from training.config_resolve import resolve_config

__all__ = ["ARMS", "GRIDS", "ONLINE_ARMS", "REFERENCE", "SELECTED_LR", "SELECTED_LRS", "SELECTED_LRS_LONGER",
           "SELECTED_LR_24", "SELECTED_LR_REAL", "SELECTED_SETTING", "arm_overrides", "arm_setting",
           "arm_strategies", "grid_overrides", "selected_setting", "selection", "setting_label"]

# The switches several arms share, each spelled once.
_RANDOM = ['batching.strategy=random']
# MAFA's code (jaeseokbyun/MAFA, models/model_pretrain_MAFA.py) smooths from the second epoch on
_S_ITC = ['itc_smoothing_epoch=1']
_SIGMOID = ['contrastive_loss=sigmoid', 'lambda_cons=0.0']
_DROP_05 = ['image_token_drop=0.5', 'unmasked_epochs=1']

# The arms: name -> the overrides of the tiny pre-training config that make it.
ARMS = {'GRIT-VLP': [],  # the tiny config: N = 8, M = 120, L = 1440 (M/N = 15, the paper's 1920/128)
        # the tiny config before issue 26
        'GRIT-VLP M/N=96': ['batching.search_space=768', 'batching.queue_size=1536'],
        'random batches': [*_RANDOM],
        # Tables 2 and 4's baselines (configs/ablation/tiny/albef_base*.yaml), for tools.efficiency
        'ALBEF_Base': [*_RANDOM, 'lambda_cons=0.0', 'mlm_probability=0.15'],
        'ALBEF_Base50': [*_RANDOM, 'lambda_cons=0.0'],
        # Batch construction beside GRIT (docs/batch-construction.md; issue 37), each on the tiny config's
        # queue and sub-queues (M/N = 15), and the loss-side switches on random and on GRIT batches.
        'B3': ['batching.strategy=b3'],
        'GCBS': ['batching.strategy=gcbs'],
        'random walk': ['batching.strategy=rwr'],
        'random + HN-NCE': [*_RANDOM],
        'GRIT-VLP + HN-NCE': [],
        'GRIT-VLP + S-ITC': [*_S_ITC],
        # SigLIP's sigmoid loss in place of the softmax ITC (issue 50; models/losses/sigmoid.py), on GRIT and
        # on random batches: the consistency term compares softmaxes, so it goes too (lambda_cons 0).
        'GRIT-VLP + sigmoid': [*_SIGMOID],
        # FLIP's image-token dropout (issue 51; models.pretrain), with FLIP's short unmasked tuning as the
        # last of the 12 epochs, on GRIT and on random batches: compute to ALBEF_Base's recall
        # (tools.efficiency counts each epoch's FLOPs at its own step).
        'GRIT-VLP drop 0.5': [*_DROP_05],
        'GRIT-VLP drop 0.75': ['image_token_drop=0.75', 'unmasked_epochs=1'],
        'random drop 0.5': [*_RANDOM, *_DROP_05],
        # Issue 51's combination: GRIT-VLP + S-ITC (the comparison's best arm) with dropping 0.5, its
        # smoothing held at GRIT-VLP + S-ITC's selection (SELECTED_SETTING) and its rate swept.
        'GRIT-VLP + S-ITC drop 0.5': [*_S_ITC, *_DROP_05],
        'random + sigmoid': [*_RANDOM, *_SIGMOID],
        # Remedies for the ITM that stays at chance on some seeds (issue 49; docs/batch-construction.md,
        # 'The stalled ITM'), each one switch away from GRIT-VLP: ALBEF's multinomial hard negatives,
        # grouping from a later epoch, a rank skip in the chain, a longer warm-up.
        'GRIT-VLP multinomial': ['hard_sampling=multinomial'],
        'GRIT-VLP later grouping': [],
        'GRIT-VLP rank skip': [],
        'GRIT-VLP long warm-up': [],
        # The guard by scene (guard_by: scene; the real corpora's families): a family's near-copies are one
        # image, ITC positives and never mined, on GRIT and on random batches. A diagnostic of what those
        # near-copies do to the mined negatives: the labels it needs are not in a web corpus.
        'GRIT-VLP + scene guard': ['guard_false_negatives=true', 'guard_by=scene'],
        'random + scene guard': [*_RANDOM, 'guard_false_negatives=true', 'guard_by=scene'],
        # Online batch selection (issue 52; grit.strategies.jest, .rho), each step N = 8 of k x N = 40 random
        # candidates, scored by the learner and the frozen reference (REFERENCE), at equal compute with 12
        # epochs of plain batches: 27 epochs of 72 steps (tools.step_measure.equal_compute_epochs, with the
        # scoring forwards counted; tests/test_arms.py recomputes it), the reference's own training apart.
        # 31 until 2026-12-03, when itm_cls_only and share_caption_attention made the training step cheaper
        # and left the scoring forwards as they were (the records of docs/batch-construction.md ran 31).
        'JEST': ['batching.strategy=jest', 'max_epoch=27', 'schedular.epochs=27'],
        'RHO-LOSS': ['batching.strategy=rho', 'max_epoch=27', 'schedular.epochs=27']}
# The online selection arms' strategies, and their reference model: ALBEF_Base pre-trained on the same data
# as the arm 'random batches' at its selected rate, with a seed no comparison uses; tools.compare trains it
# once into <output_dir>/reference/ (evaluated like any run) before those arms, and reports it beside them.
ONLINE_ARMS = {'JEST': 'jest', 'RHO-LOSS': 'rho'}
REFERENCE = {'arm': 'random batches', 'seed': 1000}
# The hyper-parameter grid of each arm that has one: the same size (two settings) for every such arm, each
# setting swept with every learning rate and selected on val with it (GRID_OVERRIDES: a setting's keys).
GRIDS = {'B3': ['p=2,m=20', 'p=10,m=30'],  # B3's paper: skip the top p, link the next m
         'GCBS': ['k=5', 'k=10'],
         'random walk': ['k=10,restart=0.1', 'k=10,restart=0.3'],
         'random + HN-NCE': ['beta=0.5', 'beta=1'],
         'GRIT-VLP + HN-NCE': ['beta=0.5', 'beta=1'],
         'GRIT-VLP + S-ITC': ['s=0.2', 's=0.5'],  # 0.5: MAFA's own value
         'GRIT-VLP + S-ITC drop 0.5': ['s=0.2', 's=0.5'],  # GRIT-VLP + S-ITC's; swept at 's=0.2' only
         'GRIT-VLP later grouping': ['from=2', 'from=4'],  # the first grouped epoch (the paper's: 1)
         'GRIT-VLP rank skip': ['skip=2', 'skip=10'],  # B3's grid of p
         'GRIT-VLP long warm-up': ['warmup=363', 'warmup=726']}  # one and two epochs of the tiny config


def grid_overrides(arm: str, setting: str | None) -> list[str]:
    """KEY=VALUE overrides of one grid setting of `arm` ('p=2,m=20' -> B3's rank_skip and rank_window)."""
    if setting is None:
        return []
    keys = {'p': 'batching.b3.rank_skip', 'm': 'batching.b3.rank_window', 'restart': 'batching.rwr.restart',
            'beta': 'itc_hn_beta', 's': 'itc_smoothing', 'from': 'batching.group_from_epoch',
            'skip': 'batching.grit.rank_skip', 'warmup': 'schedular.warmup_steps',
            'k': 'batching.gcbs.neighbours' if arm == 'GCBS' else 'batching.rwr.neighbours'}
    return [f'{keys[name]}={value}' for name, value in (part.split('=') for part in setting.split(','))]


def arm_overrides(arm: str, lr: float | None, setting: str | None,
                  config: str = PRETRAIN_CONFIG) -> list[str]:
    """KEY=VALUE overrides of one arm's pre-training: its keys (ARMS), its grid setting, its learning rate
    (None: the config's) scaled onto `config`'s schedule."""
    return ARMS[arm] + grid_overrides(arm, setting) + (lr_overrides(lr, config) if lr is not None else [])


def setting_label(setting: float | tuple) -> str:
    """A sweep setting as printed and as a JSON key: a learning rate, or 'lr setting' for a grid arm."""
    return f'{setting:g}' if not isinstance(setting, tuple) else f'{setting[0]:g} {setting[1]}'


# Each arm's learning rate (and grid setting) as selected on val, best mean val R@1 over seeds 1-3, at the
# tiny config's 12 epochs (each command below ran before tools.compare's default became 24: today it needs
# --epochs 12):
# GRIT-VLP and random batches by `python -m tools.compare --seeds 1 2 3 --lrs 1.25e-4 2.5e-4 5e-4 1e-3
# --arms GRIT-VLP "random batches"` (README, 'Does GRIT help?'; the demo's), the strategies by
# `python -m tools.compare --seeds 1 2 3 --lrs 2.5e-4 5e-4 1e-3 --arms B3 GCBS "random walk"
# --output_dir output/compare_strategies` (docs/batch-construction.md, 2026-11-27), the loss-side arms by the
# same command with --arms "random + HN-NCE" "GRIT-VLP + HN-NCE" "GRIT-VLP + S-ITC" (2026-11-27), and the
# SigLIP arms by `python -m tools.compare --seeds 1 2 3 --lrs 6.25e-5 1.25e-4 2.5e-4 5e-4 1e-3 --arms
# "GRIT-VLP + sigmoid" "random + sigmoid" --output_dir output/compare_sigmoid` (2026-11-28; both selections
# inside the grid, docs/results/compare_sigmoid_sweep_seeds1-3.md), and the online selection arms by
# `python -m tools.compare --seeds 1 2 3 --lrs 2.5e-4 5e-4 1e-3 --arms JEST RHO-LOSS --output_dir
# output/compare_online` (2026-11-28; both inside the grid, docs/results/compare_online_sweep_seeds1-3.md),
# and the remedy 'GRIT-VLP multinomial' by `python -m tools.compare --seeds 1 2 3 --lrs 2.5e-4 5e-4 1e-3
# --arms "GRIT-VLP multinomial" --output_dir output/compare_remedy` (2026-11-29; inside the grid,
# docs/results/compare_multinomial_sweep_seeds1-3.md), 'GRIT-VLP later grouping' and 'GRIT-VLP long
# warm-up' by the same command with --arms "GRIT-VLP later grouping" (--output_dir output/compare_later) and
# "GRIT-VLP long warm-up" (output/compare_warmup) (2026-11-29; both at 5e-4, inside the grid, and the shorter
# setting of their grids; docs/results/compare_later_sweep_seeds1-3.md, compare_warmup_sweep_seeds1-3.md),
# and 'GRIT-VLP rank skip' with --arms "GRIT-VLP rank skip" --output_dir output/compare_rankskip
# (2026-11-29; 5e-4, skip=2, inside the grid; docs/results/compare_rankskip_sweep_seeds1-3.md), and
# 'GRIT-VLP drop 0.5' by `python -m tools.compare --seeds 1 2 3 --lrs 2.5e-4 5e-4 1e-3 --arms "GRIT-VLP drop
# 0.5" "GRIT-VLP drop 0.75" "random drop 0.5" --output_dir output/compare_drop` (2026-11-29; 5e-4, inside
# the grid; docs/results/compare_drop_sweep_seeds1-3.md; the other two chose the grid's lower edge, 2.5e-4),
# and those two on today's code by `python -m tools.compare --seeds 1 2 3 --lrs 6.25e-5 1.25e-4 2.5e-4 5e-4
# --arms "GRIT-VLP drop 0.75" "random drop 0.5" --output_dir output/compare_drop` (2026-12-03; 1.25e-4 and
# 2.5e-4, both inside the grid; docs/results/compare_drop_sweep_ext_seeds1-3.md), and 'GRIT-VLP + S-ITC drop
# 0.5' by `python -m tools.compare --seeds 1 2 3 --lrs 2.5e-4 5e-4 1e-3 --selected_settings --arms "GRIT-VLP
# + S-ITC drop 0.5" --output_dir output/compare_drop_sitc` (2026-12-03; 5e-4, inside the grid, s held at 0.2;
# docs/results/compare_drop_sitc_sweep_seeds1-3.md).
SELECTED_LR = {'GRIT-VLP': 5e-4, 'random batches': 2.5e-4, 'B3': 5e-4, 'GCBS': 5e-4, 'random walk': 5e-4,
               'random + HN-NCE': 2.5e-4, 'GRIT-VLP + HN-NCE': 5e-4, 'GRIT-VLP + S-ITC': 5e-4,
               'GRIT-VLP + sigmoid': 2.5e-4, 'random + sigmoid': 1.25e-4, 'JEST': 5e-4, 'RHO-LOSS': 5e-4,
               'GRIT-VLP multinomial': 5e-4, 'GRIT-VLP later grouping': 5e-4, 'GRIT-VLP long warm-up': 5e-4,
               'GRIT-VLP rank skip': 5e-4, 'GRIT-VLP drop 0.5': 5e-4, 'GRIT-VLP drop 0.75': 1.25e-4,
               'random drop 0.5': 2.5e-4, 'GRIT-VLP + S-ITC drop 0.5': 5e-4}
SELECTED_SETTING = {'B3': 'p=2,m=20', 'GCBS': 'k=5', 'random walk': 'k=10,restart=0.1',
                    'random + HN-NCE': 'beta=0.5', 'GRIT-VLP + HN-NCE': 'beta=0.5',
                    'GRIT-VLP + S-ITC': 's=0.2', 'GRIT-VLP later grouping': 'from=2',
                    # held at GRIT-VLP + S-ITC's, not swept (its sweep ran with --selected_settings)
                    'GRIT-VLP + S-ITC drop 0.5': 's=0.2',
                    'GRIT-VLP long warm-up': 'warmup=363', 'GRIT-VLP rank skip': 'skip=2'}


# The real corpora's (tools.make_real; --corpus real): each arm's rate of best mean val R@1 over seeds 1-3,
# the grid arms held at their synthetic settings (SELECTED_SETTING), by `python -m tools.compare --corpus real
# --seeds 1 2 3 --lrs 2.5e-4 5e-4 1e-3 --selected_settings --arms GRIT-VLP "random batches" B3 GCBS
# "GRIT-VLP + S-ITC"` (docs/real-corpora.md, docs/results/compare_real_sweep_seeds1-3.md, 2026-11-28); the
# drop arms by the same grid, `--arms "GRIT-VLP drop 0.5" "GRIT-VLP drop 0.75" "random drop 0.5"`, one seed a
# run (docs/results/compare_real_drop_seed{1,2,3}.md, 2026-12-07; all three 5e-4, inside the grid), joined
# with the first sweep in docs/results/compare_real_drop_seeds1-3.md.
SELECTED_LR_REAL = {'GRIT-VLP': 2.5e-4, 'random batches': 5e-4, 'B3': 2.5e-4, 'GCBS': 2.5e-4,
                    'GRIT-VLP + S-ITC': 2.5e-4, 'GRIT-VLP drop 0.5': 5e-4, 'GRIT-VLP drop 0.75': 5e-4,
                    'random drop 0.5': 5e-4}
SELECTED_LRS = {'synthetic': SELECTED_LR, 'real': SELECTED_LR_REAL}  # tools.runs.CORPORA's names

# The synthetic world at 24 epochs (issue 49's protocol, tools.compare's default since 2026-12-07):
# each arm's rate of best mean val R@1 over seeds 1-3 at its 12-epoch grid setting, every one inside the grid,
# by `python -m tools.compare --seeds 1 2 3 --lrs 1.25e-4 2.5e-4 5e-4 1e-3 --selected_settings --arms ARM
# --set max_epoch=24 schedular.epochs=24 --output_dir DIR`, recorded in docs/results/ as (arm: record, date):
#   GRIT-VLP and B3: compare24_sweep_grit_b3_seeds1-3.md (2026-12-03, both arms in one command)
#   random batches: compare24_sweep_random_seeds1-3.md (2026-12-04)
#   GRIT-VLP + S-ITC: compare24_sweep_sitc_seeds1-3.md (2026-12-04, s held at 0.2)
#   GCBS: compare24_sweep_gcbs_seeds1-3.md (2026-12-04, k held at 5)
#   random walk: compare24_sweep_rwalk_seeds1-3.md (2026-12-04, k = 10 and restart 0.1 held)
#   random + HN-NCE: compare24_sweep_rhn_seeds1-3.md (2026-12-04, beta held at 0.5)
#   GRIT-VLP + HN-NCE: compare24_sweep_ghn_seeds1-3.md (2026-12-04, beta held at 0.5)
SELECTED_LR_24 = {'GRIT-VLP': 2.5e-4, 'B3': 2.5e-4, 'random batches': 2.5e-4, 'GRIT-VLP + S-ITC': 5e-4,
                  'GCBS': 2.5e-4, 'random walk': 5e-4, 'random + HN-NCE': 2.5e-4,
                  'GRIT-VLP + HN-NCE': 5e-4}
# Selections at a schedule other than the corpus config's own (12 epochs synthetic, 6 real): (corpus, epochs).
SELECTED_LRS_LONGER = {('synthetic', 24): SELECTED_LR_24}


def selection(arm: str, corpus: str = 'synthetic', epochs: int | None = None) -> tuple[float, str | None]:
    """An arm's selected learning rate and grid setting on `corpus` at `epochs` of pre-training (None: the
    corpus config's own; SELECTED_LRS, SELECTED_LRS_LONGER, SELECTED_SETTING); ValueError when its sweep on
    that corpus and schedule has not selected one yet."""
    own = epochs is None or epochs == _own_epochs(corpus)
    lrs = SELECTED_LRS[corpus] if own else SELECTED_LRS_LONGER.get((corpus, epochs), {})
    if arm not in lrs:
        table = ('SELECTED_LR' if corpus == 'synthetic' else f'SELECTED_LR_{corpus.upper()}') if own else (
            f'SELECTED_LRS_LONGER[({corpus!r}, {epochs})]')
        at = '' if own else f' at {epochs} epochs'
        raise ValueError(f'{arm!r} has no selected rate yet on the {corpus} corpus{at} (tools.arms.{table}: '
                         'run its sweep with tools.compare first)')
    return lrs[arm], selected_setting(arm)


def _own_epochs(corpus: str) -> int:
    """The epochs `corpus`'s pre-training config trains (tools.runs.CORPORA), whose selections SELECTED_LRS
    holds."""
    with in_root():  # the config's relative path
        return resolve_config('pretrain', CORPORA[corpus].pretrain, [], check_paths=False).max_epoch


def selected_setting(arm: str) -> str | None:
    """An arm's selected grid setting (SELECTED_SETTING; None for an arm without a grid), whether or not a
    rate has been selected: what --selected_settings holds while the rates are swept; ValueError for a grid
    arm whose settings have not been selected yet."""
    if arm in GRIDS and arm not in SELECTED_SETTING:
        raise ValueError(f'{arm!r} has a grid but no selected setting yet (tools.arms.SELECTED_SETTING: run '
                         'its sweep over the grid with tools.compare first)')
    return SELECTED_SETTING.get(arm)


def arm_setting(arms: Sequence[str], lrs: Sequence[float] | None, corpus: str = 'synthetic',
                epochs: int | None = None) -> dict[str, tuple[float, str | None]]:
    """{arm: (lr, grid setting)}: `lrs` in `arms`' order, each arm at its selected setting, or without `lrs`
    each arm's selection on `corpus` at `epochs` (selection); ValueError when `lrs` is not one rate an arm."""
    if lrs and len(lrs) != len(arms):
        raise ValueError(f'{len(lrs)} rates for {len(arms)} arms: give one per arm, in their order')
    return {arm: (lrs[k], SELECTED_SETTING.get(arm)) if lrs else selection(arm, corpus, epochs)
            for k, arm in enumerate(arms)}


def arm_strategies(arms: Sequence[str], overrides: Sequence[str] = ()) -> dict[str, str]:
    """Each arm's batching strategy (its config's batching.strategy, with the sweep's --set): whose cost it
    pays. An online arm's config is read with a stand-in for the reference that tools.compare trains."""
    def reference(a: str) -> list[str]:
        return [f'batching.{ONLINE_ARMS[a]}.reference=reference.pth'] if a in ONLINE_ARMS else []

    return {a: resolve_config('pretrain', PRETRAIN_CONFIG, [*ARMS[a], *reference(a), *overrides],
                              check_paths=False).strategy for a in arms}
