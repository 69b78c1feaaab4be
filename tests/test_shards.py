"""Pre-training from tar shards (dataset.shards, dataset.corpus, tools.make_shards): the same samples as the
json lists, random access, several sources with repeats under GRIT, bad members, start-up checks, the
converter's round trip and resume, and Pretrain.py from shards in one and two processes."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import HANG_GUARD_S, free_port, run_here, script_env, small_pretrain_sets
from PIL import Image

from dataset import SkipBadSamples, train_transform
from dataset import test_transform as eval_transform
from dataset.corpus import PretrainCorpus
from dataset.pretrain import PretrainDataset
from dataset.shards import ShardDataset
from grit import GritSampler
from grit_io import InputFileError
from tools.make_shards import convert, index_only
from training.config_files import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = 32


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    from dataset.synthetic import ensure_synthetic

    return ensure_synthetic(str(tmp_path_factory.mktemp("shard_data") / "synthetic"), n=96, seed=3)


@pytest.fixture(scope="module")
def converted(data_dir, tmp_path_factory) -> str:
    """The small synthetic pre-training list converted by tools.make_shards (shards of 20); the index."""
    out = str(tmp_path_factory.mktemp("converted"))
    return convert([os.path.join(data_dir, "pretrain.json")], data_dir, out, 20)["index"]


def _jpeg(seed: int, size: int = 40) -> bytes:
    """A small JPEG of random colours that nobody in the project made."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size, size + 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def write_img2dataset_shard(path: str, samples: list[dict]) -> None:
    """A tar in img2dataset's layout, written with the standard library's tarfile (not the project's
    converter): members {key}.jpg, {key}.txt, {key}.json in key order; a sample dict maps 'jpg', 'txt',
    'json' to bytes (a key left out is a member left out)."""
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            for ext in ("jpg", "json", "txt"):
                if ext in sample:
                    info = tarfile.TarInfo(f"{sample['key']}.{ext}")
                    info.size = len(sample[ext])
                    tar.addfile(info, io.BytesIO(sample[ext]))


WORDS = "a red green blue cube ball cone small large left right of the on".split()


