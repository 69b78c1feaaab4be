"""GRIT inside open_clip: open_clip's own model, tokenizer, transforms and ClipLoss, trained with
grit.GritSampler as the DataLoader's sampler (docs/open-clip.md says how to put the sampler into
open_clip's own training script). Nothing of this repository but `grit` is used.

The model is a small config registered from examples/open_clip_tiny.json (open_clip's ViT and text
transformer at 32 px, no downloaded weights); the tokenizer is open_clip's byte-pair tokenizer for that
config. Per epoch it prints how hard its batches were against random batches of the same size, both
measured with the epoch's final weights (the mean similarity of every anchor's hardest in-batch negative,
both directions: examples/clip_grit.py's measure and line).

    pip install open_clip_torch        # besides grit (pip install . from this repository)
    python examples/open_clip_grit.py --data data/synthetic [--epochs 8] [--batch_size 8] [--lr 1e-3]

GRIT only pays once the features carry information: at a learning rate where the loss stays near
log(batch size) (here --batch_size 16 --lr 3e-3), its groups are no harder than random batches.
"""

from __future__ import annotations

import argparse
import json
import os

import open_clip
import torch
from clip_grit import epoch_row  # examples/ is on sys.path when this file runs
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from grit import GritSampler

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "open_clip_tiny"  # examples/open_clip_tiny.json


class OpenClipPairs(Dataset):
    """ALBEF-format pairs through open_clip's transform and tokenizer -> (image, token ids, index)."""

    def __init__(self, root: str, transform, tokenizer, limit: int | None = None) -> None:
        with open(os.path.join(root, "pretrain.json")) as f:
            self.entries = json.load(f)[:limit]
        self.root, self.transform, self.tokenizer = root, transform, tokenizer

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int):
        entry = self.entries[i]
        caption = entry["caption"] if isinstance(entry["caption"], str) else entry["caption"][0]
        with Image.open(os.path.join(self.root, entry["image"])) as im:
            image = self.transform(im.convert("RGB"))
        return image, self.tokenizer([caption])[0], i


@torch.no_grad()
def embed(model, data: OpenClipPairs) -> tuple[torch.Tensor, torch.Tensor]:
    """open_clip's L2-normalised image and text features (D, d) of every pair with the current weights."""
    model.eval()
    feats = [(model.encode_image(image, normalize=True), model.encode_text(ids, normalize=True))
             for image, ids, _ in DataLoader(data, batch_size=256)]
    model.train()
    return torch.cat([f[0] for f in feats]), torch.cat([f[1] for f in feats])


def train(args) -> list[dict]:
    """Train open_clip's model on GRIT batches; per epoch the loss, the indices each step saw, and the
    hardness of those batches and of random ones under the epoch's final weights."""
    open_clip.add_model_config(os.path.join(HERE, f"{MODEL}.json"))
    torch.manual_seed(args.seed)
    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(MODEL, pretrained=None)
    tokenizer = open_clip.get_tokenizer(MODEL)
    data = OpenClipPairs(args.data, preprocess_train, tokenizer, args.limit)
    measured = OpenClipPairs(args.data, preprocess_val, tokenizer, args.limit)
    loss_fn = open_clip.ClipLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    # The sampler replaces open_clip's DistributedSampler (its csv data path); with torch.distributed it
    # takes its ranks from the group. dim: the model's embed_dim.
    sampler = GritSampler(data, batch_size=args.batch_size, queue_size=args.queue_size,
                          search_space=args.search_space, seed=args.seed, dim=model.text_projection.shape[1])
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    rows = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # this epoch's batches: the groups formed in the last one
        used, losses = [], []
        for image, ids, index in loader:
            image_features, text_features, logit_scale = model(image, ids)  # normalised, as ClipLoss wants
            loss = loss_fn(image_features, text_features, logit_scale)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, 4.6052)  # open_clip's main loop clamps it to ln(100)
            sampler.collect(image_features.detach(), text_features.detach(), index)  # every step, every rank
            used.append(index)
            losses.append(loss.item())
        sampler.end_epoch()  # group what is left, compose the next epoch
        img, txt = embed(model, measured)
        batches = torch.stack(used)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        row = epoch_row(epoch, sum(losses) / len(losses), img, txt, batches, order)
        rows.append({**row, "indices": batches.tolist()})
    return rows


def main(argv=None) -> dict:
    """Train and print per epoch (and as one JSON line at the end) the loss and the batch hardness."""
    p = argparse.ArgumentParser(prog="python examples/open_clip_grit.py", description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/synthetic", help="folder with pretrain.json and its images")
    p.add_argument("--limit", type=int, default=None, help="use the first LIMIT pairs")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=8, help="N")
    p.add_argument("--search_space", type=int, default=128, help="M")
    p.add_argument("--queue_size", type=int, default=512, help="L")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.data, "pretrain.json")):
        p.error(f"{args.data}/pretrain.json not found (make the synthetic world: python -m "
                "tools.make_synthetic --output_dir DIR)")
    torch.set_num_threads(1)
    rows = train(args)
    print(json.dumps({"epochs": rows}))
    return {"epochs": rows}


if __name__ == "__main__":
    main()
