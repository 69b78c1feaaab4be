"""The typed config: every key each task script reads, with its type, default, allowed values and meaning.

This file and training.config_blocks (the blocks the configs nest: optimizer, schedular, batching)
are the one place a key is defined. A YAML file (with `base:` overlays) and `--set` overrides
resolve into one frozen dataclass per script at start-up (training.config_resolve): PretrainConfig,
RetrievalConfig, NLVRConfig, VQAConfig. Code reads attributes (`config.batching.search_space`), never a
default of its own. A field's type annotation is its type (Literal: the allowed values); key() holds its
default, its one-line meaning, numeric bounds and whether it names a data file or folder. Rules that
tie several keys together are each class's problems() method. Keys that only ALBEF's own config files
carry, and what becomes of them, are in training.config_albef.

`python Pretrain.py --config FILE --print_config` prints the resolved config with every key's meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from training.config_blocks import (
    B3,
    GCBS,
    REQUIRED,
    RWR,
    Batching,
    GritChain,
    Optimizer,
    Schedule,
    key,
    meaning,
)

__all__ = ["REQUIRED", "TASK_CONFIGS", "B3", "Batching", "GCBS", "GritChain", "RWR", "NLVRConfig",
           "Optimizer", "PretrainConfig", "RetrievalConfig", "Schedule", "TaskConfig", "VQAConfig",
           "config_class", "key", "meaning"]


def _as_list(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


# ------------------------------------------------------------------------------------------ tasks


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Keys every script reads: data and transforms, tokenizer and encoders, optimisation, the run."""

    # --- data (dataset.create_dataset) -----------------------------------------------------------------
    train_file: str | list[str] = key(REQUIRED, "json list(s) of training entries (ALBEF's format)",
                                      path="file")
    image_root: str | None = key(None, "folder the json image paths are relative to; null or '': used as "
                                       "they are", path="dir")
    synthetic_root: str | None = key(None, "where the built-in synthetic world is generated on first use "
                                           "(its files need not exist yet)")
    max_words: int = key(30, "captions and questions are cleaned as ALBEF's pre_caption and cut to this many "
                             "words", low=1)
    max_tokens: int = key(40, "tokenizer truncation (ALBEF: 25-30)", low=2)
    hflip: bool = key(True, "random horizontal flip (ALBEF); false for captions that name left and right")
    randaugment: bool = key(True, "RandAugment(2, 7) over ALBEF's operations, without colour changes")
    crop_scale: list[float] = key([0.5, 1.0], "RandomResizedCrop scale range (ALBEF: 0.5-1 fine-tuning, "
                                              "0.2-1 pre-training)")
    num_workers: int = key(0, "DataLoader worker processes per rank", low=0)

    # --- tokenizer and encoders (models.tokenization, models.vit, models.bert) ---------------------------
    bert_config: str = key(REQUIRED, "BERT json with ALBEF's fusion_layer and encoder_width", path="file")
    text_encoder: str | None = key("bert-base-uncased", "BERT weights and tokenizer: a hub id or a local "
                                                        "directory in the transformers layout (ALBEF's "
                                                        "default); null: random init")
    vocab_file: str | None = key(None, "a vocab.txt for the tokenizer instead of text_encoder's", path="file")
    image_res: int = key(REQUIRED, "image side in pixels (a multiple of patch_size)", low=1)
    patch_size: int = key(16, "ViT patch side", low=1)
    vision_stem: Literal["linear", "conv"] = key("linear", "linear: the paper's patch projection; conv: "
                                                           "stride-2 convolutions (not in the paper)")
    vision_width: int = key(768, "ViT width (= encoder_width of bert_config)", low=1)
    vision_depth: int = key(12, "ViT blocks", low=1)
    vision_heads: int = key(12, "ViT attention heads", low=1)
    vision_init: str | None = key(None, "ViT start: a timm tag, a weights file, 'synthetic' (the ViT "
                                        "pre-trained on the synthetic world) or null (random)")
    vision_drop_path: float = key(0.0, "stochastic depth rate of the ViT", low=0, high=1)

    # --- optimisation (training.optimizer) -------------------------------------------------------------
    max_epoch: int | None = key(None, "epochs to train (null: schedular.epochs, as ALBEF)", low=1)
    optimizer: Optimizer = key(REQUIRED, "the optimizer block")
    schedular: Schedule = key(REQUIRED, "the learning-rate schedule block (ALBEF's spelling)")
    clip_grad: float | None = key(None, "max gradient norm; null: no clipping", above=0)
    zero: bool = key(False, "shard the AdamW state over the ranks (ZeRO-1); no effect in one process")
    fused_adamw: bool | None = key(None, "torch's fused AdamW kernel; null: when every parameter is on CUDA")
    amp: bool | Literal["bf16"] = key(False, "true: autocast on CUDA (bf16 where supported, else fp16 with "
                                             "loss scaling); 'bf16': bf16 autocast on any device")
    grad_checkpointing: bool = key(False, "recompute ViT/BERT activations in backward: less memory, ~30 % "
                                          "more compute")
    compile: bool | Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = key(
        False, "torch.compile the training forward; true or a torch.compile mode (reduce-overhead: CUDA "
               "graphs, with static_text)")
    static_text: bool | None = key(None, "pad every training text batch to max_tokens (static shapes for "
                                         "compile and CUDA graphs); false: to the batch's longest; null: "
                                         "true when compile is on")
    fused_qkv: bool = key(True, "each BERT attention's query/key/value Linears as one product (the same "
                                "parameters and checkpoint keys); false: three products")
    amp_layer_norm: Literal["compute", "float32"] = key(
        "compute", "LayerNorm under amp: in the compute dtype (bf16/fp16, statistics in fp32, as apex) or "
                   "float32 (torch's autocast default); no effect without amp")

    # --- the run (training.trainer) --------------------------------------------------------------------
    print_freq: int = key(50, "a progress line (and a line of metrics.jsonl, a point per back-end) every "
                              "this many steps", low=1)
    report_to: list[Literal["tensorboard", "wandb"]] = key([], "logging back-ends besides log.txt and "
                                                               "metrics.jsonl: tensorboard (event files in "
                                                               "output_dir/tensorboard), wandb")
    wandb_project: str = key("grit-vlp", "W&B project (with report_to: [wandb])")
    run_name: str | None = key(None, "W&B run name; null: the output_dir folder's name")
    keep_checkpoints: int = key(0, "keep the newest this many epoch checkpoints (never the one --resume "
                                   "would take); 0: keep all", low=0)
    checkpoint_every_steps: int = key(0, "also save a checkpoint every this many steps; 0: at epoch ends "
                                         "only", low=0)
    max_skipped_steps: int = key(10, "consecutive non-finite-loss steps (each skipped) before the run saves "
                                     "and stops; 0: never stop", low=0)
    max_bad_fraction: float = key(0.01, "bad samples (missing or undecodable image, empty text) are skipped "
                                        "and counted; a larger share of an epoch stops the run",
                                  low=0, high=1)
    dist_timeout_minutes: float = key(30.0, "how long ranks wait for each other: to form the process group "
                                            "(a rank still waiting says so every minute) and in every "
                                            "collective", above=0)
    seed: int = key(42, "random seed; rank r uses seed + r")
    deterministic: bool = key(False, "torch's deterministic kernels: bitwise-repeatable runs, slower on GPUs")

    task = ""  # the script's name for the config (class attribute, not a key)

    def problems(self) -> list[str]:
        """Rules that tie several keys together (each a message naming the keys); [] when all hold."""
        out = self.optimizer.problems() + self.schedular.problems()
        if self.image_res % self.patch_size:
            out.append(f"image_res ({self.image_res}) must be a multiple of patch_size ({self.patch_size})")
        if self.vision_stem == "conv" and (self.patch_size < 2 or self.patch_size & (self.patch_size - 1)):
            out.append(f"vision_stem 'conv' needs patch_size a power of two >= 2, got {self.patch_size}")
        low, high = (self.crop_scale + [None, None])[:2]
        if len(self.crop_scale) != 2 or not 0 < low <= high <= 1:
            out.append(f"crop_scale must be two numbers 0 < low <= high <= 1, got {self.crop_scale}")
        if self.vision_init == "synthetic" and not self.synthetic_root:
            out.append("vision_init 'synthetic' (the ViT pre-trained on the synthetic world) needs "
                       "synthetic_root; set vision_init to null or to a weights file")
        if not (self.vocab_file or self.text_encoder):
            out.append("the tokenizer needs vocab_file or text_encoder; set one of them")
        if self.schedular.lr is not None and self.schedular.lr != self.optimizer.lr:
            out.append(f"schedular.lr ({self.schedular.lr}) differs from optimizer.lr ({self.optimizer.lr}); "
                       "set them equal (or leave schedular.lr out)")
        return out

    def unread(self) -> set[str]:
        """Path keys this run never opens, so a stale path there is no error."""
        return set() if self.grouped else {"batching.warmstart_indices"}

    @property
    def static_text_on(self) -> bool:
        """True when training text batches are padded to max_tokens (static_text, null: with compile)."""
        return bool(self.compile) if self.static_text is None else self.static_text

    @property
    def compile_mode(self) -> str | None:
        """torch.compile's mode for config key compile (None: not compiled)."""
        if self.compile is False:
            return None
        return "default" if self.compile is True else self.compile

    @property
    def grouped(self) -> bool:
        """True when this run deals grouped batches (GRIT's or another strategy's: batching.strategy)."""
        batching = getattr(self, "batching", None)
        return batching is not None and batching.grouped

    @property
    def train_files(self) -> list[str]:
        """train_file as a list ([] when null)."""
        return _as_list(self.train_file)

    @property
    def train_shard_specs(self) -> list[str]:
        """train_shards as a list ([] when the task has none or it is null)."""
        return _as_list(getattr(self, "train_shards", None))


