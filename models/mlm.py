"""MLM: BERT's masking of the input tokens (paper: ALBEF's MLM with 50 % masking) and the fixed-size
selection of the masked positions at which the vocabulary logits are computed (mlm_masked_only).

Pure functions of tensors, shared by the pre-training and the VQA/NLVR models' objectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .objectives import assert_on_device

__all__ = ["mask_tokens", "mlm_capacity", "select_masked"]


def mask_tokens(
    input_ids: Tensor,
    vocab_size: int,
    mask_token_id: int,
    special_ids: Sequence[int],
    probability: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """BERT masking: input_ids (B, L) -> (masked_ids (B, L), labels (B, L), -100 where not selected).

    Each token whose id is not in special_ids is selected with `probability`; of the selected,
    80 % become mask_token_id, 10 % a token drawn uniformly from [0, vocab_size), 10 % stay. Labels
    hold the original id at selected positions. Following ALBEF, pass special_ids=[pad, cls]: [SEP]
    stays maskable. The generator must live on input_ids' device; with it the result is reproducible.
    """
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"mask_tokens: probability must be in [0, 1], got {probability}")
    if vocab_size <= 0:
        raise ValueError(f"mask_tokens: vocab_size must be positive, got {vocab_size}")
    maskable = torch.ones_like(input_ids, dtype=torch.bool)
    for special in special_ids:  # a handful of ids, not the batch
        maskable &= input_ids != special
    # In-place draws into new_empty (the same numbers torch.rand / torch.randint give) keep the shape
    # symbolic under torch.compile, where captions padded to the longest vary in length per batch.
    draw = input_ids.new_empty((3, *input_ids.shape), dtype=torch.float).uniform_(generator=generator)
    selected = (draw[0] < probability) & maskable
    to_mask = selected & (draw[1] < 0.8)
    # Half of the remaining 20 %: 10 % of the selected tokens overall.
    to_random = selected & ~to_mask & (draw[2] < 0.5)
    if generator is None:
        # The same numbers as the in-place draw below; torch.compile traces randint_like but not random_.
        random_ids = torch.randint_like(input_ids, 0, vocab_size)
    else:  # randint_like takes a generator only in recent torch
        random_ids = torch.empty_like(input_ids).random_(0, vocab_size, generator=generator)
    masked_ids = torch.where(to_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    masked_ids = torch.where(to_random, random_ids, masked_ids)
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    return masked_ids, labels


# Standard deviations above the mean number of masked tokens that mlm_capacity keeps room for: a batch
# masks more than that with probability < 1e-15 (the Gaussian tail; Chernoff's bound is of that order).
_CAPACITY_SDS = 8.0


def mlm_capacity(tokens: int, probability: float) -> int:
    """How many of a batch's `tokens` positions MLM keeps logits for when each is masked with
    `probability`: the mean of Binomial(tokens, probability) plus 8 standard deviations, at most tokens.

    Special tokens and padding are never masked, so the real count lies below this Binomial's; the
    fixed size keeps the step's shapes static (no host sync, CUDA graphs). select_masked fails loudly
    on a batch above it rather than dropping tokens.
    """
    mean = tokens * probability
    spread = _CAPACITY_SDS * math.sqrt(tokens * probability * (1.0 - probability))
    return min(tokens, math.ceil(mean + spread))


def select_masked(labels: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """MLM labels (B, L) (-100 where not masked) -> (positions (K,) into the flattened (B*L), their
    labels (K,)), K = capacity: every masked position first, in order, then unmasked fill (label -100).

    Cross-entropy over the K selected rows with ignore_index=-100 equals the one over all B*L, as long
    as at most K tokens are masked; more raises (ValueError on the CPU, a device assert elsewhere).
    """
    flat = labels.flatten()
    masked = flat != -100
    assert_on_device(masked.sum() <= capacity,
                     f"select_masked: more masked tokens than the MLM capacity {capacity} "
                     "(set mlm_masked_only: false)")
    # A stable sort of 0 (masked) / 1 (not) puts the masked positions first, in order, at a fixed size.
    positions = torch.sort((~masked).to(torch.int32), stable=True).indices[:capacity]
    return positions, flat[positions]
