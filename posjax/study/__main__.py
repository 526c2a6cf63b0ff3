"""python -m posjax.study --config configs/study_text.py[:tiny] --workdir DIR [--cell NAME]
python -m posjax.study --workdir DIR --report
python -m posjax.study --config ... --workdir DIR --cost

DIR is a local folder or ``gs://bucket/path`` (results/ and the report there, the cells'
training in a local folder: posjax/study/bucket.py).

Runs every cell of the study not finished yet (resuming interrupted ones), measures what each
entry costs side by side in this one process (once: ``--cost`` measures again), then writes the
report; ``--cell`` runs one cell (or every seed of one entry), e.g. on another host;
``--report`` only (re)writes the report from ``DIR/results``.
"""
from __future__ import annotations

import argparse
import ast
import os
import pathlib
import sys
from typing import Any


def apply_overrides(study: Any, flags: list[str]) -> None:
    """``--config.a.b=VALUE`` flags onto the study config (VALUE a Python literal, else a
    string): paper scale is overrides, e.g. ``--config.base=configs/mlm_bert_a.py
    --config.base_overrides="()" --config.seeds=5``."""
    from posjax.study.spec import StudyConfigError, set_dotted

    for flag in flags:
        key, _, text = flag[len("--config."):].partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        try:
            set_dotted(study, key, value)
        except KeyError:
            raise StudyConfigError(f"{flag}: the study config has no key {key!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posjax.study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="study config: path.py[:variant]")
    parser.add_argument("--workdir", required=True, help="the study's directory")
    parser.add_argument("--report", action="store_true", help="only (re)write the report")
    parser.add_argument("--cell", default="", help="run only this cell id or entry name")
    parser.add_argument("--cost", action="store_true",
                        help="only measure every entry's step time and memory side by side")
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if not a.startswith("--config.") or "=" not in a]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (study overrides are "
                     "--config.KEY=VALUE)")
    from posjax import storage
    from posjax.study import bucket

    url = args.workdir if storage.is_bucket(args.workdir) else ""
    if "://" in args.workdir and not url:   # pathlib would make a local folder named 'xx:'
        parser.error(f"--workdir {args.workdir}: a local folder or gs://bucket/path")
    pushed: dict[str, str] = {}
    if url:   # results/ and the report on the bucket; the cells train in a local folder
        try:
            storage.check_credentials(url, "--workdir")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        root = bucket.local_folder(url)
        pushed = bucket.pull(url, root)
        print(f"[study] {url}: {len(pushed)} result files pulled; the cells train in {root}")
    else:
        root = pathlib.Path(args.workdir).absolute()

    def upload() -> None:
        if url:
            bucket.push(root, url, pushed)
    if not args.report and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        # Seeds 2.. of a cell run the programs seed 1 compiled: keep them (under cells/).
        import jax
        jax.config.update("jax_compilation_cache_dir", str(root / "cells" / "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from posjax.study import report
    from posjax.study.spec import StudyConfigError, load_config_file

    if args.report:
        if not (root / "results" / "study.json").is_file():
            print(f"error: {root / 'results' / 'study.json'} is missing: run the study first",
                  file=sys.stderr)
            return 2
        report.build(root)
        upload()
        print(f"[study] report written to {url or root}/report.md")
        return 0
    if not args.config:
        parser.error("--config is required unless --report")
    from posjax.study import cost
    from posjax.study.grid import run_grid
    try:
        study = load_config_file(args.config)
        apply_overrides(study, extra)
        if not args.cost:
            run_grid(study, root, args.cell, after_cell=upload)
        if args.cost or not (args.cell or cost.cost_file(root).is_file()):
            cost.measure(study, root)
            upload()
    except StudyConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:   # SIGTERM / Ctrl-C: the running cell saved a checkpoint
        print(f"[study] stopped ({e}); rerun the same command to resume", file=sys.stderr)
        return 130
    report.build(root)
    upload()
    print(f"[study] report written to {url or root}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
