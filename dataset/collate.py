"""Batching with tokenization inside the loader's workers, shared by the task scripts."""

from __future__ import annotations

import torch


class ImageTextCollate:
    """Batch (image, caption, integer) items: images stacked, captions tokenized, integers as a LongTensor.

    The integer is the dataset index (pre-training, for GRIT) or the image id (retrieval). Tokenizing
    here runs in the DataLoader workers, off the training loop's critical path.
    """

    def __init__(self, tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)

    def __call__(self, items: list[tuple]) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """items -> images (B,3,H,W), tokenized captions (B,L) padded to the longest, integers (B,)."""
        images, captions, ids = zip(*items)
        text = self.tokenizer(list(captions), padding='longest', truncation=True, max_length=self.max_tokens,
                              return_tensors='pt')
        return torch.stack(images), text, torch.as_tensor(ids, dtype=torch.long)
