"""Ablation configs (`base:` overlays), the ITC-only retrieval path, and tools.ablate end to end (micro)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest
import torch

from tools import ablate
from training.config_files import ConfigError, load_config, to_plain
from training.config_resolve import resolve_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABLATION = os.path.join(ROOT, "configs", "ablation")


def test_base_overlay_merges_nested_keys(tmp_path):
    (tmp_path / "base.yaml").write_text("a: 1\nb: {c: 2, d: 3}\nlst: [1, 2]\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mid.yaml").write_text("base: ../base.yaml\nb: {d: 30}\n")
    (tmp_path / "top.yaml").write_text("base: sub/mid.yaml\na: 10\nlst: [5]\n")
    config = to_plain(load_config(tmp_path / "top.yaml", ["b.c=20"]))
    assert config == {"a": 10, "b": {"c": 20, "d": 30}, "lst": [5]}


def test_base_overlay_errors_name_the_file_and_key(tmp_path):
    (tmp_path / "base.yaml").write_text("a: 1\nb: {c: 2}\n")
    (tmp_path / "typo.yaml").write_text("base: base.yaml\nb: {cc: 3}\n")
    with pytest.raises(ConfigError, match=r"'b\.cc'.*typo\.yaml"):
        load_config(tmp_path / "typo.yaml")
    (tmp_path / "missing.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(FileNotFoundError, match="nowhere.yaml"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "x.yaml").write_text("base: y.yaml\n")
    (tmp_path / "y.yaml").write_text("base: x.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "x.yaml")


def _row_files() -> list[str]:
    paper = glob.glob(os.path.join(ABLATION, "*.yaml"))
    return sorted(paper + glob.glob(os.path.join(ABLATION, "tiny", "*.yaml")))


def test_every_table_row_has_a_config_in_both_presets():
    names = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ABLATION, "*.yaml"))}
    tiny = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ABLATION, "tiny", "*.yaml"))}
    rows = {row for table in ablate.TABLES.values() for row, _ in table}
    assert rows == names == tiny


@pytest.mark.parametrize("path", _row_files(), ids=lambda p: os.path.relpath(p, ABLATION))
def test_ablation_config_loads_and_validates(path):
    assert "base" not in to_plain(load_config(path))
    # The typed config: keys, types, values and GRIT's size rules all hold (data paths not checked).
    config = resolve_config("pretrain", path, check_paths=False)
    grit = config.batching
    name = os.path.basename(path)[:-5]
    # The switches each row stands for (paper Tables 1, 2, 4, 5).
    expect_grit = name.startswith(("grit", "itc_grit", "itc_cons"))
    assert grit.strategy == ("grit" if expect_grit else "random") and config.grouped == expect_grit
    assert (config.itm, config.mlm) == ((False, False) if name.startswith("itc") else (True, True))
    assert config.itc == (name != "mlm_itm_rand")
    assert (config.lambda_cons > 0) == (name in ("grit_cons15", "grit_vlp", "itc_cons_grit"))
    masking = {"albef_base": 0.15, "albef_base35": 0.35, "albef_base50": 0.5, "albef_base75": 0.75,
               "grit_cons15": 0.15, "mlm_itm_rand": 0.15, "mlm_itm_rand_itc": 0.15}
    if config.mlm:
        assert config.mlm_probability == masking.get(name, 0.5)
    if name == "grit_naive":
        assert grit.mode == "naive"
    if name in ("grit_naive", "grit_no_shuffle"):
        assert not grit.example_shuffle and not grit.batch_shuffle
    if name.startswith("mlm_itm_rand"):
        assert config.itm_negatives == "random"


def test_tiny_ablation_models_build(tmp_path):
    from transformers import BertTokenizerFast

    from models.pretrain import ALBEF_Base

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "circle"]) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab))
    for path in glob.glob(os.path.join(ABLATION, "tiny", "*.yaml")):
        config = resolve_config("pretrain", path, check_paths=False)
        # Building only: the synthetic ViT is not needed; the BERT json is the repository's.
        config = dataclasses.replace(config, bert_config=os.path.join(ROOT, config.bert_config),
                                     vision_init=None)
        model = ALBEF_Base(config, tokenizer)
        assert model.uses_every_parameter == (config.itm and config.mlm and config.itc)


def test_itc_only_retrieval_ranks_by_itc():
    """compute_itr_scores(rerank=False) returns the ITC top-k cosines: no ITM forward at all."""
    from training.retrieval_eval import compute_itr_scores

    class NoFusion(torch.nn.Module):
        def itm_logits(self, *args):
            raise AssertionError("ITM must not run without rerank")

    gen = torch.Generator().manual_seed(0)
    feats = torch.nn.functional.normalize(torch.randn(5, 4, generator=gen), dim=1)
    enc = {"image_feat": feats, "text_feat": feats.flip(0), "image_embeds": None, "text_embeds": None,
           "text_mask": None}
    import training.retrieval_eval as re_mod

    original = re_mod.encode_eval_set
    re_mod.encode_eval_set = lambda *a, **k: enc
    try:
        out = compute_itr_scores(NoFusion(), None, ["t"] * 5, None, torch.device("cpu"), k_test=3,
                                 rerank=False)
    finally:
        re_mod.encode_eval_set = original
    sim = feats @ feats.flip(0).t()
    top, idx = sim.topk(3, dim=1)
    assert torch.equal(out["i2t_idx"], idx) and torch.allclose(out["i2t_score"], top)
    assert out["itm_pairs"] == 0


@pytest.fixture()
def micro_env(in_repo, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.slow  # a minute of micro pre-training and fine-tuning: make test-slow (table 2's test stays)
def test_ablate_micro_end_to_end_and_reuse(micro_env, tmp_path, monkeypatch):
    """Table 5 (the ITC-only dual encoder) on the micro preset: pre-train, zero-shot and fine-tuned
    retrieval, one markdown row per config; a second call reuses every step; other settings are refused."""
    out = str(tmp_path / "abl")
    args = ["--preset", "micro", "--table", "5", "--seeds", "1", "--rows", "itc", "itc_grit",
            "--output_dir", out]
    record = ablate.main(args)
    metrics = record["rows"]["itc_grit"]["1"]
    for key in ("zs_tr_r1", "zs_ir_r1", "zs_itc_tr_r1", "zs_itc_ir_r1", "ft_tr_r1", "ft_ir_r1",
                "ft_itc_tr_r1", "ft_itc_ir_r1", "epoch_seconds"):
        assert isinstance(metrics[key], float) and metrics[key] >= 0, key
    # An ITC-only row ranks by ITC alone: its re-ranked and ITC columns are one ranking.
    assert (metrics["zs_tr_r1"], metrics["zs_ir_r1"]) == (metrics["zs_itc_tr_r1"], metrics["zs_itc_ir_r1"])
    assert metrics["loss_itm"] is None and "probe" not in metrics  # no ITM head to probe
    log_path = os.path.join(out, "micro", "itc_grit", "seed1", "pretrain", "log.txt")
    log = [json.loads(line) for line in open(log_path)]
    assert len(log) == 2 and all(r["loss_itm"] == 0 and r["loss_mlm"] == 0 for r in log)
    assert all(-1 <= r["hardness"] <= 1 for r in log)  # a cosine similarity, logged every epoch
    saved = resolve_config("pretrain", os.path.join(os.path.dirname(log_path), "config.yaml"),
                           check_paths=False)
    assert saved.batching.strategy == "grit" and not saved.itm  # the row ran GRIT without ITM
    table = open(os.path.join(out, "micro", "table5.md")).read()
    assert "| ITC |" in table and "| ITC + GRIT |" in table and "ITC_cons" not in table
    assert "ZS TR R@1 ITC" in table and "FT IR R@1 ITC" in table
    report = open(os.path.join(out, "micro", "table5_report", "report.md")).read()
    assert "ITC + GRIT (seed 1)" in report and "hardness" in report

    def no_run(cmd):
        raise AssertionError(f"reused results must not rerun {cmd}")

    monkeypatch.setattr(ablate, "run", no_run)
    assert ablate.main(args)["rows"] == record["rows"]
    with pytest.raises(ConfigError, match="another --output_dir"):
        ablate.main([*args, "--set", "lambda_cons=0.5"])


@pytest.mark.slow  # a minute of micro pre-training, retrieval, probe and UoV: make test-slow
def test_ablate_micro_table2_reads_uov(micro_env, tmp_path, monkeypatch):
    """Table 2 rows also run tools.uov; its UoV@1/@5 per masking probability reach the table. Started from
    another working directory with a relative --output_dir: the scripts and tools it launches (tools.launch)
    write where the user meant and read the configs' repository-relative paths from the repository."""
    monkeypatch.chdir(tmp_path)
    record = ablate.main(["--preset", "micro", "--table", "2", "--seeds", "1", "--rows", "albef_base",
                          "--no_finetune", "--output-dir", "abl2"])
    assert os.getcwd() == str(tmp_path) and not os.path.exists(tmp_path / "data")
    out = str(tmp_path / "abl2")
    metrics = record["rows"]["albef_base"]["1"]
    with open(os.path.join(out, "micro", "albef_base", "seed1", "uov.json")) as f:
        uov = {f'{float(e["prob"]):g}': e for e in json.load(f)["results"]}
    assert sorted(uov) == ["0.15", "0.35", "0.5", "0.75"]
    for p, entry in uov.items():
        assert metrics[f"uov1@{p}"] == entry["uov1"] == pytest.approx(entry["acc1"] - entry["acc1_no_image"])
        assert metrics[f"uov5@{p}"] == entry["uov5"]
    with open(os.path.join(out, "micro", "albef_base", "seed1", "probe.json")) as f:
        assert "ft_tr_r1" not in metrics and metrics["probe"] == json.load(f)["overall"]
    assert "UoV@1 (p 0.5)" in open(os.path.join(out, "micro", "table2.md")).read()


