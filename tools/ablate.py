"""The paper's ablation tables (1, 2, 4, 5) in miniature: every row pre-trained, evaluated, tabulated.

    python -m tools.ablate --preset tiny --table 4 --seeds 1 2 3 [--output_dir output/ablation]
        [--rows grit grit_vlp] [--no_finetune] [--set key=value ...]
    python -m tools.ablate --table 4 --from_record docs/results/table4.json   # no run: re-tabulate
    python -m tools.ablate --table 4 --seeds 1 2 3 4 5 6 7 8 9 10 \
        --merge docs/results/table4.json                                      # seeds 1-3 read, 4-10 run

Each row is one config in configs/ablation/ (preset `paper`) or configs/ablation/tiny/ (`tiny`,
`micro`): a few overrides of the pre-training config (a config file's `base:` key). For every row
and seed the tool runs, each in its own directory <output_dir>/<preset>/<row>/seed<S>/:

  pretrain/   `python -m Pretrain` (resumed from its latest checkpoint when a run was cut short)
  zeroshot/   `python -m Retrieval --evaluate` on the retrieval config's test split, R@1 re-ranked by ITM
              and ranked by the ITC cosine alone (the "ITC" columns; ITC rows rank by ITC alone only)
  finetune/   `python -m Retrieval` fine-tuning from the last pre-training checkpoint (not with
              --no_finetune)
  probe.json  tools.probe, the compositional ITM probe (rows with an ITM head; synthetic presets)
  uov.json    tools.uov at masking 0.15/0.35/0.5/0.75 (Table 2 rows)

and table<N>_report/ holds tools.report's per-epoch tables and overlaid plots of the first seed's runs.

A step whose result is already on disk is reused, so a table is never recomputed from scratch and
rows shared between tables (ALBEF_Base is in Tables 1, 2 and 4) are trained once. The table is
written to <output_dir>/<preset>/table<N>.md with mean and spread (sample standard deviation) over seeds,
and every per-seed number to table<N>.json (also printed as the last line). Below the table, each ordering
the paper states within it (tools.ablate_tables.ORDERINGS) is given as a gap paired by seed, fine-tuned and
zero-shot mean R@1 (the mean of text and image R@1), with its 95 % t interval and the seeds on each side
(tools.stats.paired_interval) and the prediction interval of one new seed's gap; `--from_record` recomputes
both from a stored table<N>.json without a run (with `--fit_seeds`, the intervals from those seeds and the
record's other seeds checked against them, table<N>_gaps_fit<seeds>.md/.json),
and `--merge` reads the (row, seed)s a stored table<N>.json holds instead of running them (a table extended
to more seeds after its run folders are gone; the file must be the same table, preset and --set, and the
record's `merged_from` names what was read). `--record NAME` names the table's files (default table<N>):
two commands running other seeds into one folder keep each its own; a second command writing the same
record there is refused at its start (tools.cli.record_claim).
The scripts run as children in the repository root (tools.launch), so the tool works from any working
directory.
Presets: `paper` (configs/Pretrain.yaml sizes, configs/Retrieval_coco.yaml), `tiny` (the synthetic world,
minutes per row on a CPU), `micro` (the tiny rows on 100 images for 2 epochs: a smoke test of the whole
pipeline in about a minute).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from grit_io import read_json
from tools.ablate_tables import TABLES, RowResult, gaps_markdown, markdown_table, ordering_gaps
from tools.cli import add_record_name, emit_record, record_claim, tool_parser
from tools.launch import in_root, run
from tools.records import merge_note, merged_table_rows
from tools.report import load_runs, write_report
from tools.runs import fresh, read_log
from training.cli import Parser, run_main
from training.config_files import ConfigError, config_to_dict
from training.config_resolve import resolve_config

UOV_PROBS = ("0.15", "0.35", "0.5", "0.75")


@dataclass(frozen=True)
class Preset:
    """Where a preset's row configs live, its retrieval config, and overrides that shrink the runs."""

    config_dir: str
    retrieval_config: str
    pretrain_set: tuple[str, ...] = ()
    retrieval_set: tuple[str, ...] = ()
    finetune_set: tuple[str, ...] = ()
    limit: int | None = None  # probe / UoV examples
    finetune_subset: int | None = None  # fine-tune on the first this many entries of the train file
    synthetic: bool = True


