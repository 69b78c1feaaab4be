"""In-batch false negatives (config key guard_false_negatives): keys that identify a caption, and the
mask of pairs that share the image or the caption (a `positive` for itc_loss and mine_negatives).

ALBEF's COCO/VG files list one image under several entries and web corpora repeat captions verbatim;
GRIT groups such pairs into one batch, where the hardest "negative" is then a true match.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["caption_keys", "false_negative_mask", "mined_false_negative_rate", "odd_constants",
           "same_group_share"]


# Run eagerly under torch.compile (one graph break) when a caller compiles caption_keys without a table:
# inductor folds `arange * constant` into a Triton index expression in int32 and fails on the 64-bit
# constant ("Scalar -7046029254386353131 is out of range for type int32", seen with torch 2.11 on an H200
# by `make gpu-check`). ALBEF_Base makes the table once, as a buffer, and passes it in.
@torch.compiler.disable
def odd_constants(length: int, device: torch.device | str | None = None) -> Tensor:
    """(length,) fixed pseudo-random odd int64 constants, one per token position (splitmix64 of it).

    Computed in integer arithmetic (wrapping int64 multiplies), so every rank and device gets the
    same table. `>>` is arithmetic on int64: masking makes it the logical shift of splitmix64.
    """
    x = torch.arange(1, length + 1, dtype=torch.int64, device=device)
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return x | 1


def caption_keys(input_ids: Tensor, constants: Tensor | None = None) -> Tensor:
    """Token ids (B, L), right-padded with id 0 -> int64 (B,) keys, equal for identical captions.

    key = sum_j ids[j] * c[j] (mod 2^64) with a fixed odd constant c[j] per position: trailing [PAD]
    (id 0 in BERT vocabularies) adds nothing, so the padded length does not matter; the position
    weights tell reorderings apart; and two rows that differ at a single position never collide
    (d * odd != 0 mod 2^64 for 0 < |d| < 2^63). Other collisions are ~2^-63 chance events.
    constants: odd_constants(n) for some n >= L, on input_ids' device (None: made here).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"caption_keys: input_ids must be (B, L), got {tuple(input_ids.shape)}")
    ids = input_ids.to(torch.int64)
    length = ids.shape[1]
    if constants is None:
        constants = odd_constants(length, ids.device)
    elif constants.shape[0] < length:
        raise ValueError(f"caption_keys: {constants.shape[0]} constants for captions of {length} tokens")
    return (ids * constants[:length]).sum(dim=1)


def false_negative_mask(
    image_keys: Tensor,
    caption_keys: Tensor,
    image_keys_all: Tensor | None = None,
    caption_keys_all: Tensor | None = None,
) -> Tensor:
    """Keys (B,) (and gathered keys (N,)) -> bool (B, N): pair i and column pair j share the image or caption.

    Both relations are symmetric, so image i matches text j and text i matches image j: the mask
    is a valid `positive` for itc_loss, mine_negatives and hardest_negative_similarity. Without the
    *_all keys N = B (the local batch); the diagonal is always True.
    """
    if (image_keys_all is None) != (caption_keys_all is None):
        raise ValueError("false_negative_mask: image_keys_all and caption_keys_all must be given together")
    if image_keys_all is None:
        image_keys_all, caption_keys_all = image_keys, caption_keys
    if image_keys.dim() != 1 or image_keys.shape != caption_keys.shape:
        raise ValueError(
            f"false_negative_mask: image_keys and caption_keys must both be (B,), got "
            f"{tuple(image_keys.shape)} and {tuple(caption_keys.shape)}"
        )
    if image_keys_all.dim() != 1 or image_keys_all.shape != caption_keys_all.shape:
        raise ValueError(
            f"false_negative_mask: image_keys_all and caption_keys_all must both be (N,), got "
            f"{tuple(image_keys_all.shape)} and {tuple(caption_keys_all.shape)}"
        )
    same_image = image_keys[:, None] == image_keys_all[None, :]
    same_caption = caption_keys[:, None] == caption_keys_all[None, :]
    return same_image | same_caption


def mined_false_negative_rate(group: Tensor, neg_text_idx: Tensor, neg_image_idx: Tensor,
                              valid: Tensor | None = None) -> Tensor:
    """How often a mined ITM negative is a false one: group (B,) int (e.g. the scene each pair shows;
    equal = the same content), the mined negatives' batch positions (B,) each -> 0-dim float, the share
    of anchors in both directions (image i with text neg_text_idx[i], text i with image neg_image_idx[i])
    whose negative has the anchor's group; invalid anchors (valid (B,) False) are left out. No host sync."""
    false = torch.cat([group[neg_text_idx] == group, group[neg_image_idx] == group]).float()
    if valid is None:
        return false.mean()
    weight = torch.cat([valid, valid]).float()
    return (false * weight).sum() / weight.sum().clamp(min=1)


def same_group_share(group: Tensor, valid: Tensor | None = None) -> Tensor:
    """How many examples share their batch with another of their group: group (..., B) int, a row per batch
    (e.g. the scene each pair shows) -> 0-dim float, the share of (valid (..., B)) examples whose batch holds
    another valid example of their group. These are the false negatives a batch contains, which the
    false-negative guard turns into ITC positives (an exact duplicate's) and the losses otherwise take as
    negatives: the upper bound of what a miner without the guard would pick. No host sync."""
    same = group.unsqueeze(-1) == group.unsqueeze(-2)  # (..., B, B)
    if valid is not None:
        same = same & valid.unsqueeze(-1) & valid.unsqueeze(-2)
    eye = torch.eye(group.shape[-1], dtype=torch.bool, device=group.device)
    shared = (same & ~eye).any(dim=-1).float()
    if valid is None:
        return shared.mean()
    weight = valid.float()
    return (shared * weight).sum() / weight.sum().clamp(min=1)
