"""GRIT-VLP pre-training (paper Sec. 4): ALBEF_Base trained with ITC_cons + ITM_hard + MLM_50 on GRIT batches.

    python Pretrain.py --config configs/tiny/Pretrain.yaml --output_dir output/pretrain_tiny
    torchrun --nproc_per_node=4 Pretrain.py --config configs/Pretrain.yaml --output_dir output/Pretrain
    python -m torch.distributed.launch --nproc_per_node=4 --use_env Pretrain.py \
        --config configs/Pretrain.yaml --output_dir output/Pretrain

log.txt gets one JSON line per epoch (training.trainer): the four losses, hardness and
hardness_t2i (mean ITC similarity of each image's hardest in-batch text negative, and of each
text's hardest image negative), with ITM itm_accuracy and itm_match_accuracy (the share of its 3B pairs
classified right and of its B matches called a match: 2/3 and 0 at chance), where the data has a scene
table itm_false_negatives (with ITM: the share of mined ITM negatives that show the anchor's scene) and
batch_same_scene (the share of examples whose batch holds another of their scene: the false negatives a
batch contains, before the guard), batch_groups (grouped epochs: how many sub-queues a batch draws from)
and sampler_seconds (the batching strategy's collection and grouping).

With an online selection strategy (batching.strategy jest or rho; grit.online) each step's loader batch is
a super-batch of k x N candidates; the step scores them with no-grad forwards of the learner's uni-modal
encoders and of the frozen reference model (batching.<strategy>.reference), trains on the N selected, and
the record adds selection_gflop_per_step (the scoring forwards' FLOPs per rank and step, counted once) and,
on the CPU, selection_seconds; selections/epoch_EE.pt keeps every step's candidates and selection
(tools.check_selections checks them).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset
from transformers import BatchEncoding

from dataset import ImageTextCollate, create_dataset
from dataset.bad_samples import SkipBadCollate, SkipBadSamples
from grit import GritSampler
from grit.online import OnlineSampler
from models.false_negatives import mined_false_negative_rate, same_group_share
from models.loading import load_weights
from models.pretrain import ALBEF_Base
from models.tokenization import build_tokenizer
from training.cli import run_main, script_parser, start
from training.config import PretrainConfig
from training.config_files import ConfigError
from training.distributed import is_main_process, print_main
from training.flops import flop_counter_mode
from training.inputs import prepare_inputs
from training.loaders import build_sampler, check_global_batch
from training.pictures import batch_grid, denormalize
from training.reproducibility import make_generator
from training.task import Task
from training.trainer import Trainer

PARSER = script_parser(
    "Pretrain.py", __doc__.splitlines()[0],
    no_evaluate="pre-training has no evaluation split of its own; evaluate a checkpoint zero-shot with "
                "`python Retrieval.py --config configs/tiny/Retrieval.yaml --checkpoint CKPT --evaluate "
                "--output_dir DIR` and its ITM with "
                "`python -m tools.probe --config CONFIG --checkpoint CKPT`")


class PretrainTask(Task):
    """ALBEF_Base's four losses on GRIT batches; after every step GRIT collects the batch's CLS projections,
    and at every epoch end it groups them into the next epoch's batches."""

    name = "Pretrain"

    def __init__(self, model: ALBEF_Base, dataset: SkipBadSamples, collate: SkipBadCollate,
                 sampler: GritSampler | OnlineSampler, config: PretrainConfig, device: torch.device,
                 generator: torch.Generator, tokenizer, reference: ALBEF_Base | None = None,
                 output_dir: str | None = None) -> None:
        super().__init__(model, dataset, collate, sampler, config.batch_size, generator)
        self.config, self.device, self.tokenizer = config, device, tokenizer
        # Online selection: the frozen reference model (None with score hard_learner) and where the epochs'
        # records of candidates and selections go.
        self.online = isinstance(sampler, OnlineSampler)
        self.reference, self.output_dir = reference, output_dir
        self.selection_flops: int | None = None  # the scoring forwards' FLOPs per step, counted at step 1
        self.selection_seconds = 0.0
        self.shown: dict | None = None  # the epoch's first batch, for its picture (see pictures())
        # The scene each entry shows, where the data has a scene table (the synthetic world, the real
        # corpora's families): the truth behind itm_false_negatives (the share of mined ITM negatives that
        # show the anchor's scene) and batch_same_scene (the share of examples whose batch holds another of
        # their scene).
        scenes = getattr(dataset, "scene_ids", None)
        self.scene_ids = None if scenes is None else scenes.to(device)
        # Per-entry image ids on the device: a step looks its batch up by a gather, without a host sync
        # (the model's false-negative guard, config keys guard_false_negatives and guard_by; D int64s, so
        # only with it). guard_by scene: the scene ids, so a scene's (a family's) entries are one image.
        self.image_keys = None
        if config.guard_false_negatives and config.guard_by == "scene":
            if self.scene_ids is None:
                raise ValueError(f"config key 'guard_by' is 'scene', but the training data "
                                 f"({', '.join(config.train_files + config.train_shard_specs)}) has no "
                                 "scene table (scenes.json beside each json list); set guard_by: image")
            self.image_keys = self.scene_ids
        elif config.guard_false_negatives:
            self.image_keys = torch.as_tensor(dataset.image_keys, dtype=torch.long, device=device)
        self.sampler_seconds = 0.0
        self.features: dict[str, Tensor | None] = {}

    def step(self, model: nn.Module, batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The losses of one batch; its detached projections are kept for after_step."""
        idx = batch.ids.to(self.device, non_blocking=True)  # once: the guard's lookup and GRIT's collect
        valid = batch.valid_on(self.device)  # None without bad samples: the paper's computation
        image, text = batch.image.to(self.device, non_blocking=True), batch.text.to(self.device)
        if self.online:  # the N of the k x N candidates that the selection trains on
            keep = self.select(image, text, idx, valid)
            image, idx = image.index_select(0, keep), idx.index_select(0, keep)
            text = BatchEncoding({k: v.index_select(0, keep) for k, v in text.items()})
            valid = None if valid is None else valid.index_select(0, keep)
        out = model(image, text, image_key=None if self.image_keys is None else self.image_keys[idx],
                    valid=valid)
        # fp32 even under autocast: these feed the sampler's queues.
        image_feat, text_feat = out["image_feat"].detach().float(), out["text_feat"].detach().float()
        self.features = {"image": image_feat, "text": text_feat, "idx": idx, "valid": valid}
        # The epoch's first batch, for its picture (batch_pictures): device tensors kept, copied at its end.
        if self.config.batch_pictures and self.shown is None and is_main_process():
            # Copies: under compile's CUDA graphs the outputs' memory is reused by the next step.
            self.shown = {"image": image[:8], "ids": text["input_ids"][:8],
                          "image_feat": image_feat[:8].clone(), "text_feat": text_feat[:8].clone()}
        objectives = self.model.objectives
        metrics = {k: out[k].detach() for k in objectives.loss_names}
        metrics["hardness"] = out["hardness"]
        metrics["hardness_t2i"] = out["hardness_t2i"]
        # The objectives' own (ITM: itm_accuracy, itm_match_accuracy, 2/3 and 0 at chance).
        metrics |= {k: out[k] for k in objectives.metric_names}
        if self.scene_ids is not None:
            scenes = self.scene_ids[idx]
            metrics["batch_same_scene"] = same_group_share(scenes, valid)
            if self.config.itm:
                metrics["itm_false_negatives"] = mined_false_negative_rate(
                    scenes, out["neg_text_idx"], out["neg_image_idx"], valid)
        return out["loss"], metrics

    def select(self, image: Tensor, text, idx: Tensor, valid: Tensor | None) -> Tensor:
        """Online selection: the super-batch's contrastive logits under the learner and the reference (no
        grad, eval mode) -> the positions (N,) the sampler's strategy selects. The first call counts the
        scoring forwards' FLOPs."""
        start = time.perf_counter()
        counter = flop_counter_mode() if self.selection_flops is None else None
        with counter if counter is not None else contextlib.nullcontext():
            key = None if self.image_keys is None else self.image_keys[idx]
            learner, kind = self.model.contrastive_logits(image, text, key)
            reference = None
            if self.reference is not None:
                reference, ref_kind = self.reference.contrastive_logits(image, text, key)
                if ref_kind != kind:  # built from this config, so only a mismatched checkpoint gets here
                    raise ValueError(f"the reference model scores with a {ref_kind} loss, the learner with "
                                     f"{kind}")
        if counter is not None:
            self.selection_flops = counter.get_total_flops()
        keep = self.sampler.select(learner, reference, kind, idx, valid)
        self.selection_seconds += time.perf_counter() - start  # on a GPU: the launch time only (not logged)
        return keep

    def after_step(self, metrics: dict[str, Tensor], batch, skipped: bool) -> None:
        """GRIT phase 1 (and, when the queue is full, phases 2-3) on the step's detached projections.

        Bad samples, and the whole batch of a skipped step, are collected as invalid: never grouped, they
        come back next epoch like unseen indices."""
        start = time.perf_counter()
        feats = self.features
        valid = torch.zeros_like(feats["idx"], dtype=torch.bool) if skipped else feats["valid"]
        self.sampler.collect(feats["image"], feats["text"], feats["idx"], valid)
        self.sampler_seconds += time.perf_counter() - start

    def start_epoch(self, epoch: int) -> None:
        """The epoch's batches: GRIT's groups from the last epoch (naive mode: from an extra pass now)."""
        start = time.perf_counter()
        self.sampler_seconds = self.selection_seconds = 0.0
        naive = self.naive_pass if self.config.batching.mode == "naive" else None
        self.sampler.set_epoch(epoch, naive_pass=naive)
        self.model.start_epoch(epoch)  # S-ITC's start, the image-token dropout's unmasked phase
        self.sampler_seconds += time.perf_counter() - start

    def end_epoch(self, epoch: int) -> dict[str, float]:
        """Group the partial queue and compose the next epoch's batches; log GRIT's time this epoch."""
        start = time.perf_counter()
        groups = self.sampler.groups_per_batch  # of this epoch's batches (before end_epoch composes the next)
        self.sampler.end_epoch()
        self.sampler_seconds += time.perf_counter() - start
        extra = {} if groups is None else {"batch_groups": round(groups, 4)}
        if self.online:
            extra |= self.write_selections(epoch)
        return {"sampler_seconds": round(self.sampler_seconds, 3), **extra}

    def write_selections(self, epoch: int) -> dict[str, float]:
        """selections/epoch_EE.pt (rank 0): the epoch's candidates and selections of every rank and step
        (grit.online.OnlineSampler.epoch_record); the record's selection cost."""
        record = self.sampler.epoch_record()  # on every rank: the same, gathered as the steps went
        if self.output_dir and is_main_process():
            path = os.path.join(self.output_dir, "selections", f"epoch_{epoch:02d}.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(record, path)
        out = {"selection_gflop_per_step": round((self.selection_flops or 0) / 1e9, 6)}
        if self.device.type == "cpu":  # elsewhere the launches return before the work is done
            out["selection_seconds"] = round(self.selection_seconds, 3)
        return out

    def summary(self) -> list[str]:
        """The start-up summary's task lines: empty tar shards, if any, and GRIT's sizes."""
        batching, N = self.config.batching, self.config.batch_size
        empty = self.dataset.empty_shards()
        lines = [f"{len(empty)} empty shard{'s' * (len(empty) != 1)} (0 samples) left out: "
                 + ", ".join(empty[:5]) + (", ..." if len(empty) > 5 else "")] if empty else []
        if self.online:
            selection = self.sampler.selection
            reference = (f"reference {selection.reference}" if self.reference is not None
                         else "no reference model")
            steps = self.sampler.batches_per_epoch
            return [*lines, f"batching.strategy {self.config.strategy} ({selection.describe()}): super-"
                    f"batches of {selection.candidates} per rank, random every epoch, {steps} steps per "
                    f"epoch; {reference}"]
        if not self.config.grouped:
            return [*lines, "batching.strategy random: random batches every epoch (the ALBEF baseline)"]
        W = self.sampler.num_replicas
        first_grouped = self.sampler.first_grouped
        if batching.warmstart_indices:
            first = "epoch 0 from batching.warmstart_indices"
        elif first_grouped == 0:
            first = "grouped batches from epoch 0"
        else:
            random_epochs = "epoch 0" if first_grouped == 1 else f"epochs 0-{first_grouped - 1}"
            first = f"{random_epochs} random, grouped batches from epoch {first_grouped}"
        return [*lines, f"batching.strategy {self.config.strategy} ({self.sampler.grouping.describe()}), "
                f"{batching.mode}: groups of N = {N} per rank from sub-queues of M = {batching.search_space} "
                f"in queues of L = {batching.queue_size}, W = {W} ranks, D = {self.sampler.dataset_len:,}; "
                f"{first}"]

    def grouped(self, epoch: int) -> bool:
        """True when epoch `epoch`'s batches are GRIT groups (not random)."""
        return self.config.grouped and epoch >= self.sampler.first_grouped

    def pictures(self, epoch: int, output_dir: str) -> dict[str, str]:
        """batches/epoch_EE_{grouped|random}.png: the epoch's first batch on rank 0 (up to 8 of its samples),
        each with its caption and its hardest in-batch negative (training.pictures)."""
        shown, self.shown = self.shown, None
        if shown is None:
            return {}
        kind = "grouped" if self.grouped(epoch) else "random"
        captions = self.tokenizer.batch_decode(shown["ids"].cpu(), skip_special_tokens=True)
        similarity = shown["image_feat"].float() @ shown["text_feat"].float().T
        what = f"a {self.config.strategy} batch (one group)" if kind == "grouped" else "a random batch"
        path = batch_grid(denormalize(shown["image"]), captions, similarity.cpu(),
                          os.path.join(output_dir, "batches", f"epoch_{epoch:02d}_{kind}.png"),
                          f"epoch {epoch}: {what} - red: each image's hardest in-batch negative caption")
        return {f"batches/{kind}": path} if path else {}

    def naive_pass(self, indices: Tensor) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """GRIT's naive mode (Remark 2): a no-grad pass of the uni-modal encoders over this rank's share
        of a fresh permutation -> (image_feat (N,d), text_feat (N,d), index (N,), valid (N,)) batches."""
        loader = DataLoader(Subset(self.dataset, indices.tolist()), batch_size=self.batch_size,
                            num_workers=self.config.num_workers, collate_fn=self.collate)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for batch in loader:
                image_feat, text_feat = self.model.unimodal_features(batch.image.to(self.device),
                                                                     batch.text.to(self.device))
                yield image_feat, text_feat, batch.ids.to(self.device), batch.valid.to(self.device)
        self.model.train(was_training)


def load_reference(config: PretrainConfig, tokenizer, device: torch.device) -> ALBEF_Base | None:
    """Online selection's reference model: this config's ALBEF_Base with the weights of
    batching.<strategy>.reference, loaded strictly, in eval mode and frozen (never updated, never saved);
    None when the strategy scores without one."""
    batching = config.batching
    path = getattr(batching, batching.strategy).reference if batching.online else None
    if path is None or getattr(batching, batching.strategy).score == "hard_learner":
        return None
    reference = ALBEF_Base(config, tokenizer)
    try:
        report = load_weights(reference, path, strict=True)
    except ValueError as e:
        raise ConfigError(f"batching.{batching.strategy}.reference: {path} is not a checkpoint of this "
                          f"config's model ({e})") from None
    print_main(f"reference model (frozen): {report.summary()}")
    return reference.to(device).eval().requires_grad_(False)


def main(argv: Sequence[str] | None = None) -> dict:
    """Pre-train from the command line; returns the last epoch's log record."""
    run = start(argv, PARSER, "pretrain")
    config, info = run.config, run.info
    prepare_inputs(config)  # the synthetic world and its ViT, generated on first use

    tokenizer = build_tokenizer(config)
    dataset = SkipBadSamples(create_dataset("pretrain", config))
    # An online strategy's loader takes super-batches of k x batch_size per process.
    factor = config.batching.loader_factor
    what = "batch_size" if factor == 1 else f"batch_size x batching.{config.strategy}.super_batch"
    check_global_batch(len(dataset), config.batch_size * factor, info.world_size,
                       config.train_files + config.train_shard_specs, what)
    sampler = build_sampler(config, dataset, info.world_size, info.rank, info.device)
    collate = SkipBadCollate(ImageTextCollate(tokenizer, config.max_tokens, config.static_text_on))

    model = ALBEF_Base(config, tokenizer).to(info.device)
    if run.args.checkpoint:  # the start; with --resume, a checkpoint found in output_dir then replaces it
        print_main(load_weights(model, run.args.checkpoint).summary())
    reference = load_reference(config, tokenizer, info.device)
    # The loader draws its workers' base seed from its own generator, not the global stream, so that
    # creating the iterator on resume does not shift the random numbers the model draws.
    task = PretrainTask(model, dataset, collate, sampler, config, info.device,
                        make_generator(config.seed + info.rank), tokenizer, reference,
                        str(run.args.output_dir))
    return Trainer(run, task).fit()


if __name__ == "__main__":
    run_main(main)
