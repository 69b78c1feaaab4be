"""Online batch selection (issue 52): JEST's joint selection and RHO-LOSS on the batching interface
(grit.strategies.jest, .rho, grit.online.OnlineSampler), and a tiny pre-training with each."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import assert_resumed_from, fault_env, read_latest, run_here, run_script, small_pretrain_sets

from grit.online import OnlineSampler
from grit.strategies import build
from grit.strategies._contrastive import KINDS, conditional_losses, example_losses, subset_loss
from tools.check_selections import check_epoch


def test_the_registry_knows_the_online_strategies():
    """ONLINE names exactly the strategy modules that define a Selection; each builds from its block."""
    import importlib

    from grit.strategies import NAMES, ONLINE, Selection
    from training.config import Batching

    online = [n for n in NAMES[1:] if hasattr(importlib.import_module(f"grit.strategies.{n}"), "SELECTION")]
    assert sorted(online) == sorted(ONLINE) == ["jest", "rho"]
    for name in ONLINE:
        assert isinstance(build(name, 4, **Batching().options(name)), Selection)


def _logits(K: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, K, generator=g, dtype=torch.float64) * scale


def _direct_example_losses(a: torch.Tensor, kind: str) -> torch.Tensor:
    """Each candidate's loss in the whole super-batch, written out with torch's own losses."""
    K = a.shape[0]
    target = torch.arange(K)
    if kind == "softmax":
        return 0.5 * (F.cross_entropy(a, target, reduction="none") + F.cross_entropy(a.t(), target,
                                                                                    reduction="none"))
    z = 2 * torch.eye(K, dtype=a.dtype) - 1
    pairs = F.binary_cross_entropy_with_logits(a, (z + 1) / 2, reduction="none")
    return 0.5 * (pairs.sum(1) + pairs.sum(0))


@pytest.mark.parametrize("kind", KINDS)
def test_conditional_losses_equal_the_subset_losses_they_update(kind):
    """loss(S + {i}) - loss(S) for every i outside S, by the incremental update and by recomputing the
    subset's loss from scratch; and a whole batch's loss is the sum of its examples' losses."""
    a = _logits(9, seed=1)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        chosen = torch.rand(9, generator=g) < 0.4
        members = chosen.nonzero().flatten()
        base = subset_loss(a, kind, members) if len(members) else torch.zeros((), dtype=a.dtype)
        gains = conditional_losses(a, kind, chosen)
        for i in (~chosen).nonzero().flatten().tolist():
            direct = subset_loss(a, kind, torch.cat([members, torch.tensor([i])])) - base
            assert gains[i].item() == pytest.approx(direct.item(), rel=1e-9, abs=1e-9)
    assert example_losses(a, kind).sum().item() == pytest.approx(subset_loss(a, kind, torch.arange(9)).item())
    assert torch.allclose(example_losses(a, kind), _direct_example_losses(a, kind))
    # a bad sample leaves the others' losses as in the batch without it
    valid = torch.ones(9, dtype=torch.bool)
    valid[4] = False
    keep = valid.nonzero().flatten()
    assert torch.allclose(example_losses(a, kind, valid)[keep], example_losses(a[keep][:, keep], kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("score", ["learnability", "easy_reference", "hard_learner"])
def test_rho_scores_are_the_direct_losses_and_it_keeps_the_top_n(kind, score):
    """RHO-LOSS's score is the learner's loss minus the reference's, computed directly from the two models'
    logits (or JEST's ablations), and it trains on the N best; an invalid candidate is never chosen."""
    learner, reference = _logits(12, seed=3), _logits(12, seed=4)
    rho = build("rho", 4, super_batch=3, score=score)
    direct = {"learnability": _direct_example_losses(learner, kind) - _direct_example_losses(reference, kind),
              "easy_reference": -_direct_example_losses(reference, kind),
              "hard_learner": _direct_example_losses(learner, kind)}[score]
    chosen = rho.select(learner, reference, kind, None, torch.Generator())
    assert chosen.tolist() == direct.argsort(descending=True)[:4].tolist()
    valid = torch.ones(12, dtype=torch.bool)
    valid[chosen[0]] = False
    again = rho.select(learner, reference, kind, valid, torch.Generator())
    assert int(chosen[0]) not in again.tolist() and len(set(again.tolist())) == 4


def _score(learner, reference, kind, members):
    """A subset's learnability by brute force: each model's loss recomputed on the subset alone."""
    m = torch.tensor(sorted(members))
    return (subset_loss(learner, kind, m) - subset_loss(reference, kind, m)).item() if len(m) else 0.0


def _plackett_luce(logits: dict, size: int) -> dict:
    """P(the set of `size` drawn without replacement, each draw by softmax(logits) among the rest)."""
    out = {}
    for order in itertools.permutations(logits, size):
        p, rest = 1.0, dict(logits)
        for i in order:
            z = torch.tensor(list(rest.values()), dtype=torch.float64).logsumexp(0).item()
            p *= float(torch.tensor(rest[i] - z).exp())
            del rest[i]
        key = frozenset(order)
        out[key] = out.get(key, 0.0) + p
    return out


def _exact_chunked_distribution(learner, reference, kind, sizes):
    """P(chunk 1 = A, chunk 2 = B) of JEST's procedure, written out by brute force: chunk 1 uniform (the
    paper's Algorithm 1), chunk 2 without replacement by exp(score(A + {i}) - score(A))."""
    K = learner.shape[0]
    first = list(itertools.combinations(range(K), sizes[0]))
    probs = {}
    for A in first:
        base = _score(learner, reference, kind, A)
        gains = {i: _score(learner, reference, kind, (*A, i)) - base for i in range(K) if i not in A}
        for B, p in _plackett_luce(gains, sizes[1]).items():
            probs[(frozenset(A), B)] = p / len(first)
    return probs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", [(1, 1), (2, 2)], ids=["chunks_of_1", "chunks_of_2"])
def test_jest_draw_follows_the_exact_chunked_distribution(kind, sizes):
    """On a super-batch of 5, where the chunked procedure's distribution can be written out by brute force
    from the subsets' losses, 4,000 seeded draws match it (total variation below 0.06): 2 in 2 chunks of
    one, and 4 in 2 chunks of two, the second drawn at once."""
    learner, reference = _logits(5, seed=5, scale=1.5), _logits(5, seed=6, scale=1.5)
    exact = _exact_chunked_distribution(learner, reference, kind, sizes)
    assert sum(exact.values()) == pytest.approx(1.0)
    jest = build("jest", sum(sizes), super_batch=2, chunks=2)
    counts = dict.fromkeys(exact, 0)
    n = 4000
    for seed in range(n):
        drawn = jest.select(learner, reference, kind, None, torch.Generator().manual_seed(seed)).tolist()
        counts[(frozenset(drawn[:sizes[0]]), frozenset(drawn[sizes[0]:]))] += 1
    tv = 0.5 * sum(abs(counts[p] / n - exact[p]) for p in exact)
    assert tv < 0.06, tv
    # and a draw is a function of its generator
    a = jest.select(learner, reference, kind, None, torch.Generator().manual_seed(7))
    b = jest.select(learner, reference, kind, None, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_jest_chunks_distinct_valid_and_paper_sized():
    """N distinct positions, the invalid candidates left while there are enough valid ones; the paper's
    16 chunks, or one example per chunk for a batch smaller than that."""
    learner, reference = _logits(40, seed=8).float(), _logits(40, seed=9).float()
    valid = torch.ones(40, dtype=torch.bool)
    valid[::3] = False
    jest = build("jest", 20, super_batch=2)
    assert jest.chunks == 16
    chosen = jest.select(learner, reference, "sigmoid", valid, torch.Generator().manual_seed(0))
    assert len(set(chosen.tolist())) == 20 and bool(valid[chosen].all())
    # fewer valid candidates than N: every valid one, then invalid ones, never one twice
    few = torch.zeros(40, dtype=torch.bool)
    few[:5] = True
    chosen = jest.select(learner, reference, "softmax", few, torch.Generator().manual_seed(1))
    assert len(set(chosen.tolist())) == 20 and set(range(5)) <= set(chosen.tolist())
    assert build("jest", 8, super_batch=5).chunks == 8
    with pytest.raises(ValueError, match="chunks"):
        build("jest", 8, chunks=0)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_scoring_logits_are_fp32_and_leave_out_the_guards_positives(tmp_path, loss):
    """ALBEF_Base.contrastive_logits: fp32 under a bf16 step, eval mode (every image token) and back to
    training; with the false-negative guard, another entry of the same image is -inf (in neither loss),
    and the selections' losses stay finite."""
    from conftest import tiny_config, word_tokenizer
    from transformers import BatchEncoding

    from models.pretrain import ALBEF_Base

    tokenizer = word_tokenizer(tmp_path, ["red", "blue", "circle", "square"])
    config = tiny_config("pretrain", vision_init=None, image_token_drop=0.5, contrastive_loss=loss,
                         lambda_cons=0.0)
    torch.manual_seed(0)
    model = ALBEF_Base(config, tokenizer).train()
    image = torch.randn(6, 3, config.image_res, config.image_res)
    text = BatchEncoding(tokenizer(["red circle", "blue square", "red square", "blue circle", "red",
                                    "blue"], padding="max_length", max_length=8, return_tensors="pt"))
    key = torch.tensor([0, 1, 2, 0, 3, 4])  # entries 0 and 3 show one image
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, kind = model.contrastive_logits(image, text, key)
    assert kind == loss and logits.dtype == torch.float32 and model.training
    assert logits[0, 3] == logits[3, 0] == float("-inf")
    assert torch.isfinite(logits.diagonal()).all() and torch.isfinite(logits[0, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # without the keys: every pair scored
        plain, _ = model.contrastive_logits(image, text)
    assert torch.isfinite(plain).all() and torch.equal(plain[0, 1], logits[0, 1])
    assert torch.isfinite(example_losses(logits, kind)).all()
    chosen = torch.zeros(6, dtype=torch.bool)
    chosen[[0, 1]] = True
    assert torch.isfinite(conditional_losses(logits, kind, chosen)[2:]).all()


# ----------------------------------------------------------------------------------------- the sampler
D, N, k = 53, 3, 4


def _fake_logits(ids: torch.Tensor) -> torch.Tensor:
    """Logits that depend on the candidates' dataset indices only, as a model's would."""
    x = torch.sin(ids.double()[:, None] * 1.3 + ids.double()[None, :] * 0.7) * 2
    return x + torch.eye(len(ids), dtype=x.dtype) * (ids.double() % 5)[:, None]


def _run_epoch(sampler: OnlineSampler, epoch: int, stop_after: int | None = None) -> list[list[int]]:
    sampler.set_epoch(epoch)
    mine = list(iter(sampler))
    K = sampler.loader_batch_size
    chosen = []
    for s in range(len(mine) // K):
        if stop_after is not None and s == stop_after:
            return chosen
        ids = torch.tensor(mine[s * K:(s + 1) * K])
        keep = sampler.select(_fake_logits(ids), _fake_logits(ids) * 0.5, "softmax", ids)
        chosen.append(ids[keep].tolist())
        sampler.collect(torch.zeros(N, 2), torch.zeros(N, 2), ids[keep])
    sampler.end_epoch()
    return chosen


@pytest.mark.parametrize("name", ["jest", "rho"])
def test_sampler_resumes_mid_epoch_like_the_unbroken_run(name):
    """Stopped after 2 of an epoch's steps and restored from its state into a new sampler: the rest of the
    epoch's candidates and selections, and the epoch's record, are those of the unbroken run."""
    def make():
        return OnlineSampler(D, build(name, N, super_batch=k, chunks=2) if name == "jest"
                             else build(name, N, super_batch=k), num_replicas=1, rank=0, seed=11)

    full = make()
    _run_epoch(full, 0)
    whole = _run_epoch(full, 1)
    record = full.epoch_record()
    broken = make()
    _run_epoch(broken, 0)
    head = _run_epoch(broken, 1, stop_after=2)
    state = broken.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    tail = _run_epoch(resumed, 1)
    assert head + tail == whole
    again = resumed.epoch_record()
    selected = torch.cat([s["selected"] for s in again["segments"]])
    assert torch.equal(selected, record["segments"][0]["selected"])
    figures, errors = check_epoch(again)
    assert errors == [] and figures["steps"] == D // (k * N) and figures["left_out"] < k * N
    # another epoch: new candidates
    assert _run_epoch(resumed, 2) != whole


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sampler = OnlineSampler(D, build("jest", N, super_batch=k, chunks=3), seed=5)
    chosen = _run_epoch(sampler, 0)
    torch.save({"chosen": chosen, "record": sampler.epoch_record(), "mine": list(iter(sampler))},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_select_per_rank_and_record_both(tmp_path):
    """On 2 gloo ranks each rank selects among its own super-batch (chunk s*W + r of the epoch's
    permutation), the record on both ranks holds both ranks' candidates and selections, and it obeys the
    documented rule (each index a candidate once, fewer than K x W left out)."""
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    for a, b in zip(r0["record"]["segments"], r1["record"]["segments"]):
        assert torch.equal(a["candidates"], b["candidates"]) and torch.equal(a["selected"], b["selected"])
    segment = r0["record"]["segments"][0]
    T = D // (k * N * 2)
    assert segment["candidates"].shape == (T, 2, k * N) and segment["selected"].shape == (T, 2, N)
    for rank, result in enumerate((r0, r1)):
        assert segment["selected"][:, rank].tolist() == result["chosen"]
        own = set(segment["candidates"][:, rank].flatten().tolist())
        assert set(itertools.chain(*result["chosen"])) <= own
    perm = torch.randperm(D, generator=torch.Generator().manual_seed(5 + 0))[:T * 2 * k * N]
    assert torch.equal(segment["candidates"].reshape(-1), perm)  # DistributedSampler's deal of K x W
    figures, errors = check_epoch(r0["record"])
    assert errors == [] and figures["ranks"] == [2] and figures["left_out"] < 2 * k * N


def _stopped_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sampler = OnlineSampler(D, build("rho", N, super_batch=k), seed=5)
    chosen = _run_epoch(sampler, 0, stop_after=1)
    torch.save({"chosen": chosen, "state": sampler.state_dict()}, os.path.join(out_dir, f"stopped{rank}.pt"))
    dist.destroy_process_group()


def test_stopped_on_two_ranks_resumed_on_one_keeps_the_epoch_rule(tmp_path):
    """Stopped after one step on 2 gloo ranks and resumed from rank 0's state on one process (as a run
    requeued on fewer GPUs): the rest of the epoch is dealt to the one rank from the indices not yet
    candidates, and the epoch's record (a segment per part, W = 2 then 1) obeys the documented rule."""
    mp.spawn(_stopped_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    saved = torch.load(tmp_path / "stopped0.pt", weights_only=False)
    resumed = OnlineSampler(D, build("rho", N, super_batch=k), num_replicas=1, rank=0, seed=5)
    resumed.load_state_dict(saved["state"])
    tail = _run_epoch(resumed, 0)
    record = resumed.epoch_record()
    first, second = record["segments"]
    assert first["candidates"].shape == (1, 2, k * N) and second["candidates"].shape[1] == 1
    assert second["selected"][:, 0].tolist() == tail
    seen = torch.cat([first["candidates"].reshape(-1), second["candidates"].reshape(-1)])
    assert seen.unique().numel() == seen.numel()  # no index a candidate twice across the two parts
    figures, errors = check_epoch(record)
    assert errors == [], errors
    assert D - seen.numel() < k * N  # the one rank's super-batches leave fewer than K out


# ------------------------------------------------------------------------------------ pre-training
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    from dataset.synthetic import ensure_synthetic

    return ensure_synthetic(str(tmp_path_factory.mktemp("online_data") / "synthetic"), n=96, seed=3)


def _sets(data: str, **extra) -> list[str]:
    values = {"max_epoch": 2, "schedular.epochs": 2, "schedular.warmup_steps": 4, "print_freq": 1000,
              "batch_size": 4, **extra}
    return ["--set", *small_pretrain_sets(data, **values)]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> str:
    """ALBEF_Base pre-trained one epoch on the same data (random batches): the reference checkpoint."""
    import Pretrain

    out = str(tmp_path_factory.mktemp("reference"))
    run_here(Pretrain, ["--config", "configs/tiny/Pretrain.yaml", "--output_dir", out, "--device", "cpu",
                        *_sets(data_dir, max_epoch=1,
                               **{"schedular.epochs": 1, "batching.strategy": "random"})])
    return os.path.join(out, "checkpoint_00.pth")


@pytest.mark.parametrize("name", ["jest", "rho"])
def test_pretraining_selects_online_with_a_frozen_reference(data_dir, reference, tmp_path, capsys,
                                                            monkeypatch, name):
    """Changing the strategy key and naming a reference checkpoint: the run trains on selected batches,
    logs the scoring's cost, writes a record that tools.check_selections accepts, and the reference model's
    weights after training are the checkpoint's."""
    import Pretrain

    kept = {}
    real = Pretrain.load_reference

    def keep(*args):
        kept["model"] = real(*args)
        return kept["model"]

    monkeypatch.setattr(Pretrain, "load_reference", keep)
    out = str(tmp_path / name)
    sets = {"batching.strategy": name, f"batching.{name}.reference": reference,
            f"batching.{name}.super_batch": 3}
    run_here(Pretrain, ["--config", "configs/tiny/Pretrain.yaml", "--output_dir", out, "--device", "cpu",
                        *_sets(data_dir, **sets)])
    assert f"batching.strategy {name}" in capsys.readouterr().out
    with open(os.path.join(out, "log.txt")) as f:
        log = [json.loads(line) for line in f]
    assert [r["epoch"] for r in log] == [0, 1]
    for r in log:
        assert r["selection_gflop_per_step"] > 0 and r["selection_seconds"] > 0
        assert torch.isfinite(torch.tensor(r["loss_itc"]))
    from tools import check_selections

    record = check_selections.main(["--run_dir", out])
    assert record["ok"] and [e["epoch"] for e in record["epochs"]] == [0, 1]
    epoch = record["epochs"][0]
    assert epoch["candidates_per_step"] == 12 and epoch["selected_per_step"] == 4
    assert log[0]["step"] == epoch["steps"]
    saved = torch.load(reference, map_location="cpu", weights_only=True)["model"]
    for key, value in kept["model"].state_dict().items():
        assert torch.equal(value, saved[key]), key
    assert not any(p.requires_grad for p in kept["model"].parameters())


def test_reference_is_required_and_must_match(data_dir, tmp_path, reference):
    """A learnability score without a reference is refused at start-up, naming the key; so is a reference
    that is not a checkpoint of this config's model; hard_learner needs none."""
    import Pretrain
    from training.config_files import ConfigError

    base = ["--config", "configs/tiny/Pretrain.yaml", "--output_dir", str(tmp_path / "x"), "--device", "cpu"]
    with pytest.raises(ConfigError, match="batching.jest.reference"):
        run_here(Pretrain, [*base, *_sets(data_dir, **{"batching.strategy": "jest"})])
    with pytest.raises(ConfigError, match="batching.rho.reference"):
        run_here(Pretrain, [*base, *_sets(data_dir, vision_depth=2, **{"batching.strategy": "rho",
                                                                       "batching.rho.reference": reference})])


def test_killed_mid_epoch_and_resumed_equals_unbroken(data_dir, reference, tmp_path):
    """JEST with a reference, SIGKILLed mid-epoch and resumed: the same weights and the same record of
    candidates and selections as the unbroken run."""
    sets = {"schedular.epochs": 1, "batching.strategy": "jest", "batching.jest.reference": reference,
            "batching.jest.super_batch": 3, "batching.jest.chunks": 2}
    common = ["--config", "configs/tiny/Pretrain.yaml", "--device", "cpu",
              *_sets(data_dir, checkpoint_every_steps=3, max_epoch=1, **sets)]
    full = str(tmp_path / "full")
    run_script([sys.executable, "Pretrain.py", "--output_dir", full, *common])
    step = 3  # killed inside epoch 0 (9 steps), right after its first step checkpoint
    broken = str(tmp_path / "broken")
    run_script([sys.executable, "Pretrain.py", "--output_dir", broken, *common], expect=-signal.SIGKILL,
               env=fault_env(step, "kill"))
    latest = read_latest(broken)
    run_script([sys.executable, "Pretrain.py", "--output_dir", broken, "--resume", *common])
    assert_resumed_from(broken, latest)
    a = torch.load(os.path.join(full, "checkpoint_00.pth"), map_location="cpu", weights_only=True)
    b = torch.load(os.path.join(broken, "checkpoint_00.pth"), map_location="cpu", weights_only=True)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    ra = torch.load(os.path.join(full, "selections", "epoch_00.pt"), weights_only=True)
    rb = torch.load(os.path.join(broken, "selections", "epoch_00.pt"), weights_only=True)
    # the record came back whole: the steps before the kill (from the checkpoint) and those after
    assert [seg["first_step"] for seg in rb["segments"]] == [0, step]
    for what in ("candidates", "selected"):
        assert torch.equal(torch.cat([s[what] for s in rb["segments"]]), ra["segments"][0][what])
