"""The paper's ablation tables (1, 2, 4, 5) as tools.ablate reports them: each table's rows, the orderings
the paper states within it, the markdown table of a run's rows over seeds, and each ordering's gap paired by
seed with its 95 % t interval."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tools.stats import mean_std, paired_interval, prediction_interval

__all__ = ["COLUMNS", "GAP_FIGURES", "ORDERINGS", "TABLES", "RowResult", "gaps_markdown", "markdown_table",
           "mean_spread", "ordering_gaps"]

# The rows of each table, in the paper's order: (config name, the paper's label).
TABLES: dict[int, list[tuple[str, str]]] = {
    1: [("mlm_itm_rand", "MLM + ITM_rand"), ("mlm_itm_rand_itc", "MLM + ITM_rand + ITC"),
        ("albef_base", "ALBEF_Base")],
    2: [("albef_base", "ALBEF_Base (15 %)"), ("albef_base35", "ALBEF_Base35"),
        ("albef_base50", "ALBEF_Base50"), ("albef_base75", "ALBEF_Base75")],
    4: [("albef_base", "ALBEF_Base"), ("albef_base50", "ALBEF_Base50"),
        ("grit", "+ GRIT (shuffles)"), ("grit_naive", "+ GRIT (naive)"),
        ("grit_no_shuffle", "+ GRIT (no shuffles)"), ("grit_cons15", "+ GRIT + cons, 15 %"),
        ("grit_vlp", "+ GRIT + cons, 50 % (GRIT-VLP)")],
    5: [("itc", "ITC"), ("itc_grit", "ITC + GRIT"), ("itc_cons_grit", "ITC_cons + GRIT")],
}
# The orderings the paper states within each table: (row, the row it should beat, the claim). Naive GRIT's
# claim is a tie at a higher cost (its epoch time is in the table); the rest are "row beats baseline".
ORDERINGS: dict[int, list[tuple[str, str, str]]] = {
    1: [("mlm_itm_rand_itc", "mlm_itm_rand", "ITC helps"),
        ("albef_base", "mlm_itm_rand_itc", "hard negatives over random ones")],
    2: [("albef_base50", "albef_base", "50 % masking over 15 %")],
    4: [("albef_base50", "albef_base", "50 % masking over 15 %"),
        ("grit", "albef_base50", "GRIT over ALBEF_Base50"),
        ("grit_naive", "grit", "naive GRIT as good as GRIT"),
        ("grit", "grit_no_shuffle", "shuffles help GRIT"),
        ("grit_vlp", "grit_cons15", "50 % over 15 % under GRIT + cons"),
        ("grit_vlp", "grit", "the consistency loss adds to GRIT")],
    5: [("itc_grit", "itc", "GRIT over ITC"), ("itc_cons_grit", "itc_grit", "the consistency loss adds")],
}
# The figures the orderings are judged by: name -> (the two recall keys averaged, label).
GAP_FIGURES = {"ft_mean_r1": (("ft_tr_r1", "ft_ir_r1"), "fine-tuned mean R@1"),
               "zs_mean_r1": (("zs_tr_r1", "zs_ir_r1"), "zero-shot mean R@1")}



@dataclass
class RowResult:
    """One row's numbers for one seed (None where a step does not apply)."""

    metrics: dict[str, float | None] = field(default_factory=dict)


COLUMNS = [("zs_tr_r1", "ZS TR R@1"), ("zs_ir_r1", "ZS IR R@1"), ("zs_itc_tr_r1", "ZS TR R@1 ITC"),
           ("zs_itc_ir_r1", "ZS IR R@1 ITC"), ("zs_r_mean", "ZS r_mean"),
           ("ft_tr_r1", "FT TR R@1"), ("ft_ir_r1", "FT IR R@1"), ("ft_itc_tr_r1", "FT TR R@1 ITC"),
           ("ft_itc_ir_r1", "FT IR R@1 ITC"), ("ft_r_mean", "FT r_mean"),
           ("probe", "probe"), ("loss_itm", "loss_itm"), ("hardness", "hardness"),
           *((f"uov{k}@{p}", f"UoV@{k} (p {p})") for p in ("0.15", "0.5", "0.75") for k in (1, 5)),
           ("epoch_seconds", "s / epoch")]


def mean_spread(values: Sequence[float]) -> str:
    """'m ± s' (sample standard deviation over seeds), or 'm' for one value."""
    if len(values) == 1:
        return f"{values[0]:.3f}" if abs(values[0]) < 10 else f"{values[0]:.2f}"
    mean, sd = mean_std(values)
    return f"{mean:.3f} ± {sd:.3f}" if abs(mean) < 10 else f"{mean:.2f} ± {sd:.2f}"


