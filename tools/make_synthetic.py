"""Generate the built-in synthetic image-text dataset (dataset.synthetic) into a folder.

    python -m tools.make_synthetic --output_dir data/synthetic [--n 600] [--seed 0] [--image_size 48]

The folder gets the images, the json lists of every task, vocab.txt and synthetic.json (what each file
holds: dataset/synthetic.py); configs name it as image_root. An earlier synthetic dataset there is
replaced; any other non-empty folder is refused. Prints one JSON line: the folder, the seconds taken,
the split sizes and the pre-training corpus statistics. The task scripts generate the same dataset on
first use where a config names it as synthetic_root; this command makes one of another size or seed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dataset.synthetic import generate
from tools.cli import emit_record, tool_parser
from training.cli import Parser, run_main

__all__ = ["build_parser", "main"]


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser("tools.make_synthetic", __doc__.splitlines()[0])
    p.add_argument("--output_dir", required=True,
                   help="folder to write the dataset into (use it as image_root in configs)")
    p.add_argument("--n", type=int, default=600, help="number of pre-training images (default: 600)")
    p.add_argument("--seed", type=int, default=0, help="the same (n, seed) gives byte-identical files "
                                                       "(default: 0)")
    p.add_argument("--image_size", type=int, default=48, help="image side in pixels (default: 48)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Generate the dataset from the command line; returns the record it prints."""
    parser = build_parser()
    args = parser.parse_args(argv)
    start = time.time()
    try:
        meta = generate(args.output_dir, args.n, args.seed, args.image_size)
    except (ValueError, OSError) as e:  # a bad size, or a folder that is not a synthetic dataset
        parser.error(str(e))
    record = {"output_dir": args.output_dir, "seconds": round(time.time() - start, 2), **meta["sizes"],
              "pretrain_statistics": meta["pretrain_statistics"]}
    # The dataset's own synthetic.json holds this record's numbers: nothing more is written.
    return emit_record(record, None, "make_synthetic")


if __name__ == "__main__":
    run_main(main)