_MICRO_SOURCE = "data/synthetic/retrieval_val.json"
_MICRO_DATA = "data/synthetic/micro_val100.json"  # its first 100 images (ensure_micro_data)
PRESETS = {
    "paper": Preset("configs/ablation", "configs/Retrieval_coco.yaml", synthetic=False),
    "tiny": Preset("configs/ablation/tiny", "configs/tiny/Retrieval.yaml"),
    # 100 images (12 batches of 8) for 2 epochs, so that epoch 1 is a GRIT epoch; GRIT's queues shrink
    # to fit; evaluation on the same 100 images; one fine-tuning epoch.
    "micro": Preset(
        "configs/ablation/tiny", "configs/tiny/Retrieval.yaml",
        pretrain_set=(f"train_file=[{_MICRO_DATA}]", "max_epoch=2", "schedular.epochs=2",
                      "batching.queue_size=32", "batching.search_space=16", "schedular.warmup_steps=2"),
        retrieval_set=(f"test_file={_MICRO_DATA}", f"val_file={_MICRO_DATA}"),
        finetune_set=("max_epoch=1", "schedular.epochs=1"), limit=40, finetune_subset=96),
}


def ensure_micro_data() -> str:
    """Write the micro preset's data, the first 100 val images, unless there (call it in the repository
    root after the synthetic world exists); returns its path."""
    if not os.path.isfile(_MICRO_DATA):
        entries = read_json(_MICRO_SOURCE, "synthetic val split")[:100]
        tmp = f"{_MICRO_DATA}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(entries, f)
        os.replace(tmp, _MICRO_DATA)  # atomic: runs started side by side may both write it
    return _MICRO_DATA


def _has_record(log: str, key: str) -> bool:
    return os.path.isfile(log) and any(key in r for r in read_log(log))


def pretrain(row_dir: str, config: str, seed: int, sets: Sequence[str], epochs: int) -> str:
    """Pre-train (or finish, or reuse) one row for `epochs` epochs; returns the last checkpoint's path."""
    out = os.path.join(row_dir, "pretrain")
    log = os.path.join(out, "log.txt")
    done = len(read_log(log)) if os.path.isfile(log) else 0
    if done < epochs:
        cmd = ["Pretrain", "--config", config, "--output_dir", out, "--seed", str(seed)]
        if os.path.isfile(os.path.join(out, "latest.json")):
            cmd.append("--resume")  # a run cut short continues from its latest checkpoint
        run([*cmd, *(["--set", *sets] if sets else [])])
    last = read_log(log)[-1]["epoch"]
    return os.path.join(out, f"checkpoint_{last:02d}.pth")


def retrieval(out: str, config: str, checkpoint: str, sets: Sequence[str], evaluate: bool) -> dict:
    """Zero-shot (evaluate=True) or fine-tuned retrieval of a checkpoint; its test-split record."""
    log = os.path.join(out, "log.txt")
    if not _has_record(log, "test_txt_r1"):
        cmd = ["Retrieval", "--config", config, "--checkpoint", checkpoint, "--output_dir", fresh(out)]
        run(cmd + (["--evaluate"] if evaluate else []) + (["--set", *sets] if sets else []))
    rows = read_log(log)
    if evaluate:
        return rows[-1]
    best = rows[-1].get("best_epoch")
    return next((r for r in rows if r.get("epoch") == best and "test_txt_r1" in r), rows[-1])


def json_step(path: str, cmd: list[str]) -> dict:
    """Run a tool that writes JSON to `path` unless that file exists; return its content."""
    if not os.path.isfile(path):
        run(cmd)
    return read_json(path, "tool result")


def train_subset(preset: Preset, out_dir: str) -> str:
    """The first preset.finetune_subset entries of the retrieval train files, written into out_dir."""
    from dataset import load_json_list

    config = resolve_config("retrieval", preset.retrieval_config, check_paths=False)
    path = os.path.join(out_dir, f"retrieval_train_first{preset.finetune_subset}.json")
    if not os.path.isfile(path):
        entries = load_json_list(config.train_files)[: preset.finetune_subset]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(entries, f)
    return path


def check_settings(row_dir: str, settings: dict) -> None:
    """Record what a row directory is trained with; refuse to reuse it for other settings."""
    path = os.path.join(row_dir, "ablate.json")
    if os.path.isfile(path):
        old = read_json(path, "ablation settings")
        if old != settings:
            changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise ConfigError(f"{path}: this row was run with other settings ({', '.join(changed)} differ); "
                              "its results would be mixed with the new ones: use another --output_dir (or "
                              "delete the directory)")
        return
    os.makedirs(row_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=1)


