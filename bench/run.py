"""Benchmark entry point: ``python -m bench [suite ...] [--smoke] [--gpu] [--budget S] [--out F]``.

Suites (default: all, in this order): throughput, attention, compile, pipelines. ``--smoke``
runs every suite at tiny sizes (seconds; what CI runs); ``--gpu`` runs them at real sizes in
bf16 on a GPU (with ``--smoke``: tiny sizes in bf16, anywhere). The tables go to stdout as
Markdown and, with ``--out``, to a ``.md`` or ``.json`` file (rewritten after every suite),
with PNG plots beside it (``bench.plots``).
"""
from __future__ import annotations

import os
import sys

# Before jax is imported: let torch share the GPU with JAX (no 75% preallocation); and no
# persistent compilation cache (a JAX_COMPILATION_CACHE_DIR the user set for train.py), whose
# file reads the compile suite would time instead of the compiler.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Sequence  # noqa: E402

if __package__ in (None, ""):   # `python bench/run.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import one_line_error, parse_options  # noqa: E402
from bench import host_memory  # noqa: E402

SUITES = ("throughput", "attention", "compile", "pipelines")
# Share of the time budget per suite (unused time passes on to the next suite).
SHARES = {"throughput": 0.5, "attention": 0.25, "compile": 0.15, "pipelines": 0.1}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    p.add_argument("suites", nargs="*", metavar="suite",
                   help=f"any of {', '.join(SUITES)} (default: all)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 runs (CI)")
    p.add_argument("--gpu", action="store_true", help="real sizes in bf16 on a GPU")
    p.add_argument("--runs", type=int, default=0,
                   help="timed rounds per measurement (default 5; 2 with --smoke)")
    p.add_argument("--budget", type=float, default=0.0,
                   help="wall-clock budget in seconds for all suites (0: none; --gpu: 600)")
    p.add_argument("--out", default="", help="also write the results to this .md or .json file")
    p.add_argument("--xla-option", action="append", default=[], metavar="K=V",
                   help="XLA compile option; throughput then times our step both without and "
                        "with the options (e.g. xla_cpu_experimental_ynn_fusion_type= : "
                        "YNNPACK fusions off)")
    p.add_argument("--models", default="",
                   help="throughput: only the models whose names start with one of these "
                        "comma-separated prefixes (e.g. 'study' for the study's small models)")
    args = p.parse_args(argv)
    problems = []
    args.models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    try:
        args.xla_options = parse_options(args.xla_option, "--xla-option")
    except ValueError as e:
        problems.append(str(e))
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        problems.append(f"unknown suite(s) {unknown}: choose from {', '.join(SUITES)}")
    if args.runs < 0 or (args.runs and args.runs < 2):
        problems.append(f"--runs={args.runs}: give at least 2 (5 or more for reported numbers)")
    if args.budget < 0:
        problems.append(f"--budget={args.budget}: must be >= 0 seconds (0: no budget)")
    if args.out:
        out = pathlib.Path(args.out)
        if out.suffix not in (".md", ".json"):
            problems.append(f"--out={args.out}: the file name must end in .md or .json")
        elif not out.parent.is_dir():
            problems.append(f"--out={args.out}: folder {out.parent} does not exist; create it "
                            "first")
    if problems:
        p.error("; ".join(problems))
    args.suites = [s for s in SUITES if s in (args.suites or SUITES)]
    if not args.runs:
        args.runs = 2 if args.smoke else 5
    if args.gpu and not args.budget and not args.smoke:
        args.budget = 600.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import jax
    if args.gpu and not args.smoke and jax.default_backend() != "gpu":
        print(f"--gpu needs a GPU, but JAX's backend is {jax.default_backend()!r}: install "
              "jax[cuda12] and a CUDA torch on a GPU machine, or add --smoke to try the GPU "
              "path at tiny sizes here", file=sys.stderr)
        return 2
    if args.gpu and not args.smoke and not _torch_has_cuda():
        print("--gpu compares with Hugging Face on the same GPU, but torch has no CUDA here: "
              "install a CUDA build of torch (the pinned torch wheel is CPU-only)",
              file=sys.stderr)
        return 2
    from bench import attention, compile_time, pipelines, plots, throughput
    from bench.common import Budget, Scale, environment, load_average

    _set_torch_threads()
    size = "smoke" if args.smoke else ("gpu" if args.gpu else "cpu")
    scale = Scale(size, args.runs, args.budget, "bfloat16" if args.gpu else "float32",
                  args.xla_options, args.models)
    modules = {"throughput": throughput, "attention": attention, "compile": compile_time,
               "pipelines": pipelines}
    command = "python -m bench " + " ".join(argv)
    report = {"command": command, "environment": environment(), "suites": []}
    report["environment"]["malloc"] = ("one arena, no mmap, no trim (bench.host_memory)"
                                       if host_memory.kept() else "default")
    print(_header_markdown(report), flush=True)
    total = Budget(args.budget)
    context: dict = {}
    failed: list[str] = []
    for i, name in enumerate(args.suites):
        remaining = sum(SHARES[s] for s in args.suites[i:])
        share = total.left() * SHARES[name] / remaining if args.budget else 0.0
        entry = {"suite": name, "load_before": load_average()}
        t0 = time.perf_counter()
        try:
            tables = modules[name].run(scale, Budget(max(share, 1e-9) if args.budget else 0.0),
                                       context)
        except Exception as e:   # e.g. out of memory: keep the other suites' results
            traceback.print_exc()
            tables, entry["error"] = [], one_line_error(e)
            failed.append(name)
        entry.update(seconds=time.perf_counter() - t0, load_after=load_average(),
                     tables=[t.as_dict() for t in tables])
        report["suites"].append(entry)
        print(_suite_markdown(entry, tables), flush=True)
        if args.out:
            _write(pathlib.Path(args.out), report)
            try:
                plots.plot_report(report, pathlib.Path(args.out).with_suffix(""))
            except Exception as e:   # e.g. no matplotlib: the tables are what counts
                print(f"plots not drawn: {one_line_error(e)}", file=sys.stderr)
    if failed:
        print(f"suite(s) failed: {', '.join(failed)} (the others' results are complete)",
              file=sys.stderr)
        return 1
    return 0


def _torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _set_torch_threads() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(os.cpu_count() or 1)


def _header_markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"Command: `{report['command']}`", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    return "\n".join(lines)


def _suite_markdown(entry: dict, tables: list) -> str:
    head = (f"## {entry['suite']}\n\nLoad average before / after: {entry['load_before']} / "
            f"{entry['load_after']}; suite wall time {entry['seconds']:.0f} s.\n")
    if entry.get("error"):
        head += f"\n**Failed**: {entry['error']}\n"
    return head + "\n" + "\n".join(t.markdown() for t in tables)


def _write(path: pathlib.Path, report: dict) -> None:
    if path.suffix == ".json":
        path.write_text(json.dumps(report, indent=1, default=str) + "\n")
        return
    from bench.common import Table
    parts = [_header_markdown(report)]
    for entry in report["suites"]:
        parts.append(_suite_markdown(entry, [Table(**t) for t in entry["tables"]]))
    path.write_text("\n".join(parts))


if __name__ == "__main__":
    host_memory.keep_freed_memory()   # both frameworks, before the first computation
    sys.exit(main())
