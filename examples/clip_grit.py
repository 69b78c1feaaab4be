"""GRIT in a plain CLIP loop: a dual encoder with its own small towers, trained with ITC alone (the paper's
Table 5 setting), with grit.GritSampler as the DataLoader's sampler. Nothing else of this repository is
used. Per epoch it prints how hard its batches were, against random batches of the same size, both
measured with the epoch's final weights: the mean ITC similarity of every anchor's hardest in-batch
negative, both directions (the harder, the more ITC learns from a batch: paper Sec. 3.1).

    python examples/clip_grit.py --data data/synthetic [--epochs 8] [--batch_size 8]
    python examples/clip_grit.py --data data/synthetic --strategy b3    # B3's communities instead

--strategy picks how the sampler forms the next epoch's batches (grit.strategies: grit, the paper's;
random; b3; gcbs; rwr), each with its defaults; the loop is the same for all of them.

--data is a folder with pretrain.json ([{"image", "caption": str | [str, ...]}], ALBEF's format), the
images it names and a vocab.txt: the synthetic world (`python -m tools.make_synthetic`) is one.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from grit import GritSampler
from grit.strategies import NAMES


class Pairs(Dataset):
    """Image-caption pairs -> (image (3,32,32) float, caption token ids (16,), dataset index)."""

    def __init__(self, root: str, words: int = 16) -> None:
        with open(os.path.join(root, "pretrain.json")) as f:
            self.entries = json.load(f)
        with open(os.path.join(root, "vocab.txt")) as f:
            self.vocab = {w.strip(): i for i, w in enumerate(f)}
        self.root, self.words = root, words

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int):
        entry = self.entries[i]
        caption = entry["caption"] if isinstance(entry["caption"], str) else entry["caption"][0]
        with Image.open(os.path.join(self.root, entry["image"])) as im:
            image = torch.from_numpy(np.array(im.convert("RGB").resize((32, 32)))).permute(2, 0, 1) / 255
        ids = [self.vocab.get(w, 1) for w in caption.lower().split()][: self.words]
        return image, torch.tensor(ids + [0] * (self.words - len(ids))), i


class DualEncoder(nn.Module):
    """CLIP in miniature: a conv image tower and a bag-of-words text tower into one d-dim space."""

    def __init__(self, vocab: int, dim: int = 64) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1),
                                   nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(256, dim))
        self.words = nn.EmbeddingBag(vocab, 64, mode="mean", padding_idx=0)
        self.text = nn.Sequential(nn.ReLU(), nn.Linear(64, dim))
        self.log_scale = nn.Parameter(torch.tensor(2.66))  # CLIP's 1/0.07

    def forward(self, image, ids):
        """-> L2-normalised image and text features (B, dim)."""
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(self.words(ids)), dim=-1)


def hardness(img: torch.Tensor, txt: torch.Tensor, batches: torch.Tensor) -> float:
    """Mean ITC similarity of each anchor's hardest in-batch negative, image->text and text->image, over
    batches (K, N) of dataset indices; img, txt (D, d) features."""
    sim = img[batches] @ txt[batches].transpose(1, 2)  # (K, N, N)
    sim = sim.masked_fill(torch.eye(batches.shape[1], dtype=torch.bool), -2.0)
    return 0.5 * (sim.amax(2).mean() + sim.amax(1).mean()).item()


def epoch_row(epoch: int, loss: float, img: torch.Tensor, txt: torch.Tensor, batches: torch.Tensor,
              order: torch.Tensor) -> dict:
    """The epoch's line, printed and returned: its loss, and the hardness of the batches (K, N) it trained
    on and of random batches of the same size cut from `order` (a permutation of the dataset), both under
    the features img, txt (D, d) of the epoch's final weights."""
    random_batches = order[: batches.numel()].view_as(batches)
    row = {"epoch": epoch, "loss": round(loss, 4), "grit_batches": round(hardness(img, txt, batches), 4),
           "random_batches": round(hardness(img, txt, random_batches), 4)}
    print(f"epoch {epoch}: loss {row['loss']:.3f}  hardness of its batches {row['grit_batches']:.3f}, of "
          f"random batches {row['random_batches']:.3f}"
          + ("  (epoch 0 is random: GRIT groups from the epoch before)" if epoch == 0 else ""), flush=True)
    return row


@torch.no_grad()
def embed(model: DualEncoder, data: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (D, d) of every pair with the current weights."""
    pairs = [model(image, ids) for image, ids, _ in DataLoader(data, batch_size=256)]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def train(data: Pairs, args) -> list[dict]:
    """Train the dual encoder on GRIT batches; per epoch, the hardness of the batches it trained on and of
    random batches of the same size, both measured with the epoch's final weights."""
    torch.manual_seed(args.seed)
    model = DualEncoder(len(data.vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The sampler replaces DistributedSampler; with torch.distributed it takes its ranks from the group.
    # strategy: which examples share a batch (grit.strategies); everything else is the same for all.
    sampler = GritSampler(data, batch_size=args.batch_size, queue_size=args.queue_size,
                          search_space=args.search_space, seed=args.seed, dim=64, strategy=args.strategy)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    rows = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # this epoch's batches: the groups formed in the last one
        used = []
        for image, ids, index in loader:
            img, txt = model(image, ids)
            logits = img @ txt.T * model.log_scale.exp().clamp(max=100)
            target = torch.arange(len(logits))
            loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            sampler.collect(img.detach(), txt.detach(), index)  # after every step, on every rank
            used.append(index)
        sampler.end_epoch()  # group what is left, compose the next epoch
        img, txt = embed(model, data)
        rows.append(epoch_row(epoch, loss.item(), img, txt, torch.stack(used), torch.randperm(len(data))))
    return rows


def main(argv=None) -> dict:
    """Train and print per epoch (and as one JSON line at the end) the batch hardness."""
    p = argparse.ArgumentParser(prog="python examples/clip_grit.py", description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/synthetic", help="folder with pretrain.json, images, vocab.txt")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=8, help="N")
    p.add_argument("--search_space", type=int, default=128, help="M")
    p.add_argument("--queue_size", type=int, default=512, help="L")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="grit", choices=NAMES,
                   help="how batches are formed (grit.strategies; default: grit, the paper's)")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.data, "pretrain.json")):
        p.error(f"{args.data}/pretrain.json not found (make the synthetic world: python -m "
                "tools.make_synthetic --output_dir DIR)")
    torch.set_num_threads(1)
    data = Pairs(args.data)
    rows = train(data, args)
    print(json.dumps({"strategy": args.strategy, "batch_hardness": rows}))
    return {"strategy": args.strategy, "batch_hardness": rows}


if __name__ == "__main__":
    main()
