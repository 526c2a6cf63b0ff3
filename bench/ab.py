"""A/B of OUR train step: two variants of the same model stepped alternately in one process.

    python -m bench.ab [--before REV|DIR] [--after REV|DIR] [--before-option K=V ...]
                       [--after-option K=V ...] [--models BERT-A,TUPE-R,DeBERTa-v3,ViT-S/16]
                       [--rounds N]      (--models study: the study's small MLM models)

``before`` is posjax at git revision REV (default HEAD), or the posjax/ package inside the folder
REV, imported from a temporary copy under another package name; ``after`` is the working tree
(or, with ``--after``, another revision or folder). ``--*-option`` are XLA compile options
(``xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT``), so flags are compared in the
same process too. Each round steps both variants back to back, in alternating order; the
table gives the median (and min–max) over rounds of t_before / t_after (> 1: after is faster),
with the load average before and after. Same CPU workloads, batch and seeds as the throughput
suite; compilation and a warm-up step are excluded. Steps shorter than ~0.5 s (the study's
small models) are timed several in a row, the same count for both variants.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):   # `python bench/ab.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import (Progress, Table, load_average, median, median_ratio,  # noqa: E402
                          parse_options, ratio_range, repeats_for, timed, timed_steps)
from bench.workloads import OursTrainer, all_workloads  # noqa: E402
from bench.host_memory import keep_freed_memory  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def import_variant(source: str, role: str, workdir: pathlib.Path) -> Any:
    """posjax as of git revision ``source`` (or the ``posjax/`` package inside the folder
    ``source``), copied under ``workdir`` and imported as posjax_<role>_<tag>."""
    folder = pathlib.Path(source)
    if (folder / "posjax" / "__init__.py").is_file():
        tag = "dir"
        shutil.copytree(folder / "posjax", workdir / "posjax")
    else:
        sha = subprocess.run(["git", "rev-parse", "--verify", f"{source}^{{commit}}"],
                             cwd=REPO, capture_output=True, text=True)
        if sha.returncode:
            raise ValueError(f"--{role}={source!r} is neither a git revision of {REPO} nor a "
                             f"folder holding posjax/: {sha.stderr.strip()}")
        tag = sha.stdout.strip()[:10]
        archive = subprocess.run(["git", "archive", sha.stdout.strip(), "posjax"], cwd=REPO,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True)
    alias = f"posjax_{role}_{tag}"
    (workdir / "posjax").rename(workdir / alias)
    pattern = re.compile(r"^(\s*)(from|import) posjax\b", re.M)
    for path in (workdir / alias).rglob("*.py"):
        path.write_text(pattern.sub(rf"\1\2 {alias}", path.read_text()))
    if str(workdir) not in sys.path:
        sys.path.insert(0, str(workdir))
    return importlib.import_module(alias)


def compare(workload, before_package, before_options, after_package, after_options,
            rounds: int) -> tuple[list[float], list[float]]:
    """Step times (s) of before and after, ``rounds`` each, alternating which goes first."""
    before = OursTrainer(workload, compiler_options=before_options, package=before_package)
    after = OursTrainer(workload, compiler_options=after_options, package=after_package)
    before.step(), after.step()   # warm-up
    count = repeats_for(min(timed(before.step), timed(after.step)))
    t_before, t_after = [], []
    for r in range(rounds):
        pair = [(before, t_before), (after, t_after)]
        for trainer, times in (pair if r % 2 == 0 else pair[::-1]):
            times.append(timed_steps(trainer.step, count))
    del before, after
    gc.collect()
    return t_before, t_after


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    p.add_argument("--before", default="HEAD",
                   help="git revision, or a folder holding posjax/, of the 'before' code")
    p.add_argument("--after", default="",
                   help="like --before; default: the working tree")
    p.add_argument("--before-option", action="append", default=[], metavar="K=V")
    p.add_argument("--after-option", action="append", default=[], metavar="K=V")
    p.add_argument("--models", default="BERT-A,TUPE-R,DeBERTa-v3,ViT-S/16",
                   help="comma-separated name prefixes of the throughput workloads")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    workloads = all_workloads("cpu")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    chosen = [w for w in workloads if any(w.name.startswith(n) for n in names)]
    unknown = [n for n in names if not any(w.name.startswith(n) for w in workloads)]
    try:
        if unknown or not chosen:
            raise ValueError(f"--models={args.models!r}: unknown {unknown}; choose from "
                             f"{[w.name for w in workloads]}")
        if args.rounds < 3:
            raise ValueError(f"--rounds={args.rounds} is too few for a median: use 3 or more")
        before_options = parse_options(args.before_option, "--before-option")
        after_options = parse_options(args.after_option, "--after-option")
        workdir = pathlib.Path(tempfile.mkdtemp(prefix="posjax_ab_"))
        package = import_variant(args.before, "before", workdir)
        after_package = import_variant(args.after, "after", workdir) if args.after else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python -m bench.ab " + " ".join(argv if argv is not None else sys.argv[1:])
    load0, t0 = load_average(), time.perf_counter()
    rows = []
    progress = Progress("ab", [1.0] * len(chosen))
    for w in chosen:
        tb, ta = compare(w, package, before_options, after_package, after_options, args.rounds)
        rows.append([w.name, 1e3 * median(tb), 1e3 * median(ta), median_ratio(tb, ta),
                     ratio_range(tb, ta), len(tb)])
        progress.tick(f"{w.name} (before {1e3 * median(tb):.0f} ms, after "
                      f"{1e3 * median(ta):.0f} ms)")
    table = Table("Our train step: before / after (same process, alternating)",
                  ["model", "before ms", "after ms", "before/after", "range", "rounds"], rows,
                  [f"before = posjax at {args.before} ({package.__name__}), options "
                   f"{before_options or 'default'}; after = "
                   f"{after_package.__name__ if after_package else 'the working tree'}, options "
                   f"{after_options or 'default'}.",
                   "before/after = median over rounds of the per-round ratio (> 1: after is "
                   "faster); order alternates every round.",
                   f"Load average before / after: {load0} / {load_average()}; "
                   f"wall time {time.perf_counter() - t0:.0f} s."])
    print(f"Command: `{command}`\n")
    print(table.markdown())
    return 0


if __name__ == "__main__":
    keep_freed_memory()   # both sides, before the first computation
    sys.exit(main())
