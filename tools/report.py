"""Training curves of one or more runs: a markdown table per run and, with matplotlib, overlaid plots.

    python -m tools.report RUN_DIR [RUN_DIR ...] [--output_dir DIR] [--names NAME ...] [--no_plots]

Each RUN_DIR is the --output_dir of a Pretrain.py, Retrieval.py, NLVR.py or VQA.py run; its log.txt holds
one JSON object per line (training.logger.append_log). The tool writes DIR/report.md (DIR defaults to the
first RUN_DIR): per run, a table with one row per epoch and a column per numeric key, and a table
of the `--evaluate` records (which have no 'epoch'). When matplotlib is installed it also writes one
PNG per metric with the runs overlaid (x = epoch): every loss (a key naming `loss`), hardness,
samples_per_s, sampler_seconds and epoch_seconds (older logs' grit_hardness and grit_seconds read as
these), e.g. DIR/loss_itm.png, linked from report.md. Run names are the
directories' basenames, lengthened by parent folders where two would clash (seed1/pretrain,
seed2/pretrain), unless --names gives them.

load_runs, markdown_report, plot_runs and write_report are the library interface (tools.ablate and
other drivers import them); main(argv) is the command line.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from grit_io import InputFileError
from training.cli import Parser, run_main
from training.logger import current_names

__all__ = ["PLOT_EXTRA", "ReportError", "Run", "build_parser", "load_runs", "main", "markdown_report",
           "plot_metrics", "plot_runs", "run_names", "write_report"]

LOG_NAME = "log.txt"
REPORT_NAME = "report.md"
# Plotted besides the losses, in this order: GRIT's batch hardness and the two costs it trades off.
PLOT_EXTRA = ("hardness", "samples_per_s", "sampler_seconds", "epoch_seconds")
_LOSS = re.compile(r"(^|_)loss(_|$)")  # loss_itm (Pretrain, Retrieval), train_loss_vqa (VQA), train_loss_itm
NO_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install matplotlib to get them)"


class ReportError(InputFileError):
    """A run directory's log.txt (or the command line) is unusable; the message names the file and line."""


@dataclass
class Run:
    """One run: its name, directory, the per-epoch records and the records without an epoch."""

    name: str
    path: str
    epochs: list[dict] = field(default_factory=list)  # sorted by epoch, one record per epoch
    evaluations: list[dict] = field(default_factory=list)  # --evaluate records, in file order
    superseded: int = 0  # epoch records replaced by a later record of the same epoch


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def _is_number(value: object) -> bool:
    # bool is an int subclass, but a flag is not a curve.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_log(path: str) -> list[tuple[int, dict]]:
    """The (line number, JSON object) pairs of a log.txt; ReportError naming the file and line if bad."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ReportError(f"{path}, line {n}: not valid JSON ({err.msg} at column {err.colno})"
                                  ) from None
            if not isinstance(record, dict):
                raise ReportError(f"{path}, line {n}: expected a JSON object, got {type(record).__name__}")
            record = current_names(record)
            epoch = record.get("epoch")
            # The epoch is the plots' x and the rows' order: a float or a string there is a broken log.
            if "epoch" in record and not (type(epoch) is int and epoch >= 0):
                raise ReportError(f"{path}, line {n}: 'epoch' must be an integer >= 0, got {epoch!r}")
            records.append((n, record))
    if not records:
        raise ReportError(f"{path}: no records (the run has not finished an epoch yet?)")
    return records


def run_names(dirs: Sequence[str]) -> list[str]:
    """Basenames of dirs; clashing ones lengthened by parent folders (seed1/pretrain), then numbered."""
    parts = [os.path.abspath(d).strip(os.sep).split(os.sep) for d in dirs]
    depth = [1] * len(dirs)
    while True:
        names = ["/".join(p[-k:]) for p, k in zip(parts, depth)]
        longer = [i for i, name in enumerate(names) if names.count(name) > 1 and depth[i] < len(parts[i])]
        if not longer:
            break
        for i in longer:
            depth[i] += 1
    # Still equal only when the same directory is given twice.
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return out


def load_runs(dirs: Sequence[str], names: Sequence[str] | None = None) -> list[Run]:
    """Read each directory's log.txt into a Run; FileNotFoundError / ReportError name the bad path."""
    if not dirs:
        raise ReportError("no run directories given")
    if names is not None:
        if len(names) != len(dirs):
            raise ReportError(f"{len(names)} names for {len(dirs)} run directories")
        if len(set(names)) != len(names):
            raise ReportError(f"run names must differ: {list(names)}")
    names = list(names) if names is not None else run_names(dirs)
    runs = []
    for name, d in zip(names, dirs):
        if not os.path.isdir(d):
            raise FileNotFoundError(f"run directory not found: {d}")
        path = os.path.join(d, LOG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: {d} is not a training output_dir, or no epoch has "
                                    "ended yet")
        run = Run(name=name, path=d)
        by_epoch: dict[int, dict] = {}
        for _, record in read_log(path):
            if "epoch" not in record:
                run.evaluations.append(record)
                continue
            # A run restarted into the same directory without --resume appends its epochs again; the
            # later record belongs to the checkpoint now on disk.
            run.superseded += record["epoch"] in by_epoch
            by_epoch[record["epoch"]] = record
        run.epochs = [by_epoch[e] for e in sorted(by_epoch)]
        runs.append(run)
    return runs


# ----------------------------------------------------------------------------------------------
# The markdown
# ----------------------------------------------------------------------------------------------