def web_samples(shard: int, n: int, bad: dict[int, str] | None = None) -> list[dict]:
    """n img2dataset samples of shard `shard` (keys {shard:05d}{i:04d}); bad {i: kind} spoils sample i:
    'truncated' image, 'not_image', 'empty_caption', 'no_text', 'no_image'."""
    rng = random.Random(shard)
    out = []
    for i in range(n):
        key = f"{shard:05d}{i:04d}"
        caption = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        sample = {"key": key, "jpg": _jpeg(shard * 1000 + i), "txt": caption.encode(),
                  "json": json.dumps({"key": key, "caption": caption, "status": "success"}).encode()}
        kind = (bad or {}).get(i)
        if kind == "truncated":
            sample["jpg"] = sample["jpg"][:len(sample["jpg"]) // 3]
        elif kind == "not_image":
            sample["jpg"] = b"<html>404 not found</html>"
        elif kind == "empty_caption":
            sample["txt"] = b" ?! "
            sample["json"] = json.dumps({"key": key, "caption": " ?! "}).encode()
        elif kind == "no_text":
            del sample["txt"], sample["json"]
        elif kind == "no_image":
            del sample["jpg"]
        out.append(sample)
    return out


def write_index(path: str, shards: list[tuple[str, int]]) -> str:
    """A wids shard index by hand: [(url relative to the index, nsamples)]."""
    with open(path, "w") as f:
        json.dump({"wids_version": 1, "shardlist": [{"url": u, "nsamples": n} for u, n in shards]}, f)
    return path


def same_item(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def read(ds, i: int):
    """ds[i] with python's random seeded by i: a list caption's pick depends on the index only."""
    random.seed(i)
    return ds[i]


# ------------------------------------------------------------------------------------------ reading


def test_shards_give_the_json_lists_samples(data_dir, converted):
    json_file = os.path.join(data_dir, "pretrain.json")
    for transform in (eval_transform(RES), train_transform(RES, randaugment=True)):
        from_json = PretrainCorpus([(json_file, PretrainDataset(json_file, transform, data_dir))])
        from_shards = PretrainCorpus([(converted, ShardDataset(converted, transform))])
        assert len(from_json) == len(from_shards) > 96
        for i in range(len(from_json)):
            # the same random state before each read: the same crop, flip, RandAugment and caption pick
            random.seed(i)
            torch.manual_seed(i)
            a = from_json[i]
            random.seed(i)
            torch.manual_seed(i)
            assert same_item(a, from_shards[i]), i
    # entries that name one image file share an image key in both (the false-negative guard)
    assert torch.equal(from_json.image_keys, from_shards.image_keys)
    assert from_json.image_keys.unique().numel() == 96 < len(from_json)


def test_random_access_in_any_order(converted):
    ds = ShardDataset(converted, eval_transform(RES), lru_size=1)  # every shard change reopens a shard
    n = len(ds)
    sequential = [read(ds, i) for i in range(n)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    fresh = ShardDataset(converted, eval_transform(RES), lru_size=2)
    for i in order + order[::-1]:
        assert same_item(read(fresh, i), sequential[i])
    # the dataset pickles without its open shards (DataLoader workers open their own)
    import pickle

    clone = pickle.loads(pickle.dumps(fresh))
    assert clone._reader is None and same_item(read(clone, order[0]), sequential[order[0]])


def test_brace_pattern_counts_the_shards(tmp_path):
    for k in range(3):
        write_img2dataset_shard(str(tmp_path / f"{k:05d}.tar"), web_samples(k, 5 + k))
    ds = ShardDataset(str(tmp_path / "{00000..00002}.tar"), eval_transform(RES))
    assert len(ds) == 5 + 6 + 7 and [s["nsamples"] for s in ds.shards] == [5, 6, 7]
    assert ds[5][1] == " ".join(json.loads(web_samples(1, 6)[0]["json"])["caption"].split())
    record = index_only(str(tmp_path / "{00000..00002}.tar"), str(tmp_path / "index"), "web")
    assert record["samples"] == 18
    indexed = ShardDataset(record["index"], eval_transform(RES))  # urls relative to the index's folder
    assert len(indexed) == 18 and same_item(read(indexed, 17), read(ds, 17))


def write_img2dataset_folder(folder, counts: list[int]) -> list[str]:
    """An output folder as img2dataset writes it (`--output_format webdataset`): per shard k, {k:05d}.tar
    with members {key}.jpg, {key}.txt and {key}.json (its metadata, indented: url, caption, key, status,
    error_message, sizes, exif, sha256), {k:05d}.parquet and {k:05d}_stats.json beside it; a shard whose
    urls all failed is an empty tar. -> the captions in index order."""
    captions = []
    for k, n in enumerate(counts):
        samples = []
        for i, sample in enumerate(web_samples(k, n)):
            caption = json.loads(sample["json"])["caption"]
            meta = {"url": f"https://example.com/{k}/{i}.jpg", "caption": caption, "key": sample["key"],
                    "status": "success", "error_message": None, "width": 40, "height": 48,
                    "original_width": 400, "original_height": 480, "exif": "{}", "sha256": f"{k:02d}{i:062d}"}
            samples.append({**sample, "json": json.dumps(meta, indent=4).encode()})
            captions.append(caption)
        write_img2dataset_shard(os.path.join(folder, f"{k:05d}.tar"), samples)
        with open(os.path.join(folder, f"{k:05d}.parquet"), "wb") as f:
            f.write(b"PAR1" + bytes(64) + b"PAR1")  # pyarrow's; never opened
        with open(os.path.join(folder, f"{k:05d}_stats.json"), "w") as f:
            json.dump({"count": n, "successes": n, "failed_to_download": 10 - n, "status_dict": {}}, f)
    return captions


def test_img2dataset_output_folder_as_it_is(tmp_path):
    """train_shards takes img2dataset's folder (side files ignored, the empty last shard counted as zero
    and named), a glob of it and a brace pattern, with the same samples in the same order."""
    folder = tmp_path / "cc3m"
    folder.mkdir()
    captions = write_img2dataset_folder(str(folder), [6, 5, 0])
    tars = [str(folder / f"{k:05d}.tar") for k in range(3)]
    by_folder = ShardDataset(str(folder), eval_transform(RES))
    assert [s["url"] for s in by_folder.shards] == tars[:2] and by_folder.empty_shards == tars[2:]
    assert len(by_folder) == 11
    assert [read(by_folder, i)[1] for i in range(11)] == [" ".join(c.split()) for c in captions]
    for spec in (str(folder / "*.tar"), str(folder) + "/{00000..00002}.tar", str(folder) + "/"):
        other = ShardDataset(spec, eval_transform(RES))
        assert [s["url"] for s in other.shards] == tars[:2] and other.empty_shards == tars[2:], spec
        assert same_item(read(other, 9), read(by_folder, 9))
    corpus = PretrainCorpus([(str(folder), by_folder), (str(folder / "0000[01].tar"),
                                                        ShardDataset(str(folder / "0000[01].tar"),
                                                                     eval_transform(RES)))])
    assert len(corpus) == 22 and corpus.empty_shards() == tars[2:]
    (tmp_path / "nothing").mkdir()
    with pytest.raises(InputFileError, match="the folder .*nothing holds no .tar shards"):
        ShardDataset(str(tmp_path / "nothing"), eval_transform(RES))
    with pytest.raises(InputFileError, match="no .tar file matches .*9\\*.tar"):
        ShardDataset(str(folder / "9*.tar"), eval_transform(RES))
    only_empty = tmp_path / "failed"
    only_empty.mkdir()
    write_img2dataset_folder(str(only_empty), [0])
    with pytest.raises(InputFileError, match="every one of its 1 shards is empty"):
        ShardDataset(str(only_empty), eval_transform(RES))


def test_pretraining_from_img2dataset_folder_names_the_empty_shard(data_dir, tmp_path, capsys):
    folder = tmp_path / "web"
    folder.mkdir()
    write_img2dataset_folder(str(folder), [10, 9, 0])
    out = str(tmp_path / "run")
    _pretrain_here(data_dir, out, "train_file=null", f"train_shards={folder}", "max_epoch=1",
                   "schedular.epochs=1")
    printed = capsys.readouterr().out
    assert f"1 empty shard (0 samples) left out: {folder / '00002.tar'}" in printed
    assert "19 training examples" in printed and [r["epoch"] for r in _log(out)] == [0]


def test_list_captions_give_a_random_member(tmp_path):
    sample = {"key": "000000000", "jpg": _jpeg(1), "txt": b"first one",
              "json": json.dumps({"caption": ["first one", "second one", "third one"]}).encode()}
    write_img2dataset_shard(str(tmp_path / "a.tar"), [sample])
    ds = ShardDataset(str(tmp_path / "a.tar"), eval_transform(RES))
    random.seed(0)
    assert {ds[0][1] for _ in range(40)} == {"first one", "second one", "third one"}


# ------------------------------------------------------------------------------------------ sources


def test_two_sources_and_a_repeat_factor_under_grit(data_dir, converted):
    json_file = os.path.join(data_dir, "pretrain.json")
    tf = eval_transform(RES)
    a, b = PretrainDataset(json_file, tf, data_dir), ShardDataset(converted, tf)
    corpus = PretrainCorpus([(json_file, a), (converted, b)], {converted: 2})
    na, nb = len(a), len(b)
    assert len(corpus) == na + 2 * nb
    assert corpus.source_of(na - 1) == json_file and corpus.source_of(na) == converted
    for copy in (0, 1):  # both copies of the repeated source read its example 5
        i = na + copy * nb + 5
        random.seed(i)
        expected = b[5]
        assert same_item(read(corpus, i), (*expected[:2], i))
    keys = corpus.image_keys
    assert torch.equal(keys[na:na + nb], keys[na + nb:])  # the copies of a repeated source: the same images
    assert not set(keys[:na].tolist()) & set(keys[na:].tolist())
    with pytest.raises(ValueError, match="unknown sources"):
        PretrainCorpus([(json_file, a)], {"other.json": 2})

    # GRIT over the corpus: every index at most once an epoch (so a repeated example at most `repeat`
    # times), and what an epoch left out comes back in the next: none lost
    D, N, dim = len(corpus), 8, 16
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(D, dim, generator=g), dim=-1)
    text = F.normalize(image + 0.5 * torch.randn(D, dim, generator=g), dim=-1)
    sampler = GritSampler(D, num_replicas=1, rank=0, seed=1, batch_size=N, enabled=True, queue_size=96,
                          search_space=32, example_shuffle=True, batch_shuffle=True, mode="concurrent",
                          warmstart_indices=None, shard_grouping=True, dim=dim)
    previous = None
    for epoch in range(4):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(sampler)))
        for k in range(0, len(order), N):
            idx = order[k:k + N]
            sampler.collect(image[idx], text[idx], idx)
        sampler.end_epoch()
        assert order.unique().numel() == order.numel() == D // N * N
        example = torch.where(order >= na, (order - na) % nb + na, order)  # the underlying example
        assert example.bincount()[na:].max() <= 2
        if previous is not None:
            left_out = set(range(D)) - set(previous.tolist())
            assert left_out <= set(order.tolist())
        previous = order


