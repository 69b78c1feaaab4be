"""tools.warmstart: grouping hand-made features, the batched hardness, the command line on synthetic data."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from grit import GritSampler, load_index_array
from models.false_negatives import false_negative_mask
from models.negatives import hardest_negative_similarity
from tools.warmstart import INDICES_FILE, batch_hardness, group_features, main
from training.cli import run_main
from training.config import Batching

pytestmark = pytest.mark.usefixtures("in_repo")  # tests/conftest.py: repo root, one thread, synthetic data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/tiny/Pretrain.yaml"
N = 8  # configs/tiny/Pretrain.yaml batch_size
# The 722 entries of pretrain.json and small GRIT sizes keep the pass to a few seconds on a CPU.
SET = ["--set", "train_file=[data/synthetic/pretrain.json]", "batching.queue_size=256",
       "batching.search_space=128"]


@pytest.fixture(scope="module")
def tokenizer(in_repo):
    from models.tokenization import build_tokenizer

    return build_tokenizer(tiny_config("pretrain"))


def batches_of(image: torch.Tensor, text: torch.Tensor, order: torch.Tensor, size: int):
    """The features of dataset[order] as the pass yields them: (image (B,d), text (B,d), index (B,))."""
    for k in range(0, order.numel(), size):
        idx = order[k:k + size]
        yield image[idx], text[idx], idx


# ----------------------------------------------------------------------------------- grouping, hardness


def test_grouping_puts_each_tight_cluster_in_one_batch():
    # 6 clusters of N=4 around orthogonal centres: v.t is ~1 inside a cluster and ~0 across, so the
    # greedy chain visits a whole cluster before it leaves it, and with L = M = D (one sub-queue) every
    # chunk of N consecutive positions of G is exactly one cluster, whatever the start and arrival order.
    K, n, dim = 6, 4, 8
    g = torch.Generator().manual_seed(0)
    cluster = torch.arange(K).repeat_interleave(n)[torch.randperm(K * n, generator=g)]  # (D,)
    image = F.normalize(torch.eye(dim)[cluster] + 0.01 * torch.randn(K * n, dim, generator=g), dim=-1)
    text = F.normalize(image + 0.01 * torch.randn(K * n, dim, generator=g), dim=-1)
    D = K * n
    order = torch.randperm(D, generator=g)
    G = group_features(batches_of(image, text, order, 5), D, dim, queue_size=D, search_space=D, seed=3)
    assert G.dtype == torch.int64 and sorted(G.tolist()) == list(range(D))
    for chunk in G.view(K, n):
        assert cluster[chunk].unique().numel() == 1
    grouped = batch_hardness(image, text, G, n)
    randomised = batch_hardness(image, text, G[torch.randperm(D, generator=g)], n)
    assert grouped > 0.99 and randomised < grouped - 0.3, (grouped, randomised)


def clustered(D: int, clusters: int, dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture of Gaussians: image = centre + noise, text = image + noise, L2-normalised -> (D, dim) each."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, dim, generator=g)
    image = centres[torch.randint(0, clusters, (D,), generator=g)] + 0.6 * torch.randn(D, dim, generator=g)
    text = image + 0.3 * torch.randn(D, dim, generator=g)
    return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


def test_grouping_with_shuffle_and_sub_queues_is_harder_than_random():
    D = 515  # not a multiple of the queue (256), of the sub-queue (128) or of the batch
    image, text = clustered(D, clusters=32, seed=3)
    order = torch.randperm(D, generator=torch.Generator().manual_seed(1))
    sizes = dict(queue_size=256, search_space=128, seed=7)
    G = group_features(batches_of(image, text, order, 64), D, 16, **sizes)
    assert sorted(G.tolist()) == list(range(D))
    # The collector's result depends on the arrival order only, not on how the pass batches it ...
    assert torch.equal(G, group_features(batches_of(image, text, order, 7), D, 16, **sizes))
    # ... and on the seed (example shuffle, chain starts).
    other_seed = group_features(batches_of(image, text, order, 64), D, 16, **dict(sizes, seed=8))
    assert not torch.equal(G, other_seed)
    randomised = G[torch.randperm(D, generator=torch.Generator().manual_seed(2))]
    assert batch_hardness(image, text, G, N) > batch_hardness(image, text, randomised, N) + 0.15


def test_batch_hardness_is_the_training_diagnostic_per_batch():
    D, dim = 43, 6  # 5 batches of 8, 3 indices left out
    image, text = clustered(D, clusters=4, dim=dim, seed=5)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(D, generator=g)
    image_keys = torch.randint(0, 30, (D,), generator=g)  # repeats: same-image pairs
    text_keys = torch.randint(0, 35, (D,), generator=g)
    plain, guarded = [], []
    for chunk in order[:40].view(5, N):
        sim = image[chunk] @ text[chunk].T
        plain.append(hardest_negative_similarity(sim))
        positive = false_negative_mask(image_keys[chunk], text_keys[chunk])
        guarded.append(hardest_negative_similarity(sim, positive))
    assert batch_hardness(image, text, order, N) == pytest.approx(float(torch.stack(plain).mean()), abs=1e-6)
    assert batch_hardness(image, text, order, N, image_keys, text_keys) == pytest.approx(
        float(torch.stack(guarded).mean()), abs=1e-6)
    with pytest.raises(ValueError, match="no batch"):
        batch_hardness(image, text, order[:5], N)


# ------------------------------------------------------------------------------------- command line


def test_cli_writes_the_index_array_the_sampler_starts_from(tmp_path, pretrain_checkpoint, capsys):
    out = str(tmp_path / "warm")
    path = os.path.join(out, INDICES_FILE)
    argv = ["--config", CONFIG, "--checkpoint", pretrain_checkpoint[0], "--output_dir", out,
            "--device", "cpu", "--batch_size", "100", "--seed", "3", *SET]
    record = main(argv)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == record == json.loads((tmp_path / "warm" / "warmstart.json").read_text())
    assert record["warmstart_indices"] == path
    with open("data/synthetic/pretrain.json") as f:
        D = len(json.load(f))
    assert record["indices"] == record["dataset_len"] == D and record["batch_size"] == N
    for key in ("hardness_grouped", "hardness_random"):
        assert -1 <= record[key] <= 1
    assert record["seconds"] > 0

    saved = torch.load(path, weights_only=True)
    assert saved.dtype == torch.int64 and saved.dim() == 1
    G = load_index_array(path, D)  # the sampler's own reader accepts it
    assert torch.equal(G, saved) and sorted(G.tolist()) == list(range(D))  # every index once

    # Deterministic: the same seed gives the same file; GRIT is forced on for the grouping even where
    # the config turns it off (its sizes are what the tool reads).
    again = str(tmp_path / "again")
    main([*argv[:5], again, *argv[6:], "batching.strategy=random"])
    assert torch.equal(torch.load(os.path.join(again, INDICES_FILE), weights_only=True), G)

    # Epoch 0 of the sampler is cut from the file: every (rank, step) batch is one chunk of N of G.
    grit = Batching(strategy="grit", queue_size=256, search_space=128, warmstart_indices=path)
    groups = {tuple(c) for c in G[:D // N * N].view(-1, N).tolist()}
    W = 2
    samplers = [GritSampler(D, num_replicas=W, rank=r, seed=0, batch_size=N, dim=32, **grit.sampler_options())
                for r in range(W)]
    for s in samplers:
        s.set_epoch(0)
        mine = list(iter(s))
        assert len(mine) == s.batches_per_epoch * N
        assert {tuple(mine[k:k + N]) for k in range(0, len(mine), N)} <= groups
    plain = GritSampler(D, num_replicas=1, rank=0, seed=0, batch_size=N,
                        **dataclasses.replace(grit, warmstart_indices=None).sampler_options())
    plain.set_epoch(0)
    assert not {tuple(c) for c in plain.epoch_indices().view(-1, N).tolist()} <= groups


def test_cli_measures_grouping_by_masked_image_features(tmp_path, pretrain_checkpoint):
    """--image_token_drop: the data set grouped by the unmasked and by the masked image features; the index
    file is the unmasked grouping's, as without the flag."""
    out = str(tmp_path / "masked")
    argv = ["--config", CONFIG, "--checkpoint", pretrain_checkpoint[0], "--output_dir", out,
            "--device", "cpu", "--batch_size", "100", "--seed", "3", *SET]
    record = main([*argv, "--image_token_drop", "0.75"])
    masked = record["image_token_drop"]
    assert masked["rate"] == 0.75
    for key in ("hardness_grouped_by_unmasked", "hardness_grouped_by_masked",
                "hardness_grouped_by_masked_on_masked"):
        assert -1 <= masked[key] <= 1, key
    # Regrouped from the float16 copies: within their rounding of the grouping written to the file.
    assert masked["hardness_grouped_by_unmasked"] == pytest.approx(record["hardness_grouped"], abs=0.02)
    assert masked["hardness_grouped_by_masked"] != masked["hardness_grouped_by_unmasked"]
    assert 0 < masked["cosine_masked_to_unmasked"] < 1  # a quarter of the patches: another feature
    plain = main([*argv[:5], str(tmp_path / "plain"), *argv[6:]])
    assert "image_token_drop" not in plain
    assert torch.equal(torch.load(os.path.join(out, INDICES_FILE), weights_only=True),
                       torch.load(os.path.join(str(tmp_path / "plain"), INDICES_FILE), weights_only=True))


def test_cli_missing_checkpoint_is_one_clear_error(tmp_path, capsys):
    missing = str(tmp_path / "nope.pth")
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, ["--config", CONFIG, "--checkpoint", missing, "--output-dir", str(tmp_path / "w"),
                        *SET])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --checkpoint: no such file: {missing}"
    assert not (tmp_path / "w").exists()


def test_cli_grit_sizes_that_cannot_group_are_one_clear_error(tmp_path, pretrain_checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, ["--config", CONFIG, "--checkpoint", pretrain_checkpoint[0], "--output_dir",
                        str(tmp_path / "w"), *SET, "batching.search_space=4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "search_space" in err and err.count("\n") == 1
    assert not (tmp_path / "w").exists()