def _table4_record(seeds=(1, 2, 3)) -> dict:
    """A table-4 record with hand-chosen recalls: GRIT row ahead of ALBEF_Base50 by 4, 6 and 8 fine-tuned."""
    def m(ft, zs):
        return {"ft_tr_r1": ft + 1.0, "ft_ir_r1": ft - 1.0, "zs_tr_r1": zs, "zs_ir_r1": zs}
    rows = {"albef_base50": {str(s): m(50.0, 40.0) for s in seeds},
            "grit": {str(s): m(50.0 + 2.0 * (s + 1), 40.0 - s) for s in seeds},
            "albef_base": {str(s): {"zs_tr_r1": 30.0, "zs_ir_r1": 30.0, "ft_tr_r1": None, "ft_ir_r1": None}
                           for s in seeds}}
    return {"table": 4, "preset": "tiny", "seeds": list(seeds), "set": [], "rows": rows}


def test_ordering_gaps_are_paired_by_seed_with_scipys_t_interval():
    from scipy import stats

    from tools.ablate_tables import ordering_gaps

    gaps = {(g["row"], g["baseline"], g["figure"]): g for g in ordering_gaps(4, _table4_record()["rows"])}
    ft = gaps[("grit", "albef_base50", "ft_mean_r1")]
    assert ft["per_seed"] == [4.0, 6.0, 8.0] and ft["seeds"] == [1, 2, 3]
    # by hand: mean 6, s = 2, t(0.975, 2) = 4.3027 -> half-width 4.3027 * 2 / sqrt(3) = 4.968
    assert ft["mean"] == 6.0 and abs(ft["high"] - ft["mean"] - 4.968) < 1e-3
    low, high = stats.t.interval(0.95, 2, loc=6.0, scale=stats.sem([4.0, 6.0, 8.0]))
    assert abs(ft["low"] - low) < 1e-9 and abs(ft["high"] - high) < 1e-9
    assert (ft["ahead"], ft["behind"], ft["n"]) == (3, 0, 3)
    zs = gaps[("grit", "albef_base50", "zs_mean_r1")]
    assert zs["per_seed"] == [-1.0, -2.0, -3.0] and (zs["ahead"], zs["behind"]) == (0, 3)
    # ALBEF_Base50 - ALBEF_Base: zero-shot only, the fine-tuned recalls being absent (None)
    assert ("albef_base50", "albef_base", "zs_mean_r1") in gaps
    assert ("albef_base50", "albef_base", "ft_mean_r1") not in gaps
    # rows the record lacks (naive GRIT, ...) give no ordering
    assert not any(g["row"] == "grit_naive" for g in gaps.values())


