"""Convert ALBEF json lists of image files into webdataset tar shards in img2dataset's layout, with the
wids shard index that config key train_shards reads; or write the index of shards that exist already.

    python -m tools.make_shards --config configs/tiny/Pretrain.yaml --output_dir data/synthetic/shards
    python -m tools.make_shards --train_file cc3m.json sbu.json --image_root /data/images \
        --output_dir /data/shards/cc3m_sbu [--shard_size 10000] [--name cc3m_sbu]
    python -m tools.make_shards --index_only '/data/laion/{00000..41407}.tar' --output_dir /data/laion

Entry i of the concatenated json lists becomes sample i, with key `{i:09d}`, in shard i // shard_size
(`{name}-{k:06d}.tar`): its image file's bytes unchanged as `.jpg`/`.jpeg`/`.png`/`.webp` (any other
format is stored losslessly as `.png`, so every image decodes to the same pixels as from the file), its
caption as `.txt` (the first one of a list) and as `.json` {"caption": the caption or list as in the json,
"image": the json path, "source": the json file, "entry": i}. Entries that name one image file share an
image key in `{name}-image_keys.npy`, which the index names (the false-negative guard reads it). Training
from `{output_dir}/{name}.json` therefore reads the same examples under the same indices as from the json
lists. An image file that is missing is written as a sample without an image member (training counts it
as a bad sample, as it would the missing file) and reported.

Each shard is written under a temporary name and renamed when complete, so an interrupted conversion
resumes where it stopped when run again with the same arguments (complete shards are kept; the inputs
are checked to be the same). The index (relative urls, each shard's nsamples and filesize) is written
last. --index_only counts the samples of existing .tar shards (a brace pattern, e.g. img2dataset's
output) and writes their index, with urls relative to --output_dir.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence

import numpy as np
from PIL import Image
from tqdm import tqdm

from dataset.pretrain import first_seen_keys, image_file
from dataset.shards import IMAGE_MEMBERS, read_shard_list
from dataset.utils import load_json_list, resolve_image
from grit_io import InputFileError, read_json
from tools.cli import add_config_args, emit_record, tool_config, tool_parser
from training.cli import Parser, run_main
from training.config_files import ConfigError

STATE = ".make_shards.json"  # the conversion's inputs, to check that a resumed run converts the same


def build_parser() -> Parser:
    """The tool's command line."""
    p = tool_parser("tools.make_shards", __doc__.splitlines()[0])
    add_config_args(p, "a pre-training YAML config: convert its train_file with its image_root (the "
                       "synthetic world is generated first when the config names it)", required=False)
    p.add_argument("--train_file", nargs="+", default=None, help="json list(s) to convert (instead of "
                                                                 "--config)")
    p.add_argument("--image_root", default="", help="folder the json image paths are relative to (with "
                                                    "--train_file)")
    p.add_argument("--output_dir", required=True, help="folder of the shards and their index (created "
                                                       "when missing)")
    p.add_argument("--shard_size", type=int, default=1000, help="samples per shard (default: 1000; "
                                                                "img2dataset's default is 10000)")
    p.add_argument("--name", default=None, help="shard and index file name stem (default: the first json "
                                                "file's stem, or 'shards' with --index_only)")
    p.add_argument("--index_only", default=None, metavar="PATTERN",
                   help="write only the index of existing .tar shards (brace pattern); converts nothing")
    return p


def _image_member(path: str) -> tuple[str, bytes] | None:
    """The image file as (member extension, bytes): its own bytes when it is a format img2dataset writes,
    else a lossless PNG of it; None when the file is missing or not an image."""
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext in IMAGE_MEMBERS:
            with open(path, "rb") as f:
                return ext, f.read()
        with Image.open(path) as im:
            buf = io.BytesIO()
            im.convert("RGB").save(buf, format="PNG")
            return ".png", buf.getvalue()
    except OSError:
        return None


def _inputs(files: Sequence[str], image_root: str, shard_size: int) -> dict:
    """What identifies a conversion: the json files (absolute path, size, mtime), image root, shard size."""
    listed = [{"path": os.path.abspath(f), "bytes": os.path.getsize(f), "mtime": os.path.getmtime(f)}
              for f in files]
    return {"train_file": listed, "image_root": os.path.abspath(image_root) if image_root else "",
            "shard_size": shard_size}


def _shard_name(name: str, k: int) -> str:
    return f"{name}-{k:06d}.tar"


