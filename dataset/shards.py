"""Pre-training data from webdataset tar shards in img2dataset's layout, read by global index with wids.

GRIT deals a permutation of the whole dataset every epoch, so it needs random access by index, which a
streaming reader cannot give. webdataset's indexed reader, wids (`ShardListDataset`), maps a global index
to (shard, sample) through a shard list with each shard's sample count, and reads the sample from the
memory-mapped tar. A sample is the members that share a key: `{key}.jpg` (or .jpeg/.png/.webp),
`{key}.txt` and `{key}.json` (img2dataset writes all three; the json's `caption` may be a list, as in
ALBEF's json lists: a random one per visit). Shards on local disk are opened where they are (wids' cache
only holds a link to them and its lock files); remote ones (http, s3, gs, `pipe:`) are downloaded into
the cache by wids on first use.

A shard source is a wids shard-index json (`{"wids_version": 1, "shardlist": [{"url", "nsamples",
"filesize"?}, ...]}`, relative urls relative to the index's folder; tools.make_shards writes one), or local
.tar files as a folder (img2dataset's output folder: every `*.tar` in it, sorted), a glob
(`/data/cc3m/*.tar`) or a brace pattern (`shards/{00000..00099}.tar`), whose samples are counted at
start-up. A shard of zero samples (img2dataset writes one when all of a shard's urls failed) is kept out of
the index space and named in the start-up summary. An index may
name an `image_keys` .npy file (one integer per sample, equal for samples of one image file: ALBEF's COCO
and VG lists hold one entry per caption), read by the false-negative guard only. At start-up
a local shard that is missing, or whose size differs from the index's `filesize`, is refused with its
name (grit_io.InputFileError). A sample that cannot be read in training is a bad sample
(dataset.bad_samples): a truncated or non-image image member, no image member, an empty or missing
caption, a shard that holds fewer samples than its index says or cannot be opened; each names the shard
and the key.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import random
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlparse

import torch
from torch import Tensor
from torch.utils.data import Dataset

from grit_io import InputFileError, read_json

from .bad_samples import blank_image
from .pretrain import PLACEHOLDER_CAPTION
from .utils import (
    EmptyTextError,
    ImageReadError,
    MissingTextError,
    ShardReadError,
    decode_image,
    pre_caption,
)

__all__ = ["IMAGE_MEMBERS", "ShardDataset", "default_cache_dir", "expand_shards", "is_local",
           "read_shard_list"]

# The image members a sample may have, in the order they are looked for (img2dataset's output formats).
IMAGE_MEMBERS = (".jpg", ".jpeg", ".png", ".webp")


def default_cache_dir() -> str:
    """wids' own default cache folder: $WIDS_CACHE, else /tmp/_wids_cache."""
    return os.environ.get("WIDS_CACHE", "/tmp/_wids_cache")


def is_local(url: str) -> bool:
    """True for a path or file:// url (opened in place), False for what wids downloads (http, s3, pipe:)."""
    return not url.startswith("pipe:") and urlparse(url).scheme in ("", "file")


def _local_path(url: str) -> str:
    return os.path.abspath(urlparse(url).path)


class _CacheName:
    """wids' `localname`: where a shard is opened from. A local shard gets a symbolic link in the cache
    folder (wids then finds it 'downloaded' and opens it in place: nothing is copied, and its lock file is
    written to the cache, not beside a shard on a read-only filesystem); a remote one the file wids
    downloads it to, named as wids' DefaultLocalname names it."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir

    def __call__(self, url: str) -> str:
        os.makedirs(self.cache_dir, exist_ok=True)
        if not is_local(url):
            return os.path.join(self.cache_dir, quote(url, safe="+-"))
        path = _local_path(url)
        digest = hashlib.sha256(os.path.dirname(path).encode()).hexdigest()[:16]
        link = os.path.join(self.cache_dir, f"local__{digest}__{os.path.basename(path)}")
        if not os.path.islink(link):
            with contextlib.suppress(FileExistsError):  # another worker made it first
                os.symlink(path, link)
        return link


def _from_index(path: str) -> tuple[list[dict], dict]:
    """The shard list of a wids shard-index json, urls resolved against the index's folder, and the index."""
    from wids.wids_specs import resolve_dsdesc, urldir

    desc = read_json(path, "shard index")
    if not isinstance(desc, dict) or desc.get("wids_version") != 1:
        raise InputFileError(f"shard index {path}: not a wids shard index (a json object with "
                             "\"wids_version\": 1 and a \"shardlist\" of {\"url\", \"nsamples\"}); write one "
                             "with `python -m tools.make_shards`")
    try:
        shards = resolve_dsdesc(desc, base=urldir(os.path.abspath(path)))["shardlist"]
    except (AssertionError, KeyError, TypeError) as e:  # wids checks its format with asserts
        raise InputFileError(f"shard index {path}: malformed shard list ({type(e).__name__}: {e}); each "
                             "shard needs \"url\" and \"nsamples\"") from None
    for i, shard in enumerate(shards):
        n = shard.get("nsamples")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InputFileError(f"shard index {path}: shard {i} ({shard.get('url')}) has nsamples {n!r}, "
                                 "expected an integer >= 0")
    return shards, desc