def test_seeds_held_out_of_the_fit_are_checked_against_its_intervals(tmp_path, capsys):
    """--fit_seeds 1 2 3 on a five-seed record: the intervals are seeds 1-3's (the prediction interval
    against scipy's), seeds 4 and 5 are counted inside or outside them, and the file is named for the fit."""
    from scipy import stats

    from tools.ablate import main
    from tools.ablate_tables import ordering_gaps

    record = _table4_record(seeds=(1, 2, 3, 4, 5))
    gaps = {(g["row"], g["figure"]): g for g in ordering_gaps(4, record["rows"], fit_seeds=[1, 2, 3])}
    ft = gaps[("grit", "ft_mean_r1")]  # gaps 4, 6, 8 fitted; 10 and 12 held out
    assert ft["seeds"] == [1, 2, 3] and ft["per_seed"] == [4.0, 6.0, 8.0]
    low, high = stats.t.interval(0.95, 2, loc=6.0, scale=2.0 * (1 + 1 / 3) ** 0.5)
    assert ft["prediction"]["low"] == pytest.approx(low) and ft["prediction"]["high"] == pytest.approx(high)
    assert ft["held_out"] == {"per_seed": {4: 10.0, 5: 12.0}, "inside_interval": 1, "inside_prediction": 2}
    zs = gaps[("grit", "zs_mean_r1")]  # -1, -2, -3 fitted: [-4.48, +0.48]; -4 inside, -5 outside
    assert (zs["held_out"]["inside_interval"], zs["held_out"]["inside_prediction"]) == (1, 2)
    every = {(g["row"], g["figure"]): g for g in ordering_gaps(4, record["rows"])}[("grit", "ft_mean_r1")]
    assert every["seeds"] == [1, 2, 3, 4, 5] and "held_out" not in every
    path = tmp_path / "table4.json"
    path.write_text(json.dumps(record))
    main(["--table", "4", "--from_record", str(path), "--fit_seeds", "1", "2", "3", "--output_dir",
          str(tmp_path / "out")])
    text = (tmp_path / "out" / "table4_gaps_fit1-2-3.md").read_text()
    assert ("+6.00 [+1.03, +10.97] | 3 / 0 of 3 | +4.0, +6.0, +8.0 | [-3.94, +15.94] | +10.0, +12.0 | "
            "1 / 2 of 2 |") in text
    with pytest.raises(SystemExit):
        main(["--table", "4", "--from_record", str(path), "--fit_seeds", "1", "7"])
    assert "--fit_seeds [7]: not seeds of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--table", "4", "--fit_seeds", "1", "2"])
    assert "--fit_seeds reads a stored record" in capsys.readouterr().err