# ------------------------------------------------------------------------------------------ bad data

BAD = {1: "truncated", 3: "not_image", 4: "empty_caption", 6: "no_text", 8: "no_image"}


def test_bad_members_are_skipped_counted_and_named(tmp_path):
    write_img2dataset_shard(str(tmp_path / "00000.tar"), web_samples(0, 10, BAD))
    write_img2dataset_shard(str(tmp_path / "00001.tar"), web_samples(1, 4))
    # the index claims 6 samples for a shard of 4: the last two are missing
    index = write_index(str(tmp_path / "index.json"), [("00000.tar", 10), ("00001.tar", 6)])
    ds = SkipBadSamples(PretrainCorpus([(index, ShardDataset(index, eval_transform(RES)))]))
    reasons = {i: ds[i][1] for i in range(len(ds))}
    bad = {i: r for i, r in reasons.items() if r is not None}
    assert set(bad) == set(BAD) | {14, 15}
    shard0 = str(tmp_path / "00000.tar")
    for i in BAD:
        assert f"{shard0}:00000{i:04d}" in bad[i], bad[i]  # named by shard and key
    assert "cannot read image" in bad[1] and "cannot read image" in bad[3]
    assert "empty after cleaning" in bad[4]
    assert "no caption" in bad[6] and "no image member" in bad[8]
    assert "holds 4 samples, its index says 6" in bad[14] and str(tmp_path / "00001.tar") in bad[14]
    image, caption, index = ds[1][0]  # a placeholder of the right shape, under its own index
    assert image.shape == (3, RES, RES) and index == 1


