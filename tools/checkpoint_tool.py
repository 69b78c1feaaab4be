"""What the checkpoint tools (probe, uov, warmstart) share: their common flags, the pre-training model
loaded from a checkpoint, the JSON record they print and write, and their command line's one-line errors."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence

import torch

from models.loading import load_weights
from models.pretrain import ALBEF_Base
from models.tokenization import build_tokenizer
from torch_files import TRUST_FLAG, UntrustedCheckpointError

__all__ = ["checkpoint_parser", "load_pretrain_checkpoint", "resolve_device", "run_cli", "write_record"]


def checkpoint_parser(prog: str, description: str, config_help: str, checkpoint_help: str,
                      ) -> argparse.ArgumentParser:
    """A parser with the flags every checkpoint tool takes: --config, --checkpoint, --device, --set,
    --trust-checkpoint (the tool's main passes it to torch_files.set_trust_checkpoint)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", required=True, help=config_help)
    p.add_argument("--checkpoint", required=True, help=checkpoint_help)
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument(TRUST_FLAG, dest="trust_checkpoint", action="store_true",
                   help="also load weight files that a weights-only load refuses (they hold pickled "
                        "objects; unpickling can execute arbitrary code: trusted sources only)")
    p.add_argument("--set", dest="set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides, as in the training scripts (e.g. --set image_root=data/x)")
    return p


def resolve_device(name: str | None) -> torch.device:
    """--device, or cuda when available, else cpu."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def load_pretrain_checkpoint(config: Mapping, checkpoint: str, device: torch.device, seed: int | None = None,
                             log=None) -> tuple[ALBEF_Base, object]:
    """ALBEF_Base from the config with `checkpoint` loaded, on `device`, and its tokenizer.

    The seed (default: the config's) makes the weights the checkpoint lacks at least repeatable; the
    load summary goes to `log` (stdout by default).
    """
    tokenizer = build_tokenizer(config)
    torch.manual_seed(int(config.get("seed", 42)) if seed is None else seed)
    model = ALBEF_Base(dict(config), text_encoder=config.get("text_encoder"), tokenizer=tokenizer)
    print(f"loaded {checkpoint}: {load_weights(model, checkpoint).summary()}", file=log or sys.stdout,
          flush=True)
    return model.to(device), tokenizer


def write_record(record: Mapping, output: str | None) -> None:
    """Print the record as one JSON line and, with `output`, write it (indented) to that file too."""
    print(json.dumps(record), flush=True)
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")


def run_cli(main: Callable[[Sequence[str] | None], object], errors: tuple[type[BaseException], ...],
            argv: Sequence[str] | None = None) -> None:
    """main(argv); an exception of `errors` (bad input, missing file) or a refused untrusted checkpoint
    ends in 'error: ...', exit 2."""
    try:
        main(argv)
    except (*errors, UntrustedCheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