def numeric_keys(records: Iterable[Mapping]) -> list[str]:
    """Keys with a number in at least one record, in order of first appearance."""
    keys: dict[str, None] = {}
    for record in records:
        for k, v in record.items():
            if _is_number(v):
                keys.setdefault(k, None)
    return list(keys)


def format_value(key: str, value: object) -> str:
    """A table cell: integers as they are, learning rates and tiny numbers in e-notation, else 4 decimals."""
    if not _is_number(value):
        return "" if value is None else str(value).replace("|", "\\|")
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    # As TrainLogger prints them; 4 decimals would show a learning rate or a 1e-5 loss as 0.0000.
    if key.startswith("lr") or (value != 0 and abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4f}"


def markdown_table(records: Sequence[Mapping], keys: Sequence[str]) -> list[str]:
    """The lines of a markdown table with one row per record and one column per key."""
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---:" for _ in keys) + "|"]
    for record in records:
        lines.append("| " + " | ".join(format_value(k, record.get(k)) for k in keys) + " |")
    return lines


def markdown_report(runs: Sequence[Run], plots: Sequence[str] = (), note: str = "") -> str:
    """report.md: the runs, the plots (paths relative to report.md) and each run's tables."""
    lines = ["# Training report", ""]
    for run in runs:
        counts = [f"{len(run.epochs)} epochs"] if run.epochs or not run.evaluations else []
        if run.evaluations:
            counts.append(f"{len(run.evaluations)} evaluate records")
        if run.superseded:
            counts.append(f"{run.superseded} earlier records of a re-run epoch left out")
        lines.append(f"- **{run.name}**: `{run.path}` ({', '.join(counts)})")
    lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for png in plots:
            stem = os.path.splitext(os.path.basename(png))[0]
            lines += [f"![{stem}]({png})", ""]
    if note:
        lines += [note, ""]
    for run in runs:
        lines += [f"## {run.name}", ""]
        if run.epochs:
            lines += markdown_table(run.epochs, numeric_keys(run.epochs)) + [""]
        if run.evaluations:
            lines += ["Evaluate records (no epoch):", ""]
            lines += markdown_table(run.evaluations, ["checkpoint", *numeric_keys(run.evaluations)]) + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The plots
# ----------------------------------------------------------------------------------------------


def plot_metrics(runs: Sequence[Run]) -> list[str]:
    """The metrics to plot: every loss key, then PLOT_EXTRA, each if some run's epochs have it."""
    keys = numeric_keys(r for run in runs for r in run.epochs)
    return [k for k in keys if _LOSS.search(k)] + [k for k in PLOT_EXTRA if k in keys]


def _file_name(metric: str) -> str:
    # Keys come from the log file: keep the name a plain file name whatever they hold.
    return re.sub(r"[^A-Za-z0-9_.-]", "_", metric) + ".png"


def plot_runs(runs: Sequence[Run], out_dir: str, metrics: Sequence[str] | None = None) -> list[str]:
    """One PNG per metric in out_dir, runs overlaid against epoch; the file names. ImportError without
    matplotlib."""
    # The explicit parent import fails fast (and is what a test's sys.modules['matplotlib'] = None hits).
    import matplotlib  # noqa: F401
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    os.makedirs(out_dir, exist_ok=True)
    written = []
    for metric in plot_metrics(runs) if metrics is None else metrics:
        # Figure + Agg canvas rather than pyplot: no global figure state or GUI backend in the caller.
        fig = Figure(figsize=(6.4, 4.0), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for run in runs:
            points = [(r["epoch"], r[metric]) for r in run.epochs if _is_number(r.get(metric))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=run.name)  # markers: a 1-epoch run is still visible
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)
        ax.set_title(metric)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs, not 0.5 steps
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        name = _file_name(metric)
        fig.savefig(os.path.join(out_dir, name), format="png")
        written.append(name)
    return written


def write_report(runs: Sequence[Run], out_dir: str, plots: bool = True) -> tuple[str, list[str]]:
    """Write out_dir/report.md (and the PNGs when plots and matplotlib allow); (report path, PNG names)."""
    os.makedirs(out_dir, exist_ok=True)
    pngs: list[str] = []
    note = ""
    if plots:
        try:
            pngs = plot_runs(runs, out_dir)
        except ImportError:
            note = f"_{NO_MATPLOTLIB}._"
            print(NO_MATPLOTLIB, flush=True)
    path = os.path.join(out_dir, REPORT_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown_report(runs, pngs, note) + "\n")
    return path, pngs


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


def build_parser() -> Parser:
    """The command-line flags."""
    p = Parser(prog="python -m tools.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="training run folders (a script's --output_dir, holding log.txt)")
    p.add_argument("--output_dir", default=None,
                   help=f"folder to write {REPORT_NAME} and the PNG plots into, created when missing "
                        "(default: the first RUN_DIR)")
    p.add_argument("--names", nargs="+", default=None, metavar="NAME",
                   help="one name per RUN_DIR (default: the folders' basenames)")
    p.add_argument("--no_plots", dest="plots", action="store_false", help="write the tables only")
    return p


def main(argv: Sequence[str] | None = None) -> str:
    """Write the report from the command line; returns report.md's path. A bad run folder or log.txt
    raises FileNotFoundError or ReportError (run_main: one `error:` line) before anything is written."""
    args = build_parser().parse_args(argv)
    runs = load_runs(args.run_dirs, args.names)
    path, pngs = write_report(runs, args.output_dir or args.run_dirs[0], plots=args.plots)
    print(f"wrote {path}" + (f" and {len(pngs)} plots" if pngs else ""))
    return path


if __name__ == "__main__":
    run_main(main)