def _count_samples(url: str) -> int:
    """Samples in a local tar shard, as wids groups its members (read once, at start-up)."""
    from wids.wids import compute_num_samples

    try:
        return compute_num_samples(_local_path(url))
    except Exception as e:  # noqa: BLE001 - wids raises struct.error, ValueError, ... for a broken tar
        raise InputFileError(f"tar shard {url}: cannot be indexed ({type(e).__name__}: {e}); it is "
                             "truncated or not a tar file") from None


def expand_shards(spec: str) -> list[str]:
    """The .tar files of a train_shards entry that is not an index: its brace pattern expanded, then each
    part a folder (every `*.tar` in it, sorted: img2dataset's output folder, whose `.parquet` and
    `_stats.json` side files are left alone), a glob (sorted matches) or a file. InputFileError names a
    folder without tars or a glob without matches."""
    from braceexpand import braceexpand

    urls: list[str] = []
    for part in braceexpand(spec):
        path = _local_path(part) if is_local(part) else None
        if path is not None and os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(glob.escape(path), "*.tar")))
            if not found:
                raise InputFileError(f"train_shards {spec}: the folder {path} holds no .tar shards")
            urls += found
        elif path is not None and glob.has_magic(part):
            found = sorted(p for p in glob.glob(path) if p.endswith(".tar") and os.path.isfile(p))
            if not found:
                raise InputFileError(f"train_shards {spec}: no .tar file matches {part}")
            urls += found
        else:
            urls.append(part)
    return urls


def _from_pattern(pattern: str) -> list[dict]:
    """The shard list of a folder, glob or brace pattern of local .tar files, each shard's samples counted."""
    urls = expand_shards(pattern)
    missing = [u for u in urls if is_local(u) and not os.path.isfile(_local_path(u))]
    if missing:
        raise InputFileError(f"train_shards {pattern}: {len(missing)} of {len(urls)} shards do not exist, "
                             f"e.g. {missing[0]} (an entry is a wids index .json, a folder of .tar shards, a "
                             "glob or a brace pattern)")
    remote = [u for u in urls if not is_local(u)]
    if remote:
        raise InputFileError(f"train_shards {pattern}: remote shards ({remote[0]}) need a shard index with "
                             "each shard's nsamples (python -m tools.make_shards --index_only ...)")
    return [{"url": u, "nsamples": _count_samples(u), "filesize": os.path.getsize(_local_path(u))}
            for u in urls]


def read_shard_list(spec: str) -> tuple[list[dict], str | None]:
    """The shards of one train_shards entry (a shard-index json; or a folder, glob or brace pattern of
    .tar files), each local one checked to exist and to have the index's filesize, and the index's
    image-keys file (None when it names none); InputFileError names what is wrong. Shards of zero
    samples (img2dataset's last shard when all its urls failed) stay in the list with nsamples 0."""
    keys_file = None
    if spec.endswith(".json"):
        shards, desc = _from_index(spec)
        if desc.get("image_keys"):
            keys_file = os.path.join(os.path.dirname(os.path.abspath(spec)), str(desc["image_keys"]))
            if not os.path.isfile(keys_file):
                raise InputFileError(f"shard index {spec}: its image_keys file {keys_file} does not exist")
    else:
        shards = _from_pattern(spec)
    if not shards:
        raise InputFileError(f"train_shards {spec}: no shards")
    for shard in shards:
        url = shard["url"]
        if not is_local(url):
            continue
        path = _local_path(url)
        if not os.path.isfile(path):
            raise InputFileError(f"shard {path} (listed in {spec}) does not exist")
        size, expected = os.path.getsize(path), shard.get("filesize")
        if expected is not None and size != expected:
            raise InputFileError(f"shard {path} (listed in {spec}) has {size} bytes, the index says "
                                 f"{expected}: it is truncated or was rewritten; re-copy it or rebuild the "
                                 "index")
    return shards, keys_file


