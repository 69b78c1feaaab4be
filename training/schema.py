"""The config keys each task script accepts and their types: TASKS, Type and keys(task).

A schema maps dotted keys ('grit.search_space', 'optimizer.lr') to a Type; a key that has dotted keys
below it is a block (a mapping). Path types carry `path` ('file' or 'dir'), so that start-up
validation (training.validation) knows which values name data files and folders. Values are checked
after training.config.to_plain, i.e. as plain bool / int / float / str / list / dict / None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

TASKS = ('pretrain', 'retrieval', 'nlvr', 'vqa')


@dataclass(frozen=True)
class Type:
    """A value type: `name` for messages, `accepts(value)` its test; `path` 'file' or 'dir' for paths."""

    name: str
    accepts: Callable[[Any], bool]
    path: str | None = None

    def __or__(self, other: Type) -> Type:
        """Either type ('int or null'); a path kind carries over."""
        return Type(f'{self.name} or {other.name}', lambda v: self.accepts(v) or other.accepts(v),
                    self.path or other.path)


def list_of(item: Type) -> Type:
    """A list whose every item is `item`."""
    return Type(f'list of {item.name}', lambda v: isinstance(v, list) and all(item.accepts(x) for x in v),
                item.path)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # bool is an int subclass


def _is_numeric_str(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


BOOL = Type('bool', lambda v: isinstance(v, bool))
INT = Type('int', lambda v: isinstance(v, int) and not isinstance(v, bool))
FLOAT = Type('float', _is_number)  # an int is a float: `lambda_cons: 0`
# training.optimizer reads its numbers with float(), which also takes a YAML 1.1 string such as '1e-4'.
NUMBER = Type('number', lambda v: _is_number(v) or (isinstance(v, str) and _is_numeric_str(v)))
STR = Type('str', lambda v: isinstance(v, str))
NULL = Type('null', lambda v: v is None)
MAPPING = Type('mapping', lambda v: isinstance(v, dict))
FILE = Type('str', STR.accepts, path='file')
FILES = FILE | list_of(FILE)  # load_json_list takes one path or a list
DIR = Type('str', STR.accepts, path='dir')

# The optimizer block (training.optimizer.build_optimizer).
_OPTIMIZER = {'opt': STR, 'lr': NUMBER, 'weight_decay': NUMBER, 'betas': list_of(NUMBER), 'eps': NUMBER}
# The schedule block (training.optimizer.build_scheduler); ALBEF's decay_rate, cooldown_epochs and
# warmup_epochs are accepted and ignored there (warmup_epochs with a warning), so ALBEF configs load.
_SCHEDULE = {'sched': STR, 'lr': NUMBER, 'epochs': INT, 'min_lr': NUMBER, 'warmup_lr': NUMBER,
             'warmup_steps': INT, 'warmup_epochs': NUMBER, 'decay_rate': NUMBER, 'cooldown_epochs': NUMBER}


def _block(name: str, entries: Mapping[str, Type]) -> dict[str, Type]:
    return {name: MAPPING, **{f'{name}.{k}': t for k, t in entries.items()}}


# Keys every script reads: data (dataset.create_dataset, dataset.prepare_data), tokenizer and encoders
# (models.tokenization, models.vit, models.bert), optimisation and the training loop (training/).
_COMMON: dict[str, Type] = {
    'train_file': FILES,
    'image_root': DIR | NULL,  # '' or null: json image paths are used as they are
    'synthetic_root': STR | NULL,  # generated on first use, so it need not exist yet
    'max_words': INT,
    'max_tokens': INT,
    'hflip': BOOL,
    'randaugment': BOOL,
    'crop_scale': list_of(FLOAT) | NULL,
    'num_workers': INT,
    'bert_config': FILE,
    'text_encoder': STR | NULL,  # a hub id or a local directory
    'vocab_file': FILE | NULL,
    'image_res': INT,
    'patch_size': INT,
    'vision_stem': STR,
    'vision_width': INT,
    'vision_depth': INT,
    'vision_heads': INT,
    'vision_init': STR | NULL,  # a timm tag or a weights file
    'vision_drop_path': FLOAT,
    'max_epoch': INT,
    **_block('optimizer', _OPTIMIZER),
    **_block('schedular', _SCHEDULE),  # ALBEF's spelling
    **_block('scheduler', _SCHEDULE),  # read when there is no 'schedular' (training.config.schedule_block)
    'clip_grad': FLOAT | NULL,
    'zero': BOOL,  # training.optimizer.build_optimizer: shard the AdamW state over the ranks
    'fused_adamw': BOOL | NULL,  # null: fused AdamW when the parameters are on CUDA
    'amp': BOOL | STR,  # true (CUDA autocast) or 'bf16' (bf16 autocast on any device)
    'grad_checkpointing': BOOL,  # models.vit, models.bert: recompute encoder activations in backward
    'compile': BOOL,
    'print_freq': INT,
    'checkpoint_every_steps': INT | NULL,
    'max_skipped_steps': INT,
    'max_bad_fraction': FLOAT,
    'seed': INT,
    'deterministic': BOOL,
}

# The pre-training objectives (models.pretrain; retrieval reads some of them too).
_OBJECTIVES: dict[str, Type] = {
    'embed_dim': INT,
    'temp': FLOAT,
    'lambda_cons': FLOAT,
    'itm': BOOL,
    'itm_negatives': STR,
    'hard_sampling': STR,
}

_PRETRAIN: dict[str, Type] = {
    **_OBJECTIVES,
    'itc': BOOL,
    'mlm': BOOL,
    'itc_gather': BOOL,
    'guard_false_negatives': BOOL,
    'mlm_probability': FLOAT,
    'batch_size': INT,
    'grit': MAPPING | NULL,  # null: GRIT off
    'grit.enabled': BOOL,
    'grit.queue_size': INT | NULL,  # null is allowed while GRIT is off
    'grit.search_space': INT | NULL,
    'grit.example_shuffle': BOOL,
    'grit.batch_shuffle': BOOL,
    'grit.mode': STR,
    'grit.warmstart_indices': FILE | NULL,
    'grit.shard_grouping': BOOL,
}

# Fine-tuning (training.loop.run_finetune) and evaluation splits.
_FINETUNE: dict[str, Type] = {
    'val_file': FILES,
    'test_file': FILES,
    'batch_size_train': INT,
    'batch_size_test': INT,
}

_RETRIEVAL: dict[str, Type] = {
    **_FINETUNE,
    **_OBJECTIVES,
    'queue_size': INT,
    'momentum': FLOAT,
    'momentum_init': STR,
    'k_test': INT,
    'rerank_pairs': INT,
    'text_batch_size': INT,
    'save_rankings': BOOL,
}

_NLVR: dict[str, Type] = {
    **_FINETUNE,
    'text_assignment': BOOL,
    'embed_dim': INT,  # the text-assignment stage's frozen vision_proj
}

_VQA: dict[str, Type] = {
    **_FINETUNE,
    'val_file': FILES | NULL,  # optional: evaluated after every epoch when given
    'answer_list': FILE,
    'k_test': INT,
    # Not read by VQA (no ITC projection), accepted so that a config can mirror the pre-training model
    # keys, as configs/tiny/VQA.yaml does.
    'embed_dim': INT,
}

_SCHEMAS: dict[str, dict[str, Type]] = {
    'pretrain': {**_COMMON, **_PRETRAIN},
    'retrieval': {**_COMMON, **_RETRIEVAL},
    'nlvr': {**_COMMON, **_NLVR},
    'vqa': {**_COMMON, **_VQA},
}


def keys(task: str) -> Mapping[str, Type]:
    """The dotted keys `task` accepts, each with its Type (a block's own key has type mapping)."""
    if task not in _SCHEMAS:
        raise ValueError(f'unknown task {task!r}; expected one of {TASKS}')
    return _SCHEMAS[task]


def tasks_with(key: str) -> list[str]:
    """The tasks whose schema has `key` (for a hint when a config is given to the wrong script)."""
    return [t for t in TASKS if key in _SCHEMAS[t]]