@dataclass(frozen=True, kw_only=True)
class _Objectives:
    """ITC, ITM and the projections, read by the pre-training and the retrieval models."""

    embed_dim: int = key(256, "ITC projection size", low=1)
    temp: float = key(0.07, "initial ITC temperature (learnt, clamped to [0.001, 0.5])", above=0)
    lambda_cons: float = key(0.0, "weight of the consistency loss (paper Eq. 6); GRIT-VLP: 0.2", low=0)
    itm: bool = key(True, "the ITM objective; false with mlm false: the dual encoder of Table 5 (ranked by "
                          "ITC alone)")
    itm_negatives: Literal["hard", "random"] = key("hard", "ITM negatives: hard (mined from the ITC "
                                                           "similarities of the local batch) or random")
    share_image_kv: bool = key(True, "each fusion layer's cross-attention keys and values computed once "
                                     "per image and gathered for ITM's (and MLM's) rows; false: once per "
                                     "row, as ALBEF (the same numbers, ~14 % more FLOPs in pre-training)")
    itm_cls_only: bool = key(True, "ITM's pairs run the last fusion layer at [CLS] only, the one state the "
                                   "ITM head reads (its self-attention still reads every position; the same "
                                   "logits); false: every position, as ALBEF")


@dataclass(frozen=True, kw_only=True)
class PretrainConfig(_Objectives, TaskConfig):
    """Pretrain.py: ALBEF_Base with ITC(+consistency), ITM_hard and MLM on GRIT batches (paper Eq. 7)."""

    task = "pretrain"

    crop_scale: list[float] = key([0.2, 1.0], "RandomResizedCrop scale range (ALBEF pre-training: 0.2-1)")
    itc: bool = key(True, "the ITC objective (hard ITM negatives are mined from its similarities)")
    mlm: bool = key(True, "the MLM objective")
    itc_gather: bool = key(False, "ITC over the global batch (all ranks); false: the per-GPU batch, as the "
                                  "paper (N in Eq. 1)")
    hard_sampling: Literal["argmax", "multinomial"] = key("argmax", "how a hard negative is picked: argmax "
                                                                    "(the authors' code) or multinomial "
                                                                    "(ALBEF)")
    guard_false_negatives: bool = key(False, "pairs of one image or with identical captions in a batch are "
                                             "ITC positives, never ITM negatives (not in the paper)")
    guard_by: Literal["image", "scene"] = key(
        "image", "what the guard takes as one image: image, the same image file; scene, the same entry of "
                 "the scene table beside the data (scenes.json: the synthetic world's scenes, the real "
                 "corpora's families of near-copies; not in the paper)")
    mlm_probability: float = key(0.15, "MLM masking rate (ALBEF: 0.15; GRIT-VLP: 0.5)", above=0, high=1)
    contrastive_loss: Literal["softmax", "sigmoid"] = key(
        "softmax", "ITC's form (models.losses): softmax, the paper's Eq. 1-2 (with lambda_cons, "
                   "itc_hn_beta, itc_smoothing); sigmoid, SigLIP's pairwise loss with its own temperature "
                   "and bias (not in the paper)")
    itc_hn_beta: float = key(0.0, "HN-NCE (Radenovic et al. 2023): ITC's negatives weighted by exp(beta x "
                                  "logit), normalised; 0: the paper's ITC", low=0)
    itc_smoothing: float = key(0.0, "MAFA's S-ITC: ITC targets smoothed towards uniform by this much; 0: the "
                                    "paper's one-hot targets", low=0, high=0.99)
    itc_smoothing_epoch: int = key(0, "the first epoch S-ITC smooths (before it: the paper's targets)", low=0)
    share_caption_attention: bool = key(True, "with share_image_kv: the first fusion layer's self-attention "
                                              "once per caption, not once per ITM pair (it reads the caption "
                                              "alone; the same numbers; with dropout, pairs of one caption "
                                              "share that sub-layer's draw); false: once per pair, as ALBEF")
    mlm_masked_only: bool = key(True, "MLM vocabulary logits only at the masked positions (a fixed-size "
                                      "selection, no host sync); false: at every position, as ALBEF")
    image_token_drop: float = key(0.0, "share of each image's patch tokens dropped in every training step "
                                       "(FLIP; timm's PatchDropout: a fresh random subset of fixed size per "
                                       "image, [CLS] kept, after the positional embeddings); ITC, ITM and "
                                       "MLM see the same kept tokens, evaluation sees all; 0: the paper's "
                                       "step (not in the paper)", low=0, high=0.95)
    unmasked_epochs: int = key(0, "with image_token_drop: the run's last this many epochs see every token "
                                  "(FLIP's unmasked tuning); 0: dropping to the end", low=0)
    batch_pictures: bool = key(True, "each epoch's first batch drawn into batches/ with its captions and "
                                     "hardest negatives (training.pictures, matplotlib; rank 0); false: none")
    batch_size: int = key(REQUIRED, "per-rank batch N: one GRIT group per local batch", low=1)
    batching: Batching = key(Batching(), "how batches are formed: GRIT, random or a later strategy, and the "
                                         "sampler's queues (the old spelling `grit:` is read as it)")

    # --- web-scale data (dataset.shards, dataset.corpus) ------------------------------------------------
    train_file: str | list[str] | None = key(None, "json list(s) of training entries (ALBEF's format); "
                                                   "null when train_shards holds all the data", path="file")
    train_shards: str | list[str] | None = key(None, "tar shards in img2dataset's layout, each entry a "
                                                     "shard-index json (wids' format, as tools.make_shards "
                                                     "writes them), a folder of .tar shards (img2dataset's "
                                                     "output folder), a glob or a brace pattern of .tar "
                                                     "files; after train_file in the index space")
    train_repeat: dict[str, int] = key({}, "integer repeat factor per source, keyed by a train_file or "
                                           "train_shards entry as written; each copy has its own indices")
    shard_cache_dir: str | None = key(None, "wids' cache: remote shards are downloaded here, local ones only "
                                            "linked; null: $WIDS_CACHE or /tmp/_wids_cache")
    shard_lru_size: int = key(64, "open shards kept per loader worker (wids' lru_size; wids refuses more "
                                  "than 100 open files); GRIT's order visits shards at random",
                              low=1, high=100)

    def inactive_settings(self) -> list[str]:
        """The loss and epoch switches that would not act in this run, one message each."""
        out = [f"{k} is {getattr(self, k)} but itc is false: {what} acts on ITC only; drop it"
               for k, what in (("itc_hn_beta", "HN-NCE"), ("itc_smoothing", "S-ITC"))
               if not self.itc and getattr(self, k)]
        if self.itc and self.contrastive_loss == "sigmoid":
            out += [f"{k} is {getattr(self, k)} but contrastive_loss is sigmoid: {what} acts on the softmax "
                    f"ITC only; drop it" for k, what in (("lambda_cons", "the consistency loss"),
                                                        ("itc_hn_beta", "HN-NCE"), ("itc_smoothing", "S-ITC"))
                    if getattr(self, k)]
        if self.itc_smoothing and self.itc_smoothing_epoch >= self.max_epoch:
            out.append(f"itc_smoothing_epoch ({self.itc_smoothing_epoch}) is not before the run's end "
                       f"(max_epoch {self.max_epoch}): S-ITC would never smooth")
        if self.unmasked_epochs and not self.image_token_drop:
            out.append(f"unmasked_epochs is {self.unmasked_epochs} but image_token_drop is 0: every epoch "
                       "sees every token already; drop it")
        elif self.image_token_drop and self.unmasked_epochs >= self.max_epoch:
            out.append(f"unmasked_epochs ({self.unmasked_epochs}) is not below max_epoch ({self.max_epoch}): "
                       "image_token_drop would never drop a token")
        if self.guard_by != "image" and not self.guard_false_negatives:
            out.append(f"guard_by is {self.guard_by} but guard_false_negatives is false: it chooses what the "
                       "guard takes as one image; drop it or set guard_false_negatives: true")
        if self.grouped and self.batching.group_from_epoch >= self.max_epoch:
            out.append(f"batching.group_from_epoch ({self.batching.group_from_epoch}) is not before the "
                       "run's end "
                       f"(max_epoch {self.max_epoch}): no epoch would be grouped")
        return out

    @property
    def strategy(self) -> str:
        """The batch-construction strategy this run uses (batching.strategy)."""
        return self.batching.strategy

    def sampler_options(self) -> dict[str, Any]:
        """grit.GritSampler's keyword arguments: the batching block's sizes, the strategy and its options."""
        return self.batching.sampler_options()

    def problems(self) -> list[str]:
        """Settings that cannot act (first: they name the key to drop), TaskConfig's rules, the objectives'
        and the batching's."""
        out = self.inactive_settings() + super().problems() + self.batching.problems(self.batch_size)
        if not (self.train_file or self.train_shards):
            out.append("no training data: set train_file (json lists) or train_shards (tar shards), or both")
        sources = self.train_files + self.train_shard_specs
        for name, times in self.train_repeat.items():
            if name not in sources:
                out.append(f"train_repeat names {name!r}, which is no train_file or train_shards entry "
                           f"(those are: {', '.join(map(repr, sources))})")
            if times < 1:
                out.append(f"train_repeat of {name!r} must be an integer >= 1, got {times}")
        if not (self.itc or self.itm or self.mlm):
            out.append("itc, itm and mlm are all false: nothing to train")
        if self.itm and not self.itc and self.itm_negatives == "hard":
            out.append("itc false with itm_negatives 'hard': hard ITM negatives are mined from the ITC "
                       "similarities; set itm_negatives: random or itc: true")
        return out


