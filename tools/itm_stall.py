"""Why GRIT's ITM stays at chance on some seeds (issue 49): the per-epoch figures of a comparison's runs, per
arm and per seed, side by side.

    python -m tools.itm_stall --compare_dir output/compare_strategies --seeds 1 2 3 4 5 6 \
        [--arms GRIT-VLP "random batches"] [--lrs 5e-4 2.5e-4] [--epochs 12] [--corpus real] \
        [--output_dir DIR]

It reads the runs `python -m tools.compare` left in its --output_dir, --compare_dir here (each arm at its
selection at --epochs, tools.arms, by default tools.compare's 24-epoch one, or at --lrs, one per arm) and
prints, per metric, a table of (arm, seed) rows by epoch: ITM's loss, accuracy and match accuracy, the
hardness of the batches, the share of mined ITM negatives from the anchor's own scene (or family) and the
share of examples whose batch holds another of their scene. Each run's itm_epoch is the epoch its ITM leaves
chance (tools.compare's rule); for each metric at the first grouped epoch (epoch 1), the rank correlation
over a grouped arm's seeds with that epoch says which figure goes with a late start. With --output_dir it
also writes itm_stall.json, itm_stall.md and, with matplotlib, itm_stall.png (one panel per metric, a line
per run, dashed where the ITM had not left chance by half the run).

The ITM figures above are each arm's on its own mined negatives, whose difficulty differs between arms.
--probe_limit N adds an arm-neutral one, `probe`: the compositional ITM probe (tools.probe, the synthetic
world's first N probe images) on every epoch's checkpoint of every run, the same pairs for every arm.
"""

from __future__ import annotations

import math
import os

from grit_io import InputFileError, read_json
from tools.arms import ARMS, arm_setting
from tools.cli import add_output_dir, emit_record, tool_parser
from tools.compare_summary import itm_epoch
from tools.launch import in_root
from tools.runs import CORPORA, PRETRAIN_CONFIG, check_schedule, reading_schedule, run_dir
from training.cli import run_main
from training.logger import current_names

__all__ = ["METRICS", "add_probe", "build_parser", "load_logs", "logged_metrics", "main", "markdown", "plot",
           "rank_correlations"]

# The figures the mechanism is sought in, in the order they are shown (older runs lack the accuracies).
METRICS = ("loss_itm", "itm_accuracy", "itm_match_accuracy", "probe", "hardness", "itm_false_negatives",
           "batch_same_scene")


def load_logs(output_dir: str, arms: list[str], seeds: list[int], lrs: list[float] | None = None,
              corpus: str = "synthetic", epochs: int | None = None,
              trained: int | None = None) -> dict[str, dict[int, list[dict]]]:
    """{arm: {seed: per-epoch log rows}} of the runs tools.compare made in output_dir, each arm at --lrs or
    at its selection on `corpus` at `epochs` (None: the corpus config's own); each run must have trained
    `trained` epochs (None: any; tools.runs.check_schedule)."""
    out: dict[str, dict[int, list[dict]]] = {}
    for arm, (lr, setting) in arm_setting(arms, lrs, corpus, epochs).items():
        out[arm] = {}
        for seed in seeds:
            folder = run_dir(output_dir, arm, seed, lr, setting)
            check_schedule(folder, trained)
            path = os.path.join(folder, "result.json")
            if not os.path.isfile(path):
                raise InputFileError(f"no run of {arm!r} (lr {lr:g}{', ' + setting if setting else ''}) seed "
                                     f"{seed}: {path} is missing (run python -m tools.compare first)")
            out[arm][seed] = [current_names(r) for r in read_json(path, "run result")["log"]]
    return out


def add_probe(logs: dict[str, dict[int, list[dict]]], compare_dir: str, arms: list[str],
              lrs: list[float] | None, limit: int, epochs: int | None = None,
              config: str = PRETRAIN_CONFIG) -> None:
    """Each log row gets `probe`: tools.probe's overall accuracy (first `limit` images) of that epoch's
    checkpoint (pretrain/checkpoint_EE.pth); InputFileError naming a missing one. The probe's own output
    is not printed."""
    import contextlib
    import io

    from tools import probe

    for arm, (lr, setting) in arm_setting(arms, lrs, epochs=epochs).items():
        for seed, rows in logs[arm].items():
            folder = os.path.join(run_dir(compare_dir, arm, seed, lr, setting), "pretrain")
            for row in rows:
                checkpoint = os.path.join(folder, f"checkpoint_{row['epoch']:02d}.pth")
                if not os.path.isfile(checkpoint):
                    raise InputFileError(f"--probe_limit: {checkpoint} is missing (the run kept fewer "
                                         "checkpoints: keep_checkpoints)")
                with contextlib.redirect_stdout(io.StringIO()):
                    result = probe.main(["--config", config, "--checkpoint", checkpoint, "--device", "cpu",
                                         "--limit", str(limit)])
                row["probe"] = result["overall"]


