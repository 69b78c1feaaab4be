"""Reading the files a run is handed: the repository's one torch.load (weights-only unless the run trusts
its files) and its one JSON reader, each error naming the file (InputFileError).

A .pth/.pt/.bin file is a pickle, and unpickling can execute arbitrary code. torch.load(weights_only=True)
only rebuilds tensors and plain containers; a file that needs more (an argparse.Namespace or a custom
class, as some released checkpoints hold) is refused with UntrustedCheckpointError, unless
the run passed --trust_checkpoint. This module sits at the top level, importing nothing of the
repository, so that grit/, models/, dataset/, training/ and tools/ can all use it without an import cycle
or an arrow between those packages. `pip install` ships it beside grit (which reads its index-array files
with it): the wheel's two top-level names are the project's own, grit and grit_io.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["TRUST_FLAG", "InputFileError", "UntrustedCheckpointError", "load_torch_file", "read_json",
           "set_trust_checkpoint", "trust_checkpoint_enabled"]

TRUST_FLAG = "--trust_checkpoint"

# Process-wide on purpose: the loads happen deep inside model constructors (vision_init, text_encoder
# weights) and samplers (grit.warmstart_indices) built from the config, so threading a flag through
# every constructor would touch every script and model. The scripts (training.cli.start) and the
# checkpoint tools set it once from the parsed arguments; tests reset it with set_trust_checkpoint.
_trusted = False


class InputFileError(ValueError):
    """A file the user handed the run (data list, weights, checkpoint, index array) is missing, unreadable
    or malformed; the message names the file (and the entry or key)."""


class UntrustedCheckpointError(InputFileError):
    """A file that a weights-only load refuses: loading it needs arbitrary unpickling."""


def read_json(path: str | os.PathLike, what: str = "json file") -> Any:
    """The parsed JSON of `path`; InputFileError (naming `what`, the file, and line and column of a syntax
    error) when it is missing or not UTF-8 JSON."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputFileError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise InputFileError(f"{what} {path}: invalid JSON at line {e.lineno}, column {e.colno}: "
                             f"{e.msg}") from None
    except UnicodeDecodeError as e:
        raise InputFileError(f"{what} {path}: not UTF-8 text ({e.reason})") from None


def set_trust_checkpoint(enabled: bool) -> bool:
    """Allow (True) or refuse (False) files that need arbitrary unpickling; returns the previous setting."""
    global _trusted
    previous, _trusted = _trusted, bool(enabled)
    return previous


def trust_checkpoint_enabled() -> bool:
    """Whether this process loads files that need arbitrary unpickling (--trust_checkpoint)."""
    return _trusted


def _first_line(err: BaseException) -> str:
    text = str(err).strip()  # torch's messages run to paragraphs; the first line says what broke
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def load_torch_file(path: str | os.PathLike, what: str = "checkpoint") -> Any:
    """torch.load(path, map_location='cpu', weights_only=True); `what` names the file's role in errors.

    Raises UntrustedCheckpointError for a file that needs arbitrary unpickling (loaded, with a warning,
    when --trust_checkpoint is set) and InputFileError for a missing, truncated or corrupt one.
    """
    import torch  # here, not at the top: the json reader serves torch-free callers (the data generator)

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputFileError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many exception types for bad files
        refused = err
    # Only now, on failure, tell the two cases apart: the zip's pickle names the globals it needs.
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as err:  # not a readable torch.save zip at all
        raise InputFileError(f"{what} {path!r} could not be read (truncated, corrupt, or not a torch.save "
                         f"file of torch >= 1.6): {_first_line(err)}") from refused
    if not unsafe:  # the pickle is fine, the failure lies elsewhere (e.g. a damaged tensor record)
        raise InputFileError(f"{what} {path!r} could not be read (truncated or corrupt?): "
                         f"{_first_line(refused)}") from refused
    needs = ", ".join(unsafe)
    if not _trusted:
        raise UntrustedCheckpointError(
            f"{what} {path!r} holds pickled Python objects ({needs}) that a weights-only load refuses: "
            f"unpickling can execute arbitrary code, so only load files from sources you trust. "
            f"If you trust this file, pass {TRUST_FLAG} to allow it for this run."
        ) from None
    print(f"warning: {TRUST_FLAG}: fully unpickling {what} {path!r} (it holds {needs}); this can "
          f"execute arbitrary code", file=sys.stderr, flush=True)
    return torch.load(path, map_location="cpu", weights_only=False)