@dataclass(frozen=True, kw_only=True)
class _Finetune:
    """Evaluation splits and batch sizes of the fine-tuning scripts (training.trainer)."""

    val_file: str | list[str] | None = key(None, "json list(s) of the validation split", path="file")
    test_file: str | list[str] | None = key(None, "json list(s) of the test split", path="file")
    batch_size_train: int = key(REQUIRED, "per-rank training batch", low=1)
    batch_size_test: int = key(64, "per-rank evaluation batch", low=1)


@dataclass(frozen=True, kw_only=True)
class RetrievalConfig(_Objectives, _Finetune, TaskConfig):
    """Retrieval.py: queue ITC against a momentum encoder + ITM_hard, and recall evaluation (S.M. D)."""

    task = "retrieval"

    hard_sampling: Literal["argmax", "multinomial"] = key(
        "multinomial", "how a hard negative is picked: multinomial (ALBEF's fine-tuning) or argmax")
    queue_size: int = key(65536, "momentum feature queue length (ALBEF: 65536)", low=1)
    momentum: float = key(0.995, "EMA rate of the momentum encoder", low=0, high=1)
    momentum_init: Literal["initial", "checkpoint"] = key("initial", "momentum encoder start: the initial "
                                                                     "weights (S.M. D) or the checkpoint's")
    k_test: int = key(256, "ITC candidates per query that ITM re-ranks", low=1)
    rerank_pairs: int = key(256, "image-text pairs per ITM re-ranking pass", low=1)
    text_batch_size: int = key(256, "captions per text-encoder pass in evaluation", low=1)
    save_rankings: bool = key(True, "write rankings_{val,test}.json (every query's top k with scores)")

    def problems(self) -> list[str]:
        """TaskConfig's rules and the evaluation splits."""
        return super().problems() + [f"{k} is required for retrieval" for k in ("val_file", "test_file")
                                     if not getattr(self, k)]