def test_ablate_from_record_tabulates_a_stored_table_with_its_gaps(tmp_path, capsys):
    from tools.ablate import main

    path = tmp_path / "table4.json"
    path.write_text(json.dumps(_table4_record()))
    out = main(["--table", "4", "--from_record", str(path), "--output_dir", str(tmp_path / "out")])
    assert out["from_record"] == str(path) and out["rows"] == _table4_record()["rows"]
    text = (tmp_path / "out" / "table4_gaps.md").read_text()
    assert ("| GRIT over ALBEF_Base50 | + GRIT (shuffles) − ALBEF_Base50 | fine-tuned mean R@1 | "
            "+6.00 [+1.03, +10.97] | 3 / 0 of 3 | +4.0, +6.0, +8.0 |") in text
    assert json.loads((tmp_path / "out" / "table4_gaps.json").read_text())["gaps"] == json.loads(
        json.dumps(out["gaps"]))
    with pytest.raises(SystemExit):
        main(["--table", "1", "--from_record", str(path), "--output_dir", str(tmp_path / "out")])
    assert "not a record of table 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--table", "4", "--from_record", str(tmp_path / "missing.json")])
    assert "missing.json: no such file" in capsys.readouterr().err


def test_ablate_merge_reads_stored_rows_and_runs_only_the_rest(tmp_path, monkeypatch):
    """--merge: the (row, seed)s a stored table<N>.json holds are read, not run (a table extended to ten seeds
    after its run folders are gone); the gaps are over every seed; the record names what was read; a record
    of another table, preset or --set, or one without the fine-tuned figures this run asks for, is refused."""
    import dataset
    from grit_io import InputFileError
    from tools import ablate

    stored = _table4_record()  # its albef_base rows are not fine-tuned: no matter while no run asks for them
    path = tmp_path / "table4.json"
    path.write_text(json.dumps(stored))
    ran, reported = [], []

    def fake_row(row_dir, row, seed, preset, table, finetune, sets):
        ran.append((row, seed, finetune))
        return ablate.RowResult({"ft_tr_r1": 61.0, "ft_ir_r1": 59.0, "zs_tr_r1": 40.0, "zs_ir_r1": 40.0}
                                if row == "grit" else {"ft_tr_r1": 51.0, "ft_ir_r1": 49.0, "zs_tr_r1": 40.0,
                                                       "zs_ir_r1": 40.0})

    monkeypatch.setattr(dataset, "ensure_synthetic", lambda root: None)
    monkeypatch.setattr(ablate, "run_row", fake_row)
    monkeypatch.setattr(ablate, "load_runs", lambda dirs, names: reported.append(dirs) or [])
    monkeypatch.setattr(ablate, "write_report", lambda runs, out: (out, None))
    out = str(tmp_path / "out")
    args = ["--table", "4", "--rows", "albef_base50", "grit", "--seeds", "1", "2", "3", "4",
            "--output_dir", out]
    record = ablate.main([*args, "--merge", str(path)])
    assert ran == [("albef_base50", 4, True), ("grit", 4, True)]
    assert {s: record["rows"]["grit"][s] for s in ("1", "2", "3")} == stored["rows"]["grit"]
    assert set(record["rows"]) == {"albef_base50", "grit"}
    assert record["merged_from"] == {"files": [str(path)],
                                     "rows": {"albef_base50": [1, 2, 3], "grit": [1, 2, 3]}}
    ft = next(g for g in record["gaps"] if g["row"] == "grit" and g["figure"] == "ft_mean_r1")
    assert ft["per_seed"] == [4.0, 6.0, 8.0, 10.0] and ft["n"] == 4  # seed 4: 60 - 50, run here
    assert [os.path.basename(os.path.dirname(d)) for d in reported[0]] == ["seed4", "seed4"]
    assert "not run: albef_base50 seeds 1, 2, 3; grit seeds 1, 2, 3" in open(
        os.path.join(out, "tiny", "table4.md")).read()
    # zero-shot only: the stored fine-tuned figures are dropped, as the run's own rows have none
    zs_only = ablate.main([*args, "--merge", str(path), "--no_finetune"])
    assert "ft_tr_r1" not in zs_only["rows"]["grit"]["1"] and ran[-1] == ("grit", 4, False)
    with pytest.raises(InputFileError, match="made with table 4, this run with table 1"):
        ablate.main(["--table", "1", "--rows", "albef_base", "--seeds", "1", "--output_dir", out,
                     "--merge", str(path)])
    with pytest.raises(InputFileError, match=r"made with --set \[\], this run with --set"):
        ablate.main([*args, "--merge", str(path), "--set", "max_epoch=5"])
    stored["rows"]["grit"]["1"]["ft_tr_r1"] = None  # a --no_finetune record cannot stand in for a fine-tune
    path.write_text(json.dumps(stored))
    with pytest.raises(InputFileError, match="grit seed 1 was not fine-tuned"):
        ablate.main([*args, "--merge", str(path)])
    # Another command writing table4 into the same folder is refused before it runs anything; with its own
    # --record it runs and writes <record>.json / .md beside table4's
    from tools.cli import record_claim

    ran.clear()
    with record_claim(os.path.join(out, "tiny"), "table4", "tools.ablate"):
        with pytest.raises(InputFileError, match="table4.json: python -m tools.ablate"):
            ablate.main([*args, "--no_finetune"])
        assert ran == []
        ablate.main([*args, "--no_finetune", "--record", "table4_b"])
    assert len(ran) == 8 and os.path.isfile(os.path.join(out, "tiny", "table4_b.json"))
    assert os.path.isfile(os.path.join(out, "tiny", "table4_b.md"))