@pytest.mark.parametrize("cut, good", [(20000, 4), (30000, 0)])
def test_a_shard_truncated_after_indexing_gives_bad_samples(tmp_path, cut, good):
    """Cut inside a sample's data: the samples before it read, the rest are missing; cut inside a header:
    the shard cannot be opened. Either way each sample is a bad sample naming the shard."""
    path = str(tmp_path / "00000.tar")
    write_img2dataset_shard(path, web_samples(0, 6))
    index = write_index(str(tmp_path / "index.json"), [("00000.tar", 6)])  # no filesize: not checked
    with open(path, "r+b") as f:
        f.truncate(cut)
    ds = SkipBadSamples(ShardDataset(index, eval_transform(RES)))
    reasons = [ds[i][1] for i in range(6)]
    assert reasons[:good] == [None] * good
    assert all(r is not None and f"shard {path}: " in r for r in reasons[good:])
    assert ("cannot be opened" if good == 0 else "its index says 6") in reasons[-1]


def test_missing_or_truncated_shards_are_refused_at_start_up(tmp_path):
    write_img2dataset_shard(str(tmp_path / "00000.tar"), web_samples(0, 3))
    missing = write_index(str(tmp_path / "missing.json"), [("00000.tar", 3), ("00001.tar", 3)])
    with pytest.raises(InputFileError, match=r"00001\.tar \(listed in .*missing\.json\) does not exist"):
        ShardDataset(missing, eval_transform(RES))
    size = os.path.getsize(tmp_path / "00000.tar")
    with open(tmp_path / "sized.json", "w") as f:
        json.dump({"wids_version": 1, "shardlist": [{"url": "00000.tar", "nsamples": 3,
                                                     "filesize": size + 512}]}, f)
    with pytest.raises(InputFileError, match=rf"00000\.tar .* has {size} bytes, the index says {size + 512}"):
        ShardDataset(str(tmp_path / "sized.json"), eval_transform(RES))
    with pytest.raises(InputFileError, match=r"1 of 2 shards do not exist, e\.g\. .*00001\.tar"):
        ShardDataset(str(tmp_path / "{00000..00001}.tar"), eval_transform(RES))
    with open(tmp_path / "junk.tar", "wb") as f:
        f.write(b"\x01" * 700)
    with pytest.raises(InputFileError, match=r"junk\.tar: cannot be indexed"):
        ShardDataset(str(tmp_path / "junk.tar"), eval_transform(RES))
    with open(tmp_path / "notwids.json", "w") as f:
        json.dump({"shards": []}, f)
    with pytest.raises(InputFileError, match="not a wids shard index"):
        ShardDataset(str(tmp_path / "notwids.json"), eval_transform(RES))