def _caption(sample: dict, where: str) -> str | list[str]:
    """The caption of a wids sample: the `.json` member's `caption` (a string or list), else `.txt`."""
    if ".json" in sample:
        try:
            meta = json.loads(sample[".json"].read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MissingTextError(f"{where}.json is not UTF-8 JSON ({e})") from None
        caption = meta.get("caption") if isinstance(meta, dict) else None
        if isinstance(caption, str) or (isinstance(caption, list) and caption
                                        and all(isinstance(c, str) for c in caption)):
            return caption
    if ".txt" in sample:
        try:
            return sample[".txt"].read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise MissingTextError(f"{where}.txt is not UTF-8 text ({e})") from None
    raise MissingTextError(f"{where} has no caption (no .txt member and no 'caption' in .json)")


class ShardDataset(Dataset):
    """One train_shards entry as a dataset: index i -> (image Tensor (3,H,W), caption str, i).

    The wids reader (its open shards) is made in each process on first use and never pickled, so that
    DataLoader workers each keep their own `lru_size` open shards.
    """

    def __init__(self, spec: str, transform: Callable, max_words: int = 30, cache_dir: str | None = None,
                 lru_size: int = 64) -> None:
        self.spec = spec
        shards, self.image_keys_file = read_shard_list(spec)
        # Empty shards hold no index: the reader gets the others (the start-up summary names them).
        self.empty_shards = [s["url"] for s in shards if int(s["nsamples"]) == 0]
        self.shards = [s for s in shards if int(s["nsamples"]) > 0]
        if not self.shards:
            raise InputFileError(f"train_shards {spec}: every one of its {len(shards)} shards is empty")
        self.transform = transform
        self.max_words = max_words
        self.cache_dir = cache_dir or default_cache_dir()
        self.lru_size = int(lru_size)
        self.length = sum(int(s["nsamples"]) for s in self.shards)
        self._reader: Any = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_reader"] = None  # open shards stay in the process that opened them
        return state

    def reader(self) -> Any:
        """This process's wids.ShardListDataset over the shard list (samples as raw member streams)."""
        if self._reader is None:
            from wids import ShardListDataset

            with contextlib.redirect_stderr(io.StringIO()):  # it prints a summary line on every creation
                reader = ShardListDataset(self.shards, lru_size=self.lru_size, transformations=[],
                                          localname=_CacheName(self.cache_dir))
            # GRIT's order visits shards at random: wids' warning about its cache miss rate would fire in
            # every worker and say nothing new (tools.loader_bench measures what it costs).
            reader.check_cache_misses = lambda: None
            self._reader = reader
        return self._reader

    def __len__(self) -> int:
        return self.length

    def sample(self, index: int) -> tuple[dict, str]:
        """Sample `index` as wids gives it ({'.jpg': stream, ..., '__key__': key}), and 'shard:key'."""
        reader = self.reader()
        try:
            shard_idx = int(reader.cum_lengths.searchsorted(index, side="right"))
            url = self.shards[shard_idx]["url"]
        except IndexError:
            raise IndexError(f"index {index} out of range for {self.length} samples of {self.spec}") from None
        inner = index - (int(reader.cum_lengths[shard_idx - 1]) if shard_idx else 0)
        try:
            shard, _, _ = reader.get_shard(index)
        except Exception as e:  # noqa: BLE001 - a truncated or corrupt tar fails inside wids in many ways
            raise ShardReadError(f"shard {url}: cannot be opened ({type(e).__name__}: {e})") from None
        if inner >= len(shard):
            raise ShardReadError(f"shard {url}: holds {len(shard)} samples, its index says "
                                 f"{self.shards[shard_idx]['nsamples']} (sample {inner} is missing)")
        try:
            sample = shard[inner]
        except Exception as e:  # noqa: BLE001
            raise ShardReadError(f"shard {url}: sample {inner} cannot be read ({type(e).__name__}: "
                                 f"{e})") from None
        return sample, f"{url}:{sample['__key__']}"

    def image_and_caption(self, index: int) -> tuple[Tensor, str]:
        """Sample `index` -> (transformed image (3,H,W), cleaned caption); a list caption gives a random
        member on every visit, drawn before the image is transformed (as the json datasets do)."""
        sample, where = self.sample(index)
        caption = _caption(sample, where)
        if isinstance(caption, list):
            caption = random.choice(caption)
        member = next((ext for ext in IMAGE_MEMBERS if ext in sample), None)
        if member is None:
            found = sorted(k for k in sample if not k.startswith("__"))
            raise ImageReadError(where, f"no image member ({'/'.join(IMAGE_MEMBERS)}), has {found}")
        image = self.transform(decode_image(sample[member], where + member))
        try:
            return image, pre_caption(caption, self.max_words)
        except EmptyTextError as e:
            raise EmptyTextError(f"{where}: {e}") from None

    def __getitem__(self, index: int) -> tuple[Tensor, str, int]:
        image, caption = self.image_and_caption(index)
        return image, caption, index

    def placeholder(self, index: int) -> tuple[Tensor, str, int]:
        """An item of the right shapes standing in for bad sample `index` (masked out of every loss)."""
        return blank_image(self.transform), PLACEHOLDER_CAPTION, index

    @property
    def image_keys(self) -> Tensor:
        """(len,) int64 image identity per sample: the index's image_keys file (tools.make_shards writes
        one, so that entries of one image file keep sharing a key), else every sample its own image (as
        img2dataset writes them)."""
        if self.image_keys_file is None:
            return torch.arange(self.length)
        import numpy as np

        try:
            keys = torch.from_numpy(np.load(self.image_keys_file).astype(np.int64))
        except (OSError, ValueError) as e:
            raise InputFileError(f"image keys {self.image_keys_file}: unreadable ({e})") from None
        if keys.shape != (self.length,):
            raise InputFileError(f"image keys {self.image_keys_file}: {tuple(keys.shape)} keys for "
                                 f"{self.length} samples of {self.spec}")
        return keys