def run_row(row_dir: str, row: str, seed: int, preset: Preset, table: int, finetune: bool,
            sets: Sequence[str]) -> RowResult:
    """Every step of one (row, seed); returns its numbers. Call it in the repository root (main does,
    tools.launch.in_root): the configs' relative paths are read there."""
    config = os.path.join(preset.config_dir, f"{row}.yaml")
    pre_sets = [*preset.pretrain_set, *sets]
    # The pre-training children check the data paths; here only the keys are read.
    row_config = resolve_config("pretrain", config, pre_sets, check_paths=False)
    retrieval_config = resolve_config("retrieval", preset.retrieval_config, check_paths=False)
    # The resolved configs, not only their names: an edited base config must not reuse old runs.
    check_settings(row_dir, {"config": config, "seed": seed, "set": pre_sets,
                             "resolved": config_to_dict(row_config),
                             "retrieval": config_to_dict(retrieval_config),
                             "finetune_set": list(preset.finetune_set)})
    itm = row_config.itm
    checkpoint = pretrain(row_dir, config, seed, pre_sets, row_config.max_epoch)
    log = read_log(os.path.join(row_dir, "pretrain", "log.txt"))
    # ITC-only rows have no ITM head to re-rank with or to probe.
    ret_sets = [*preset.retrieval_set, *([] if itm else ["itm=false"])]
    zs = retrieval(os.path.join(row_dir, "zeroshot"), preset.retrieval_config, checkpoint, ret_sets, True)
    m: dict[str, float | None] = {
        "zs_tr_r1": zs["test_txt_r1"], "zs_ir_r1": zs["test_img_r1"], "zs_r_mean": zs["test_r_mean"],
        # The same candidates ranked by the ITC cosine alone (Retrieval.py's itc_*): which objective helped.
        "zs_itc_tr_r1": zs["test_itc_txt_r1"], "zs_itc_ir_r1": zs["test_itc_img_r1"],
        "loss_itm": log[-1]["loss_itm"] if itm else None,
        "hardness": log[-1]["hardness"],
        # Table 4's time per epoch: the whole epoch, GRIT's work outside the steps included.
        "epoch_seconds": statistics.fmean(r["epoch_seconds"] for r in log),
    }
    if finetune:
        ft_sets = [*ret_sets, *preset.finetune_set]
        if preset.finetune_subset:
            ft_sets.append(f"train_file=[{train_subset(preset, os.path.dirname(os.path.dirname(row_dir)))}]")
        ft = retrieval(os.path.join(row_dir, "finetune"), preset.retrieval_config, checkpoint, ft_sets, False)
        m.update(ft_tr_r1=ft["test_txt_r1"], ft_ir_r1=ft["test_img_r1"], ft_r_mean=ft["test_r_mean"],
                 ft_itc_tr_r1=ft["test_itc_txt_r1"], ft_itc_ir_r1=ft["test_itc_img_r1"])
    limit = ["--limit", str(preset.limit)] if preset.limit else []
    if itm and preset.synthetic:
        probe = json_step(os.path.join(row_dir, "probe.json"),
                          ["tools.probe", "--config", config, "--checkpoint", checkpoint,
                           "--output_dir", row_dir, *limit])
        m["probe"] = probe["overall"]
    if table == 2 and row_config.mlm:
        uov = json_step(os.path.join(row_dir, "uov.json"),
                        ["tools.uov", "--config", config, "--checkpoint", checkpoint, "--probs", *UOV_PROBS,
                         "--output_dir", row_dir, *limit])
        for entry in uov["results"]:
            p = f'{float(entry["prob"]):g}'
            m[f"uov1@{p}"], m[f"uov5@{p}"] = entry["uov1"], entry["uov5"]
    return RowResult(m)


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser("tools.ablate", __doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="paper: the paper's sizes; tiny: the synthetic world; micro: a one-minute smoke test "
                        "(default: tiny)")
    p.add_argument("--table", type=int, choices=sorted(TABLES), required=True, help="the paper's table")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds per row (default: 1 2 3)")
    p.add_argument("--rows", nargs="+", default=None,
                   help="a subset of the table's rows (config names; default: all)")
    p.add_argument("--output_dir", default="output/ablation",
                   help="folder of the runs, <output_dir>/<preset>/<row>/seed<S>/, and of table<N>.md, "
                        "table<N>.json and table<N>_report/ (default: output/ablation)")
    p.add_argument("--no_finetune", dest="finetune", action="store_false",
                   help="skip retrieval fine-tuning (zero-shot, probe and UoV only)")
    p.add_argument("--set", dest="sets", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="pre-training config overrides applied to every row (e.g. max_epoch=5)")
    p.add_argument("--merge", nargs="+", default=[], metavar="TABLE_JSON",
                   help="earlier table<N>.json records of this table, preset and --set: a (row, seed) they "
                        "hold is read from them, not run; the record names them (merged_from)")
    p.add_argument("--from_record", default=None, metavar="TABLE_JSON",
                   help="no run: re-tabulate a stored table<N>.json (its table must be --table) with its "
                        "orderings' paired gaps, printed and written to <output_dir>/table<N>_gaps.md/.json")
    p.add_argument("--fit_seeds", type=int, nargs="+", default=None,
                   help="with --from_record: the gaps' intervals from these seeds only, the record's other "
                        "seeds checked against them (inside the t interval / the prediction interval)")
    add_record_name(p, None, shown="table<N>")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    """Run (or reuse) every row and seed of a table, write table<N>.md / .json; returns the JSON."""
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    rows = [r for r, _ in TABLES[args.table]]
    if args.rows:
        unknown = sorted(set(args.rows) - set(rows))
        if unknown:
            parser.error(f"--rows {unknown} are not rows of table {args.table}; its rows: {rows}")
        rows = [r for r in rows if r in args.rows]
    base = os.path.join(os.path.abspath(args.output_dir), args.preset)  # the user's path, from where they are
    if args.fit_seeds and args.from_record is None:
        parser.error("--fit_seeds reads a stored record: give --from_record")
    if args.from_record is not None:
        return from_record(parser, args.from_record, args.table, os.path.abspath(args.output_dir),
                           args.fit_seeds)
    name = args.record or f"table{args.table}"
    with contextlib.ExitStack() as claim:  # the record claimed once --merge is checked
        asked = {(row, seed) for row in rows for seed in args.seeds}
        merged = merged_table_rows([os.path.abspath(m) for m in args.merge], args.table, args.preset,
                                   args.sets, args.finetune, asked)
        claim.enter_context(record_claim(base, name, 'tools.ablate'))
        read: dict[str, list[int]] = {}  # row -> the seeds read from --merge's files
        with in_root():
            if preset.synthetic:
                from dataset import ensure_synthetic

                ensure_synthetic("data/synthetic")
                if args.preset == "micro":
                    ensure_micro_data()
            results: dict[str, dict[int, RowResult]] = {}
            for row in rows:
                results[row] = {}
                for seed in args.seeds:
                    if (row, seed) in merged:
                        results[row][seed] = RowResult(merged[(row, seed)])
                        read.setdefault(row, []).append(seed)
                        continue
                    row_dir = os.path.join(base, row, f"seed{seed}")
                    results[row][seed] = run_row(row_dir, row, seed, preset, args.table, args.finetune,
                                                 args.sets)
        record = {"table": args.table, "preset": args.preset, "seeds": args.seeds, "set": args.sets,
                  "rows": {row: {str(s): r.metrics for s, r in per.items()} for row, per in results.items()},
                  **({"merged_from": {"files": args.merge, "rows": read}} if read else {})}
        record["gaps"] = ordering_gaps(args.table, record["rows"])
        text = (markdown_table(args.table, results, args.seeds) + "\n"
                + gaps_markdown(args.table, record["gaps"]))
        text += merge_note(args.merge, [f'{row} seeds {", ".join(map(str, seeds))}'
                                        for row, seeds in read.items()])
        # Per-epoch curves of every row, overlaid (the first seed run here): losses, hardness, speed, GRIT
        # time.
        labels = dict(TABLES[args.table])
        report = None
        if ran := [s for s in args.seeds if any(s not in read.get(row, []) for row in rows)]:
            seed = ran[0]
            own = [row for row in rows if seed not in read.get(row, [])]
            runs = load_runs([os.path.join(base, row, f"seed{seed}", "pretrain") for row in own],
                             names=[f"{labels[row]} (seed {seed})" for row in own])
            report, _ = write_report(runs, os.path.join(base, f"{name}_report"))
        print("\n" + text)
        print(f"written: {base}/{name}.md, {base}/{name}.json"
              + (f", {report}" if report else " (every row read from --merge: no run to report)"))
        return emit_record(record, base, name, table=text)