def write_index(output_dir: str, name: str, shards: list[dict], image_keys: str | None = None) -> str:
    """Write the wids shard index {output_dir}/{name}.json (urls relative to it; image_keys: the name of
    the .npy file of image keys beside it) atomically; its path."""
    path = os.path.join(output_dir, f"{name}.json")
    index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": name,
             "shardlist": [{**s, "url": os.path.relpath(s["url"], output_dir)} for s in shards]}
    if image_keys:
        index["image_keys"] = image_keys
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def convert(files: Sequence[str], image_root: str, output_dir: str, shard_size: int,
            name: str | None = None, replace: bool = False) -> dict:
    """Convert the json lists `files` into shards of `shard_size` in output_dir (resuming a conversion
    that stopped) and write the index; returns a record of what was done. replace: shards `name` of
    another conversion in output_dir are deleted and made anew (else refused)."""
    from webdataset import TarWriter

    if shard_size < 1:
        raise ConfigError(f"--shard_size must be >= 1, got {shard_size}")
    lists = [load_json_list(f, required=("image", "caption")) for f in files]
    entries = [entry for entries in lists for entry in entries]
    source = [f for f, entries in zip(files, lists) for _ in entries]  # the json file of each entry
    name = name or os.path.splitext(os.path.basename(files[0]))[0]
    os.makedirs(output_dir, exist_ok=True)
    inputs = _inputs(files, image_root, shard_size)
    state_path = os.path.join(output_dir, f"{name}{STATE}")
    if os.path.exists(state_path) and replace and read_json(state_path, "conversion state") != inputs:
        for stale in os.listdir(output_dir):  # that conversion's shards, index, keys and state
            if stale.startswith(f"{name}-") or stale in (f"{name}.json", f"{name}{STATE}"):
                os.remove(os.path.join(output_dir, stale))
    if os.path.exists(state_path):
        if read_json(state_path, "conversion state") != inputs:
            raise InputFileError(f"{output_dir} holds shards '{name}' of another conversion ({state_path}: "
                                 "other json files, image root or shard size); convert into a new folder or "
                                 "delete those shards")
    else:
        with open(state_path, "w", encoding="utf-8") as f:
            json.dump(inputs, f, indent=1)
    n_shards = -(-len(entries) // shard_size)
    missing_images, resumed = [], 0
    with tqdm(total=len(entries), desc=f"shards {name}", unit="sample", dynamic_ncols=True) as bar:
        for k in range(n_shards):
            final = os.path.join(output_dir, _shard_name(name, k))
            lo, hi = k * shard_size, min((k + 1) * shard_size, len(entries))
            if os.path.isfile(final):  # complete (renamed only once written): kept from an earlier run
                resumed += 1
                bar.update(hi - lo)
                continue
            partial = final + ".partial"
            with TarWriter(partial, encoder=False, mtime=0) as sink:  # mtime fixed: the same bytes every run
                for i in range(lo, hi):
                    entry = entries[i]
                    caption = entry["caption"]
                    sample = {"__key__": f"{i:09d}",
                              "txt": (caption if isinstance(caption, str) else caption[0]).encode("utf-8"),
                              "json": json.dumps({"caption": caption, "image": entry["image"],
                                                  "source": source[i], "entry": i}).encode("utf-8")}
                    image = _image_member(resolve_image(image_root, entry["image"]))
                    if image is None:
                        missing_images.append(f"entry {i}: {entry['image']}")
                    else:
                        sample[image[0][1:]] = image[1]
                    sink.write(sample)
                    bar.update(1)
            os.replace(partial, final)
    shards = [{"url": os.path.join(output_dir, _shard_name(name, k)),
               "nsamples": min((k + 1) * shard_size, len(entries)) - k * shard_size,
               "filesize": os.path.getsize(os.path.join(output_dir, _shard_name(name, k)))}
              for k in range(n_shards)]
    # Entries that name one image file share a key (as dataset.pretrain.PretrainDataset.image_keys): the
    # false-negative guard reads them.
    keys = np.array(first_seen_keys(image_file(image_root, e) for e in entries), dtype=np.int64)
    keys_name = f"{name}-image_keys.npy"
    np.save(os.path.join(output_dir, keys_name), keys)
    index = write_index(output_dir, name, shards, keys_name)
    for line in missing_images[:5]:
        print(f"no readable image file (written without an image: a bad sample in training): {line}")
    return {"index": index, "samples": len(entries), "shards": n_shards, "shards_resumed": resumed,
            "missing_images": len(missing_images),
            "train_shards": f"--set train_file=null train_shards={index}"}


def index_only(pattern: str, output_dir: str, name: str | None = None) -> dict:
    """Count the samples of the existing shards of `pattern` and write their index into output_dir."""
    shards, _ = read_shard_list(pattern)  # refuses missing and unreadable shards, naming them
    os.makedirs(output_dir, exist_ok=True)
    index = write_index(output_dir, name or "shards", shards)
    return {"index": index, "samples": sum(s["nsamples"] for s in shards), "shards": len(shards)}


def main(argv: Sequence[str] | None = None) -> dict:
    """Convert (or index) from the command line; prints the record as one JSON line."""
    args = build_parser().parse_args(argv)
    if args.index_only:
        if args.config or args.train_file:
            raise ConfigError("--index_only indexes existing shards: leave out --config and --train_file")
        return emit_record(index_only(args.index_only, args.output_dir, args.name), None, "make_shards")
    if bool(args.config) == bool(args.train_file):
        raise ConfigError("give either --config (a pre-training config) or --train_file, not both nor none")
    if args.config:
        config = tool_config("pretrain", args)
        from dataset import prepare_data

        prepare_data(config)  # the synthetic world, when the config names it and it is not there yet
        if not config.train_files:
            raise ConfigError(f"{args.config} has no train_file to convert")
        files, root = config.train_files, config.image_root or ""
    else:
        files, root = args.train_file, args.image_root
    record = convert(files, root, args.output_dir, args.shard_size, args.name)
    return emit_record(record, None, "make_shards")


if __name__ == "__main__":
    run_main(main)
