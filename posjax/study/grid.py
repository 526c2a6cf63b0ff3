"""Run a study's grid: skip finished cells, resume interrupted ones, record failures, print a
progress line, and write ``results/study.json`` (the grid's manifest, so the report lists every
cell, run or not) before anything trains.
"""
from __future__ import annotations

import json
import pathlib
import time
from typing import Any

from posjax.study import cells as cells_lib
from posjax.study.spec import Cell, StudyConfigError, baseline, check_study

MANIFEST = "study.json"


def manifest(study: Any, cells: list[Cell]) -> dict[str, Any]:
    return {"kind": study.kind, "title": study.get("title", ""), "baseline": baseline(study),
            "seeds": study.seeds, "claims": [dict(c) for c in study.get("claims", [])],
            "entries": [{"name": e["name"], "scheme": e["scheme"],
                         "model": dict(e.get("model", {})), "train": dict(e.get("train", {}))}
                        for e in study.cells],
            "cells": [{"cell": c.id, "name": c.name, "seed": c.seed, "scheme": c.scheme,
                       "pending": c.pending} for c in cells]}


def read_manifest(root: pathlib.Path) -> dict[str, Any]:
    return json.loads((cells_lib.results_dir(root) / MANIFEST).read_text())


def status(root: pathlib.Path, cell: Cell) -> str:
    """'done', 'failed', 'pending', 'running' (a workdir exists, no results) or 'left'."""
    if cell.pending:
        return "pending"
    path = cells_lib.results_file(root, cell.id)
    if path.is_file():
        return "done" if json.loads(path.read_text()).get("status") == "ok" else "failed"
    return "running" if cells_lib.cell_dir(root, cell.id).is_dir() else "left"


def progress_line(root: pathlib.Path, cells: list[Cell], current: str = "") -> str:
    """Cells done/failed/running/left and an ETA from the measured cell times of this grid."""
    states = {c.id: status(root, c) for c in cells}
    if current:
        states[current] = "running"
    counts = {s: sum(v == s for v in states.values()) for s in
              ("done", "failed", "running", "left", "pending")}
    times: dict[str, list[float]] = {}
    steps: list[float] = []
    for c in cells:
        if states[c.id] == "done":
            r = json.loads(cells_lib.results_file(root, c.id).read_text())
            times.setdefault(c.name, []).append(float(r.get("wall_s", 0.0)))
            steps.append(float(r.get("step_time_s", float("nan"))))
    every = [t for ts in times.values() for t in ts]
    if every:
        todo = [c for c in cells if states[c.id] in ("left", "running")]
        eta = sum(sum(times.get(c.name, every)) / len(times.get(c.name, every)) for c in todo)
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) + (f" (~{eta / 3600:.1f} h)"
                                                                   if eta > 3600 else "")
        step = f", median step {sorted(steps)[len(steps) // 2]:.3f}s" if steps else ""
    else:
        eta_text, step = "after the first cell", ""
    return (f"[study] {counts['done']}/{len(cells)} cells done, {counts['failed']} failed, "
            f"{counts['running']} running, {counts['left']} left"
            + (f", {counts['pending']} pending" if counts["pending"] else "")
            + f"; ETA {eta_text}{step}" + (f"; now {current}" if current else ""))


def run_grid(study: Any, root: pathlib.Path, only: str = "", log=print) -> list[dict[str, Any]]:
    """Run every cell not finished yet (or only cell id / entry name ``only``)."""
    base, cells = check_study(study)
    chosen = [c for c in cells if not only or only in (c.id, c.name)]
    if only and not chosen:
        raise StudyConfigError(f"--cell {only!r} is not a cell of this study: use one of "
                         f"{', '.join(c.id for c in cells)} (or an entry name)")
    cells_lib.write_json(cells_lib.results_dir(root) / MANIFEST, manifest(study, cells))
    records = []
    for cell in chosen:
        state = status(root, cell)
        if state == "done":
            continue
        if state == "pending":
            cells_lib.write_json(cells_lib.results_file(root, cell.id),
                                 {"cell": cell.id, "name": cell.name, "seed": cell.seed,
                                  "scheme": cell.scheme, "status": "pending",
                                  "error": cell.pending})
            continue
        log(progress_line(root, cells, cell.id))
        record = cells_lib.run_cell(root, study, base, cell)
        if record["status"] != "ok":
            log(f"[study] cell {cell.id} FAILED: {record['error']}")
        elif record.get("stage_errors"):
            log(f"[study] cell {cell.id}: follow-ups failed: {record['stage_errors']}")
        records.append(record)
    log(progress_line(root, cells))
    return records