def from_record(parser: Parser, path: str, table: int, output_dir: str,
                fit_seeds: Sequence[int] | None = None) -> dict:
    """--from_record: the table and its orderings' gaps from a stored table<N>.json (with fit_seeds, the
    intervals from those seeds and the others held out); no run."""
    if not os.path.isfile(path):
        parser.error(f"--from_record {path}: no such file")
    record = read_json(path)
    if record.get("table") != table or not isinstance(record.get("rows"), dict):
        parser.error(f"--from_record {path}: not a record of table {table} "
                     f"(its 'table': {record.get('table')!r})")
    results = {row: {int(s): RowResult(m) for s, m in per.items()} for row, per in record["rows"].items()}
    if fit_seeds and (absent := sorted(set(fit_seeds) - {int(s) for s in record["seeds"]})):
        parser.error(f"--fit_seeds {absent}: not seeds of {path} (its seeds: {record['seeds']})")
    gaps = ordering_gaps(table, record["rows"], fit_seeds)
    text = markdown_table(table, results, record["seeds"]) + "\n" + gaps_markdown(table, gaps)
    print(text)
    return emit_record({**record, "gaps": gaps, "from_record": path,
                        **({"fit_seeds": fit_seeds} if fit_seeds else {})}, output_dir,
                       f"table{table}_gaps" + ("_fit" + "-".join(map(str, fit_seeds)) if fit_seeds else ""),
                       table=text)


if __name__ == "__main__":
    run_main(main)
