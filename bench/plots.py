"""PNG plots of a benchmark report: ``python -m bench.plots REPORT.json [--stem PATH]``.

``python -m bench ... --out F.md|F.json`` draws them itself, beside F, after every suite:

- ``F_throughput.png``: ours/HF train-step speed-up per model (median, min–max over rounds)
  against the target (``throughput.TARGET_SPEEDUP``);
- ``F_attention.png``: disentangled attention, forward + backward time and XLA scratch memory
  against length (log–log), per gather strategy and the naive L × L × d form (its memory is
  exactly ∝ L²; the time panel draws the L² slope for reference).

A report is what ``--out F.json`` writes (``bench.run``); a plot whose tables are missing from
it (the suite did not run or failed) is not drawn.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import textwrap
from typing import Any, Sequence

if __package__ in (None, ""):   # `python bench/plots.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.attention import MEMORY_TITLE, TIME_TITLE  # noqa: E402
from bench.throughput import SPEEDUP_TITLE, TARGET_SPEEDUP  # noqa: E402
from posjax.plots import pyplot, save_figure  # noqa: E402

STYLES = {"take": "o-", "onehot": "s-", "shift": "^-", "skew": "v-", "naive": "x--"}


def _table(report: dict[str, Any], title: str) -> dict[str, Any] | None:
    for suite in report.get("suites", []):
        for table in suite.get("tables", []):
            if table["title"] == title and table["rows"]:
                return table
    return None


def _column(table: dict[str, Any], name: str) -> list[Any]:
    index = table["columns"].index(name)
    return [row[index] for row in table["rows"]]


def plot_speedup(table: dict[str, Any], path: pathlib.Path, subtitle: str) -> pathlib.Path:
    """Bars of the median ours/HF speed-up per model, whiskers at the round min–max, a line at
    the target."""
    plt = pyplot()

    models, speedups = _column(table, "model"), _column(table, "speed-up")
    ranges = [tuple(float(x) for x in r.split("–")) for r in _column(table, "range")]
    low = [s - lo for s, (lo, _) in zip(speedups, ranges)]
    high = [hi - s for s, (_, hi) in zip(speedups, ranges)]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    bars = ax.bar(models, speedups, yerr=[low, high], capsize=6, color="#4c72b0",
                  label="ours / HF (median; whiskers: min–max over rounds)")
    ax.bar_label(bars, labels=[f"{s:.2f}×" for s in speedups], label_type="center",
                 color="white", fontsize=9)
    ax.axhline(TARGET_SPEEDUP, color="#c44e52", linestyle="--", label=f"target {TARGET_SPEEDUP}×")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylim(0, max(TARGET_SPEEDUP, *(hi for _, hi in ranges)) + 0.35)
    ax.set_ylabel("train-step speed-up over HF PyTorch")
    ax.set_title(f"Train-step throughput, ours vs Hugging Face\n{subtitle}", fontsize=9)
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def plot_attention(times: dict[str, Any], memory: dict[str, Any], path: pathlib.Path,
                   subtitle: str) -> pathlib.Path:
    """Time and scratch memory against L, log–log, one line per implementation."""
    plt = pyplot()

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, table, unit in ((ax_time, times, "ms"), (ax_mem, memory, "MiB")):
        lengths = [row[0] for row in table["rows"] if any(v is not None for v in row[1:])]
        for name, style in STYLES.items():
            if name not in table["columns"]:
                continue
            points = [(n, v) for n, v in zip(_column(table, "L"), _column(table, name))
                      if v is not None]
            if points:
                ax.plot(*zip(*points), style, label=name)
        naive = [(n, v) for n, v in zip(_column(table, "L"), _column(table, "naive"))
                 if v is not None]
        if naive and ax is ax_time:   # the L² slope through the naive form's first point
            n0, v0 = naive[0]
            ax.plot(lengths, [v0 * (n / n0) ** 2 for n in lengths], ":", color="grey",
                    label="∝ L²")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(unit)
        ax.grid(True, which="major", alpha=0.3)
    ax_time.set_title("forward + backward time", fontsize=10)
    ax_mem.set_title("XLA scratch memory (naive: one L×L×h×d tensor and more)", fontsize=10)
    ax_mem.legend(fontsize=8)
    fig.suptitle(f"Disentangled attention, one layer, batch 1\n{subtitle}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def plot_report(report: dict[str, Any], stem: pathlib.Path) -> list[pathlib.Path]:
    """Every plot the report has the tables for, as ``<stem>_<suite>.png``."""
    env = report.get("environment", {})
    machine = ", ".join(f"{env[k]}{suffix}" for k, suffix in (
        ("date", ""), ("cpu_model", ""), ("cores", " cores"), ("backend", "")) if k in env)
    subtitle = "\n".join(textwrap.wrap(f"{machine}; {report.get('command', '')}", 90))
    written = []
    speedup = _table(report, SPEEDUP_TITLE)
    if speedup is not None:
        written.append(plot_speedup(speedup, stem.with_name(f"{stem.name}_throughput.png"),
                                    subtitle))
    times, memory = _table(report, TIME_TITLE), _table(report, MEMORY_TITLE)
    if times is not None and memory is not None:
        written.append(plot_attention(times, memory,
                                      stem.with_name(f"{stem.name}_attention.png"), subtitle))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plots",
                                description="PNG plots of a benchmark report (.json).")
    p.add_argument("report", help="a report written by python -m bench ... --out F.json")
    p.add_argument("--stem", default="", help="write <stem>_<suite>.png (default: the "
                                              "report's path without .json)")
    args = p.parse_args(argv)
    path = pathlib.Path(args.report)
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        p.error(f"{path}: cannot be read as a JSON report ({e})")
    written = plot_report(report, pathlib.Path(args.stem) if args.stem else path.with_suffix(""))
    if not written:
        print(f"{path}: no throughput or attention tables to plot", file=sys.stderr)
        return 1
    for png in written:
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
