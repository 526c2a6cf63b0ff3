"""What each entry of a study costs, measured side by side in one process (the papers: TUPE
≈ free, DeBERTa ≈ +30 % per step).

Every entry's own train step (its seed-1 config: forward, backward and the optimizer update as
train.py runs them) is compiled; then in each of ``rounds`` rounds every entry runs ``steps``
timed steps, back to back, in an order rotated from round to round. An entry's time ratio is the
median over rounds of (entry time / baseline time) *in the same round*, so load that changes
between rounds cancels; its range over rounds is kept. Step times measured inside the cells
themselves are not comparable: cells run hours apart, under other load.

Memory: XLA's sizes of the same compiled step (temporaries; arguments: the train state and
the batch). The result is ``results/cost.json``.
"""
from __future__ import annotations

import os
import pathlib
import platform
import statistics
from typing import Any, Callable

from posjax.study.spec import baseline as baseline_of
from posjax.study.spec import check_study

COST_FILE = "cost.json"


def cost_file(root: pathlib.Path) -> pathlib.Path:
    """``results/cost.json`` (beside the cells' results; the report reads it without jax)."""
    return pathlib.Path(root) / "results" / COST_FILE


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rotated(names: list[str], round_index: int) -> list[str]:
    """``names`` started at position ``round_index`` (mod len): each entry leads once."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def ratios(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    """Per entry: median seconds per step and the median / min / max over rounds of its
    time divided by the baseline's time of the same round. ``times[name][r]``: seconds per
    step in round r."""
    out = {}
    for name, ts in times.items():
        per_round = [t / b for t, b in zip(ts, times[base])]
        out[name] = {"step_time_s": statistics.median(ts),
                     "time_ratio": statistics.median(per_round),
                     "time_ratio_min": min(per_round), "time_ratio_max": max(per_round)}
    return out


def measure(study: Any, root: pathlib.Path, log: Callable[[str], None] = print
            ) -> dict[str, Any]:
    """Time and memory of every entry that has a cell to run (not pending); writes and returns
    ``results/cost.json``. ``study.cost``: {rounds (default 5), steps (per round, default 3)}."""
    from posjax.study import cells as cells_lib
    from posjax.study import runner

    base, cells = check_study(study)
    baseline = baseline_of(study)
    settings = dict(study.get("cost", {}) or {})
    rounds, steps = int(settings.get("rounds", 5)), int(settings.get("steps", 3))
    if rounds < 1 or steps < 1:
        raise ValueError(f"study.cost rounds={rounds}, steps={steps}: both must be >= 1")
    firsts = {}
    for cell in cells:
        if not cell.pending and cell.name not in firsts:
            firsts[cell.name] = cell
    clocks: dict[str, Any] = {}
    entries: dict[str, dict[str, Any]] = {}
    for i, (name, cell) in enumerate(firsts.items()):
        log(f"[study] cost: compiling {name} ({i + 1}/{len(firsts)})")
        config = cells_lib.main_config(base, cell)
        try:
            clocks[name] = runner.StepClock(config)
            clocks[name].seconds(1)   # warm up
            entries[name] = {"params": clocks[name].params, **clocks[name].memory}
        except Exception as e:   # noqa: BLE001 -- reported per entry, the others go on
            entries[name] = {"error": f"{type(e).__name__}: {e}"}
            clocks.pop(name, None)
    if baseline not in clocks:
        raise ValueError(f"the baseline {baseline!r} could not be measured: "
                         f"{entries.get(baseline, {}).get('error', 'it has no cell to run')}")
    load_before = os.getloadavg()
    names = list(clocks)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in rotated(names, r):
            times[name].append(clocks[name].seconds(steps) / steps)
        log(f"[study] cost: round {r + 1}/{rounds} done")
    base_peak = entries[baseline]["peak_bytes"]
    for name, row in ratios(times, baseline).items():
        entries[name].update(row, seconds_per_round=times[name],
                             memory_ratio=entries[name]["peak_bytes"] / base_peak)
    result = {"baseline": baseline, "rounds": rounds, "steps_per_round": steps,
              "cpu": cpu_name(), "cpus": os.cpu_count(),
              "load_average_before": list(load_before),
              "load_average_after": list(os.getloadavg()), "entries": entries}
    cells_lib.write_json(cost_file(root), result)
    return result