def markdown_table(table: int, results: dict[str, dict[int, RowResult]], seeds: Sequence[int]) -> str:
    """The paper's columns that any row has, one line per row, mean ± spread over seeds."""
    labels = dict(TABLES[table])
    every = [r for per_seed in results.values() for r in per_seed.values()]
    present = [(k, h) for k, h in COLUMNS if any(r.metrics.get(k) is not None for r in every)]
    lines = [f"Table {table} (seeds {', '.join(map(str, seeds))}; mean ± sample std over seeds)", "",
             "| row | " + " | ".join(h for _, h in present) + " |",
             "|---|" + "---|" * len(present)]
    for row, per_seed in results.items():
        cells = []
        for key, _ in present:
            values = [r.metrics[key] for r in per_seed.values() if r.metrics.get(key) is not None]
            cells.append(mean_spread(values) if values and all(math.isfinite(v) for v in values) else "–")
        lines.append(f"| {labels[row]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _figure(metrics: dict, keys: tuple[str, str]) -> float | None:
    """The mean of two recalls of one run, None when the run lacks either (e.g. no fine-tuning)."""
    values = [metrics.get(k) for k in keys]
    return None if any(v is None for v in values) else (values[0] + values[1]) / 2


def ordering_gaps(table: int, rows: dict[str, dict[str, dict]],
                  fit_seeds: Sequence[int] | None = None) -> list[dict]:
    """Each of `table`'s ORDERINGS present in `rows` (row -> seed -> metrics, as table<N>.json holds them),
    per figure of GAP_FIGURES both rows have: the per-seed gaps (row minus baseline, on the seeds both ran),
    their paired 95 % t interval with the seeds on each side, and the 95 % prediction interval of one more
    seed's gap. With fit_seeds the intervals are those seeds' only, and 'held_out' checks the other seeds'
    gaps against them (inside the mean's interval / inside the prediction interval): seeds never fitted."""
    out = []
    for row, base, claim in ORDERINGS.get(table, []):
        if row not in rows or base not in rows:
            continue
        seeds = sorted(set(rows[row]) & set(rows[base]), key=int)
        for name, (keys, _) in GAP_FIGURES.items():
            pairs = [(_figure(rows[row][s], keys), _figure(rows[base][s], keys)) for s in seeds]
            if not pairs or any(a is None or b is None for a, b in pairs):
                continue
            by_seed = {int(s): a - b for s, (a, b) in zip(seeds, pairs, strict=True)}
            fit = [s for s in by_seed if fit_seeds is None or s in fit_seeds]
            gaps = [by_seed[s] for s in fit]
            entry = {"row": row, "baseline": base, "claim": claim, "figure": name, "seeds": fit,
                     "per_seed": gaps, **paired_interval(gaps), "prediction": prediction_interval(gaps)}
            if fit_seeds is not None:
                held = {s: g for s, g in by_seed.items() if s not in fit_seeds}
                p = entry["prediction"]
                entry["held_out"] = {
                    "per_seed": held,
                    "inside_interval": sum(entry["low"] <= g <= entry["high"] for g in held.values()),
                    "inside_prediction": sum(p["low"] <= g <= p["high"] for g in held.values())}
            out.append(entry)
    return out


def gaps_markdown(table: int, gaps: Sequence[dict]) -> str:
    """The orderings' paired gaps as a markdown table: claim, figure, mean [95 % t], seeds ahead, per seed;
    with held-out seeds (ordering_gaps' fit_seeds) also the prediction interval and how many fell inside."""
    if not gaps:
        return ""
    labels = dict(TABLES[table])
    held = "held_out" in gaps[0]
    lines = ["Orderings the paper states, paired by seed (row minus the row it should beat; 95 % t interval)"
             + (f"; intervals from seeds {', '.join(map(str, gaps[0]['seeds']))} only, the other seeds held "
                "out: each listed and counted inside the mean's interval / inside the 95 % prediction "
                "interval of one new seed's gap" if held else ""),
             "",
             "| claim | row − baseline | figure | mean [95 % t] | seeds ahead / behind | per seed |"
             + (" 95 % prediction interval | held-out gaps | inside t / prediction |" if held else ""),
             "|---|---|---|---|---|---|" + ("---|---|---|" if held else "")]
    for g in gaps:
        interval = (f"{g['mean']:+.2f} [{g['low']:+.2f}, {g['high']:+.2f}]" if math.isfinite(g["low"])
                    else f"{g['mean']:+.2f}")
        sides = f"{g['ahead']} / {g['behind']} of {g['n']}"
        line = (f"| {g['claim']} | {labels[g['row']]} − {labels[g['baseline']]} | "
                f"{GAP_FIGURES[g['figure']][1]} | {interval} | {sides} | "
                + ", ".join(f"{v:+.1f}" for v in g["per_seed"]) + " |")
        if held:
            p, h = g["prediction"], g["held_out"]
            line += (f" [{p['low']:+.2f}, {p['high']:+.2f}] | "
                     + ", ".join(f"{v:+.1f}" for v in h["per_seed"].values())
                     + f" | {h['inside_interval']} / {h['inside_prediction']} of {len(h['per_seed'])} |")
        lines.append(line)
    return "\n".join(lines) + "\n"