def rank_correlations(logs: dict[int, list[dict]], epoch: int = 1) -> dict[str, float]:
    """Spearman's rho over seeds between itm_epoch and each metric at `epoch` (nan where it is constant or
    missing): which early figure goes with a late ITM."""
    from scipy.stats import spearmanr

    late = [itm_epoch(rows) for rows in logs.values()]
    out = {}
    for name in METRICS:
        values = [rows[epoch].get(name, math.nan) if len(rows) > epoch else math.nan
                  for rows in logs.values()]
        usable = len(values) > 2 and not any(math.isnan(v) for v in values)
        usable = usable and len(set(values)) > 1 and len(set(late)) > 1
        out[name] = float(spearmanr(late, values).statistic) if usable else math.nan
    return out


def logged_metrics(logs: dict[str, dict[int, list[dict]]]) -> list[str]:
    """The METRICS some run's log has (`probe` only with --probe_limit): the tables' and panels' list."""
    return [name for name in METRICS
            if any(name in row for runs in logs.values() for rows in runs.values() for row in rows)]


def markdown(logs: dict[str, dict[int, list[dict]]]) -> str:
    """Per logged metric, a table of (arm, seed) rows by epoch, with each run's itm_epoch."""
    epochs = max(len(rows) for runs in logs.values() for rows in runs.values())
    lines = []
    for name in logged_metrics(logs):
        lines += [f"### {name}", "", "| arm | seed | itm_epoch | " + " | ".join(str(e) for e in range(epochs))
                  + " |", "|---|---|---|" + "---|" * epochs]
        for arm, runs in logs.items():
            for seed, rows in runs.items():
                cells = [f"{r[name]:.3f}" if name in r else "–" for r in rows]
                lines.append(f"| {arm} | {seed} | {itm_epoch(rows)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(logs: dict[str, dict[int, list[dict]]], path: str) -> str | None:
    """One panel per logged metric, a line per run (colour: arm; dashed: ITM at chance past half the run)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = logged_metrics(logs)
    columns = max(1, math.ceil(len(names) / 2))
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes.flat, names):
        for c, (arm, runs) in enumerate(logs.items()):
            for k, rows in enumerate(runs.values()):
                points = [(r["epoch"], r[name]) for r in rows if name in r]
                if points:
                    late = itm_epoch(rows) > len(rows) / 2
                    ax.plot(*zip(*points), color=colours[c % len(colours)], alpha=0.7,
                            linestyle="--" if late else "-", label=arm if k == 0 else None)
        ax.set_title(name)
        ax.set_xlabel("epoch")
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def build_parser():
    """The command line."""
    p = tool_parser("tools.itm_stall", __doc__.split("\n\n")[0])
    p.add_argument("--compare_dir", required=True,
                   help="the folder of a tools.compare run (its --output_dir), holding seed<S>/<arm>_lr<lr>/")
    p.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds whose runs are read")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["GRIT-VLP", "random batches"],
                   help="the arms (default: GRIT-VLP and random batches)")
    p.add_argument("--lrs", type=float, nargs="+", default=None,
                   help="each arm's learning rate, in --arms' order (default: its selection, tools.arms)")
    p.add_argument("--corpus", choices=list(CORPORA), default="synthetic",
                   help="whose selections the runs are at without --lrs (tools.arms.SELECTED_LRS; default: "
                        "synthetic)")
    p.add_argument("--epochs", type=int, default=None,
                   help="the schedule the runs trained, whose selections are read without --lrs (default: "
                        "tools.compare's, 24 epochs on the synthetic world, the real corpora's own 6)")
    p.add_argument("--probe_limit", type=int, default=0,
                   help="N > 0: the ITM probe on every epoch's checkpoint, first N probe images (default: 0, "
                        "off; synthetic world only)")
    add_output_dir(p, "itm_stall.{json,md,png}", without="the tables and the record are only printed")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Read the runs, print the tables, return (and with --report_dir write) the record."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with in_root():  # the corpus config's relative path
            epochs, trained = reading_schedule(args.epochs, args.lrs, args.corpus)
    except ValueError as e:
        parser.error(str(e))
    try:
        arm_setting(args.arms, args.lrs, args.corpus, epochs)
    except ValueError as e:
        raise InputFileError(f"--lrs or --arms: {e}") from e
    if args.probe_limit > 0 and not CORPORA[args.corpus].probe:
        raise InputFileError(f"--probe_limit: the {args.corpus} corpus has no compositional probe")
    logs = load_logs(args.compare_dir, args.arms, args.seeds, args.lrs, args.corpus, epochs, trained)
    if args.probe_limit > 0:
        add_probe(logs, args.compare_dir, args.arms, args.lrs, args.probe_limit, epochs)
    table = markdown(logs)
    print(table)
    record = {"compare_dir": args.compare_dir, "seeds": args.seeds,
              "itm_epoch": {arm: {s: itm_epoch(rows) for s, rows in runs.items()}
                            for arm, runs in logs.items()},
              "metrics": logged_metrics(logs),
              "rank_correlation_epoch1": {arm: rank_correlations(runs) for arm, runs in logs.items()},
              "logs": {arm: {s: [{k: r[k] for k in ("epoch", *METRICS) if k in r} for r in rows]
                             for s, rows in runs.items()} for arm, runs in logs.items()}}
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "itm_stall.md"), "w", encoding="utf-8") as f:
            f.write(table + "\n")
        record["figure"] = plot(logs, os.path.join(args.output_dir, "itm_stall.png"))
    return emit_record(record, args.output_dir, "itm_stall")


if __name__ == "__main__":
    run_main(main)