@dataclass(frozen=True, kw_only=True)
class NLVRConfig(_Finetune, TaskConfig):
    """NLVR.py: text assignment (stage 1, text_assignment: true), then NLVR2 fine-tuning (S.M. D)."""

    task = "nlvr"

    text_assignment: bool = key(False, "stage 1 on pre-training data: caption -> first image, second image "
                                       "or neither; false: stage 2, NLVR2 fine-tuning")
    embed_dim: int = key(256, "size of the stage-1 model's frozen vision_proj (as the pre-training's)", low=1)
    ta_head: Literal["linear", "mlp"] = key("linear", "stage-1 classifier: linear (the authors' layout) or "
                                                      "mlp")

    def problems(self) -> list[str]:
        """TaskConfig's rules; stage 2 needs its evaluation splits."""
        out = super().problems()
        if not self.text_assignment:
            out += [f"{k} is required for NLVR2 fine-tuning (for the text-assignment stage set "
                    "text_assignment: true)" for k in ("val_file", "test_file") if not getattr(self, k)]
        return out

    def unread(self) -> set[str]:
        """Stage 1 has no evaluation split."""
        return super().unread() | ({"val_file", "test_file"} if self.text_assignment else set())


@dataclass(frozen=True, kw_only=True)
class VQAConfig(_Finetune, TaskConfig):
    """VQA.py: fine-tuning with an answer decoder, ranking the answer list (S.M. D, as ALBEF)."""

    task = "vqa"

    batch_size_test: int = key(16, "per-rank evaluation batch", low=1)
    answer_list: str = key(REQUIRED, "json list of candidate answers", path="file")
    k_test: int = key(128, "answers re-ranked by full likelihood after the first-token scores", low=1)
    embed_dim: int = key(256, "not read by VQA (no ITC projection); accepted so a config can mirror the "
                              "pre-training model's keys", low=1)

    def problems(self) -> list[str]:
        """TaskConfig's rules; the test split is required (val_file is optional here)."""
        return super().problems() + ([] if self.test_file else ["test_file is required for VQA"])


TASK_CONFIGS: dict[str, type[TaskConfig]] = {c.task: c for c in (PretrainConfig, RetrievalConfig, NLVRConfig,
                                                                    VQAConfig)}


def config_class(task: str) -> type[TaskConfig]:
    """The config class of task 'pretrain', 'retrieval', 'nlvr' or 'vqa'."""
    if task not in TASK_CONFIGS:
        raise ValueError(f"unknown task {task!r}; expected one of {tuple(TASK_CONFIGS)}")
    return TASK_CONFIGS[task]