# ------------------------------------------------------------------------------------------ converter


def test_converter_round_trip_and_resume(data_dir, tmp_path):
    json_file = os.path.join(data_dir, "pretrain.json")
    out = str(tmp_path / "shards")
    first = convert([json_file], data_dir, out, 25, "syn")
    n = len(PretrainDataset(json_file, eval_transform(RES), data_dir))
    assert first["samples"] == n and first["shards"] == -(-n // 25) and first["shards_resumed"] == 0
    names = sorted(f for f in os.listdir(out) if f.endswith(".tar"))
    assert len(names) == first["shards"]
    content = {f: open(os.path.join(out, f), "rb").read() for f in names}
    index = json.load(open(first["index"]))
    assert [s["url"] for s in index["shardlist"]] == names  # relative to the index's folder
    assert sum(s["nsamples"] for s in index["shardlist"]) == n
    # an interrupted run: the last shard never renamed into place, a partial one lying around
    os.remove(os.path.join(out, names[-1]))
    os.remove(os.path.join(out, names[-2]))
    with open(os.path.join(out, names[-2] + ".partial"), "wb") as f:
        f.write(b"half a shard")
    again = convert([json_file], data_dir, out, 25, "syn")
    assert again["shards_resumed"] == first["shards"] - 2
    assert {f: open(os.path.join(out, f), "rb").read() for f in names} == content  # byte for byte
    assert not [f for f in os.listdir(out) if f.endswith(".partial")]
    with pytest.raises(InputFileError, match="of another conversion"):
        convert([json_file], data_dir, out, 30, "syn")
    # every member of the first sample, img2dataset's layout
    with tarfile.open(os.path.join(out, names[0])) as tar:
        assert tar.getnames()[:3] == ["000000000.json", "000000000.png", "000000000.txt"]


def test_converter_command_line(data_dir, tmp_path):
    out = str(tmp_path / "cli")
    missing = tmp_path / "with_missing.json"
    entries = json.load(open(os.path.join(data_dir, "pretrain.json")))[:12]
    entries[3] = dict(entries[3], image="no/such/image.png")
    missing.write_text(json.dumps(entries))
    proc = subprocess.run([sys.executable, "-m", "tools.make_shards", "--train_file", str(missing),
                           "--image_root", data_dir, "--output_dir", out, "--shard_size", "5"],
                          cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["samples"] == 12 and record["shards"] == 3 and record["missing_images"] == 1
    assert "entry 3: no/such/image.png" in proc.stdout
    ds = SkipBadSamples(ShardDataset(record["index"], eval_transform(RES)))
    assert [i for i in range(12) if ds[i][1] is not None] == [3]
    proc = subprocess.run([sys.executable, "-m", "tools.make_shards", "--output_dir", out],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: give either --config")


# ------------------------------------------------------------------------------------------ config


def test_config_keys_for_shards():
    from conftest import tiny_config

    from training.config_files import config_to_dict, render_config, round_trip_yaml
    from training.config_resolve import config_from_mapping

    config = tiny_config("pretrain", train_file=None, train_shards=["a.json", "b/{0..3}.tar"],
                         train_repeat={"a.json": 3})
    assert config.train_files == [] and config.train_shard_specs == ["a.json", "b/{0..3}.tar"]
    back = config_from_mapping("pretrain", round_trip_yaml().load(render_config(config)))
    assert config_to_dict(back) == config_to_dict(config)
    with pytest.raises(ConfigError, match=r"train_repeat names 'c\.json', which is no train_file or "
                                          r"train_shards entry"):
        tiny_config("pretrain", train_repeat={"c.json": 2})
    with pytest.raises(ConfigError, match="no training data: set train_file"):
        tiny_config("pretrain", train_file=None)
    with pytest.raises(ConfigError, match="train_repeat' must be a mapping of str to int"):
        tiny_config("pretrain", train_repeat={"a.json": "twice"})


# ------------------------------------------------------------------------------------------ Pretrain.py


def _pretrain(data: str, out: str, *extra: str, launcher: list[str] | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    values = {"batching.queue_size": 40, "batching.search_space": 16, "max_epoch": 2, "schedular.epochs": 2,
              "schedular.warmup_steps": 4, "print_freq": 1000}
    cmd = [*(launcher or [sys.executable]), "Pretrain.py", "--config", "configs/tiny/Pretrain.yaml",
           "--output_dir", out, "--device", "cpu", "--set", *small_pretrain_sets(data, **values), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _pretrain_here(data: str, out: str, *extra: str) -> dict:
    """_pretrain's run in this process (conftest.run_here): the same script, no interpreter start-up."""
    import Pretrain

    values = {"batching.queue_size": 40, "batching.search_space": 16, "max_epoch": 2, "schedular.epochs": 2,
              "schedular.warmup_steps": 4, "print_freq": 1000}
    return run_here(Pretrain, ["--config", "configs/tiny/Pretrain.yaml", "--output_dir", out, "--device",
                               "cpu", "--set", *small_pretrain_sets(data, **values), *extra])


def _log(out: str) -> list[dict]:
    with open(os.path.join(out, "log.txt")) as f:
        return [json.loads(line) for line in f]


TIMINGS = {"train_seconds", "epoch_seconds", "samples_per_s", "sampler_seconds"}


def test_pretraining_from_shards_sees_what_the_json_run_sees(data_dir, converted, tmp_path):
    """Same seed, same dataset order: the same examples in the same batches, so the same losses. Only the
    json run knows the synthetic world's scenes (scenes.json beside the list; a shard carries none), so
    only its log has the mined negatives' false-negative rate and the batches' same-scene share."""
    from_json, from_shards = str(tmp_path / "json"), str(tmp_path / "shards")
    _pretrain_here(data_dir, from_json)
    _pretrain_here(data_dir, from_shards, "train_file=null", f"train_shards={converted}")
    a, b = _log(from_json), _log(from_shards)
    scene_keys = {"itm_false_negatives", "batch_same_scene"}
    assert all(scene_keys <= set(r) for r in a) and not any(scene_keys & set(r) for r in b)
    skip = TIMINGS | scene_keys
    assert [{k: v for k, v in r.items() if k not in skip} for r in a] == \
        [{k: v for k, v in r.items() if k not in skip} for r in b]
    sa = torch.load(os.path.join(from_json, "checkpoint_01.pth"), map_location="cpu", weights_only=True)
    sb = torch.load(os.path.join(from_shards, "checkpoint_01.pth"), map_location="cpu", weights_only=True)
    assert torch.equal(sa["sampler"]["indices"], sb["sampler"]["indices"])


def test_pretrain_refuses_a_missing_shard_and_writes_nothing(data_dir, tmp_path):
    index = write_index(str(tmp_path / "index.json"), [("00000.tar", 3)])
    out = tmp_path / "run"
    proc = _pretrain(data_dir, str(out), "train_file=null", f"train_shards={index}", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: shard {tmp_path / '00000.tar'} (listed in {index}) does not exist"]
    assert not out.exists()


def test_two_process_gloo_pretraining_from_independent_shards(data_dir, tmp_path):
    """Shards nobody in the project wrote (img2dataset's layout, one bad member), mixed with the json list,
    two processes, GRIT, two epochs: no index twice in an epoch, none lost, the bad member named."""
    shards = tmp_path / "web"
    shards.mkdir()
    for k in range(3):
        write_img2dataset_shard(str(shards / f"{k:05d}.tar"), web_samples(k, 16, {5: "truncated"} if k == 1
                                                                            else None))
    pattern = str(shards / "{00000..00002}.tar")
    out = str(tmp_path / "run")
    port = str(free_port())
    _pretrain(data_dir, out, f"train_shards={pattern}", "batch_size=6", "batching.search_space=12",
              "batching.queue_size=36", launcher=[sys.executable, "-m", "torch.distributed.run",
                                              "--nproc_per_node=2", "--master_port", port])
    log = _log(out)
    n_json = len(json.load(open(os.path.join(data_dir, "pretrain.json"))))
    D = n_json + 48
    assert [r["epoch"] for r in log] == [0, 1] and log[-1]["step"] == 2 * (D // 12)
    files = [os.path.join(out, f"bad_samples_rank{r}.jsonl") for r in (0, 1)]
    listed = [json.loads(line) for p in files if os.path.exists(p) for line in open(p)]
    seen = sum(r["bad_samples"] for r in log)
    assert seen == len(listed) >= 1  # the bad member, each epoch it was dealt (once at most)
    assert all(f"{shards / '00001.tar'}:000010005" in e["reason"] for e in listed)
    state = torch.load(os.path.join(out, "checkpoint_01.pth"), map_location="cpu", weights_only=True)
    nxt = state["sampler"]["indices"]
    # the next epoch: whole global batches of distinct indices of the mixed corpus, fewer than one
    # global batch left out; invalid (bad) samples are put back like unseen ones
    assert nxt.numel() == D // 12 * 12 and nxt.unique().numel() == nxt.numel()
    assert int(nxt.min()) >= 0 and int(nxt.max()) < D
    this_epoch = torch.load(os.path.join(out, "checkpoint_00.pth"), map_location="cpu",
                            weights_only=True)["sampler"]["indices"]  # epoch 1's batches
    left_out = set(range(D)) - set(this_epoch.tolist())
    bad_index = n_json + 16 + 5  # never grouped (invalid): back next epoch, as an unseen index
    assert left_out | {bad_index} <= set(nxt.tolist())


# ------------------------------------------------------------------------------------------ benchmarks


def test_grit_bench_at_scale_fields(monkeypatch):
    """tools.grit_bench --scale: per D, end_epoch's time and memory; what a sampler holds is two int32
    arrays of D after the epoch end (this epoch's and the next), 400M extrapolated from the largest D."""
    from tools import grit_bench

    monkeypatch.chdir(ROOT)
    result = grit_bench.main(["--scale", "40000", "80000", "--queue_size", "2000", "--search_space", "200",
                              "--dim", "8", "--batch_size", "16"])
    rows = result["rows"]
    assert [r["dataset"] for r in rows] == [40000, 80000] and not any("error" in r for r in rows)
    for r in rows:
        assert r["index_dtype"] == "int32" and r["held_bytes_after_end_epoch"] == 8 * r["dataset"]
        assert r["end_epoch_s"] > 0 and r["end_epoch_peak_over_rss"] >= 0
    assert result["laion_400m_per_rank"]["held_bytes"] == 8 * 400_000_000


def test_loader_bench_locality_fields(tmp_path, monkeypatch):
    from tools import loader_bench

    monkeypatch.chdir(tmp_path)
    result = loader_bench.main(["--images", "12", "--size", "64x48", "--repeats", "1", "--locality",
                                "--shard_size", "4"])
    loc = result["locality"]
    assert loc["shards"] == 3 and loc["shard_size"] == 4
    rates = loc["images_per_s_per_worker"]
    assert set(rates) == {f"{s}_{o}" for s in ("files", f"shards_lru{loc['shard_lru_size']}")
                          for o in ("sequential", "grit")} | {"shards_open_every_read"}
    assert all(v > 0 for v in rates.values())
    assert loc["open_ms_per_shard"] > 0 and loc["open_ms_per_10000_sample_shard"] > loc["open_ms_per_shard"]


def test_grit_order_is_a_permutation_of_whole_batches():
    from tools.loader_bench import grit_order

    order = grit_order(100, seed=0)
    assert len(order) == 96 and len(set(order)) == 96 and order != sorted(order)
