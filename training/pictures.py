"""A picture of one training batch: its images with their captions, each anchor's hardest in-batch negative
marked. What GRIT puts together in a batch is the first thing anyone wants to see of the method; the
same picture of a random batch (epoch 0, or GRIT off) is its counterpart (Pretrain.py writes both).
"""

from __future__ import annotations

import os
import textwrap

import torch
from torch import Tensor

from dataset.transforms import ALBEF_MEAN, ALBEF_STD

__all__ = ["batch_grid", "denormalize"]

def denormalize(images: Tensor) -> Tensor:
    """Normalised images (B,3,H,W) -> displayable (B,H,W,3) in [0, 1] (the training transform's
    normalisation undone)."""
    mean = torch.tensor(ALBEF_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(ALBEF_STD).view(1, 3, 1, 1)
    return (images.float().cpu() * std + mean).clamp(0, 1).permute(0, 2, 3, 1)


def batch_grid(images: Tensor, captions: list[str], similarity: Tensor, path: str, title: str,
               columns: int = 4) -> str | None:
    """Draw a batch: images (B,H,W,3) in [0,1], captions [B], similarity (B,B) image->text ITC
    similarities; under each image #i its caption and, in red, its hardest negative: the caption j != i
    it is most similar to (what ITM_hard mines). Writes the PNG to `path` and returns it; None when
    matplotlib (an optional dependency) is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    B = len(captions)
    sim = similarity.float().cpu().clone()
    sim.fill_diagonal_(-float("inf"))
    hardest = sim.argmax(dim=1).tolist()
    rows = -(-B // columns)
    # Each sample: its image above, a text panel below (its caption; in red, its hardest negative).
    fig, axes = plt.subplots(2 * rows, columns, figsize=(3.0 * columns, 4.6 * rows), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.6] * rows})
    for ax in axes.flat:
        ax.axis("off")
    for i in range(B):
        image_ax, text_ax = axes[2 * (i // columns), i % columns], axes[2 * (i // columns) + 1, i % columns]
        image_ax.imshow(images[i].numpy())
        image_ax.set_title(f"#{i}", fontsize=9, loc="left")
        j = hardest[i]
        text_ax.text(0, 1, textwrap.fill(captions[i], 36), va="top", fontsize=7.5)
        text_ax.text(0, 0.45, textwrap.fill(f"hardest negative: #{j} ({sim[i, j]:.2f}) {captions[j]}", 36),
                     va="top", fontsize=7.5, color="firebrick")
    fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.93, bottom=0.02, hspace=0.08, wspace=0.08)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
