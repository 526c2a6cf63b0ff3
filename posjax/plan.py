"""Check that a run fits a Cloud TPU slice before renting it: compile train.py's own step for
the slice (ahead of time, on any machine with libtpu) and report what each chip holds.

    python -m posjax.plan --config configs/mlm_bert_a.py --tpu v4-32
    python -m posjax.plan --config configs/vit_imagenet.py:b16 --tpu v5e-16 --max-batch
    python -m posjax.plan --config configs/mlm_deberta.py --tpu v5p-128 --num-slices 2 \\
        --config.mesh.fsdp=8 --json plan.json
    python -m posjax.plan --config configs/study_text.py:paper --tpu v4-32   # a study grid

A study grid config is planned entry by entry (each entry's seed-1 run): fits, per-chip
memory, the estimated step, the days per run, and the whole grid's days on the slice.

It builds the step with ``steps.build_training`` (the function train.py's set-up calls: same
model, optimizer, state shardings and jitted step) on a mesh of the slice's compile-only
devices (``posjax.tpu``), lowers it for the config's global batch and compiles it with the
TPU compiler. It prints per chip: parameters, optimizer state, the batch, temporaries
(activations), their total against the chip's HBM; FLOPs per step; every collective; the
compile time; and a roofline **estimate** of the step time and MFU.

Memory: "total" is arguments + outputs − donated (aliased) + temporaries + code, the bytes
live if every buffer were live at once. The TPU compiler refuses a program whose buffers do
not fit HBM (RESOURCE_EXHAUSTED): a compiled step fits by the compiler's own heap
simulation, which overlaps buffers of disjoint lifetimes and so may need less than "total".
"fits" is the compiler's verdict; a step it refuses is reported with the bytes it asked for.

Exit status: 0 compiled and fits, 3 does not fit, 2 bad input (one ``error:`` line).
"""
from __future__ import annotations

import os

# The plan never runs anything: keep JAX off any accelerator of this machine (a TPU VM's
# chips may be busy with a run) and compile for the named slice only.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402

from posjax import kernels  # noqa: E402
from posjax import tpu as tpu_lib  # noqa: E402
from posjax.training import errors  # noqa: E402
from posjax.training import mesh as mesh_lib  # noqa: E402
from posjax.training import run_config  # noqa: E402
from posjax.training import steps as steps_lib  # noqa: E402
from posjax.training.tasks import make_task  # noqa: E402

EXIT_FITS, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 0, 2, 3
Progress = Callable[[str], None]


class DoesNotFit(Exception):
    """The TPU compiler refused the step: its buffers need more than a chip's HBM."""

    def __init__(self, message: str, needed: int | None, available: int | None):
        super().__init__(message)
        self.needed, self.available = needed, available


def _needed_bytes(message: str) -> tuple[int | None, int | None]:
    """(bytes needed, bytes available) from XLA's RESOURCE_EXHAUSTED text, where it says."""
    units = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}

    def size(num: str, unit: str) -> int:
        return int(float(num) * units[unit[:1].upper()])

    m = re.search(r"Used ([\d.]+)([KMGT]?)i?B? of ([\d.]+)([KMGT]?)i?B?", message)
    if m:
        return size(m[1], m[2]), size(m[3], m[4])
    # "... required for HLO temporaries (42.61G) exceeds available HBM (15.75G)"
    m = re.search(r"\(([\d.]+)([KMGT]?)i?B?\) exceeds available \w+ \(([\d.]+)([KMGT]?)i?B?\)",
                  message)
    return (size(m[1], m[2]), size(m[3], m[4])) if m else (None, None)


def is_study(config: ml_collections.ConfigDict) -> bool:
    """A study grid config (``python -m posjax.study``), planned entry by entry."""
    return "cells" in config and "base" in config


def validate(config: ml_collections.ConfigDict) -> None:
    """What the plan can check without data: the training keys and the model (one ValueError
    naming the field). The data itself (files, tokenizer) is train.py's to check."""
    run_config.validate_training_config(config)
    make_task(config).validate_model()


@dataclasses.dataclass
class Compiled:
    """One compile of the step for a batch: memory per chip, FLOPs, collectives, time."""

    batch_size: int
    compile_s: float
    memory: dict[str, int]
    xla_flops: float
    collectives: list[tpu_lib.Collective]
    kernel_calls: int          # Mosaic (Pallas) kernel calls in the compiled step's HLO


def compile_step(training: steps_lib.Training, batch_size: int, devices: int,
                 progress: Progress) -> Compiled:
    """Lower and compile the step for ``batch_size``; DoesNotFit when the compiler refuses."""
    progress(f"compiling the train step for a global batch of {batch_size} ...")
    start = time.perf_counter()
    lowered = training.lower(batch_size)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        needed, available = _needed_bytes(text)
        progress(f"  does not fit ({time.perf_counter() - start:.1f} s)")
        raise DoesNotFit(text.strip().splitlines()[0][:400], needed, available) from None
    seconds = time.perf_counter() - start
    progress(f"  compiled in {seconds:.1f} s")
    stats = compiled.memory_analysis()
    memory = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in
              ("argument", "output", "alias", "temp", "generated_code")}
    memory["total"] = (memory["argument"] + memory["output"] - memory["alias"]
                       + memory["temp"] + memory["generated_code"])
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    return Compiled(batch_size, seconds, memory, float((cost or {}).get("flops", 0.0)),
                    tpu_lib.collectives(hlo, devices),
                    hlo.count('custom_call_target="tpu_custom_call"'))


def largest_batch(training: steps_lib.Training, start: Compiled | None, start_batch: int,
                  unit: int, hbm: int, devices: int, progress: Progress,
                  tolerance: float = 0.0, max_compiles: int = 16, limit: int = 1 << 22
                  ) -> tuple[int, int | None]:
    """(largest fitting global batch found, smallest refused one or None), in multiples of
    ``unit``. Each try is where a straight line through the last two fitting compiles (bytes
    against batch) reaches ``hbm``, kept inside the bracket [largest fitting, smallest
    refused]; otherwise the bracket is halved. Stops when the two differ by one unit (or by
    ``tolerance`` × the fitting one) or after ``max_compiles`` compiles."""
    lo, hi = 0, None
    points: list[tuple[int, int]] = []
    if start is not None:
        lo = max(unit, start_batch // unit * unit)
        points.append((lo, start.memory["total"]))
    b = max(unit, start_batch // unit * unit) if start is None else None
    for _ in range(max_compiles):
        if hi is not None and hi - lo <= max(unit, tolerance * lo):
            break
        if b is None:
            b = _next_try(points, lo, hi, unit, hbm, limit)
        if b is None:
            break
        try:
            compiled = compile_step(training, b, devices, progress)
            lo = b
            points.append((b, compiled.memory["total"]))
        except DoesNotFit:
            hi = b
        b = None
    return lo, hi


def _next_try(points: list[tuple[int, int]], lo: int, hi: int | None, unit: int, hbm: int,
              limit: int) -> int | None:
    """The next batch to compile (see ``largest_batch``), None when none is left."""
    if not lo:   # nothing fits yet: halve the refused batch
        b = hi // 2 // unit * unit
        return b if b >= unit else None
    (b0, m0), (b1, m1) = (points[-2] if len(points) > 1 else (0, 0)), points[-1]
    slope = (m1 - m0) / (b1 - b0) if b1 != b0 else 0
    guess = b1 + (hbm - m1) / slope if slope > 0 else 2 * b1
    trusted = b1 - b0 > unit   # the line was just proven wrong by one unit: do not crawl
    if trusted and guess < lo + unit:   # the line says lo is the limit: check one more unit
        b = lo + unit
    elif hi is None:           # at most 4x the largest fitting batch per try
        b = int(min(max(guess if trusted else 0, 2 * lo), 4 * lo, limit)) // unit * unit
    elif trusted and lo < guess < hi:   # inside the middle half of the bracket
        quarter = (hi - lo) / 4
        b = int(min(max(guess, lo + quarter), hi - quarter)) // unit * unit
    else:                      # the line is off (XLA's memory is not linear here): bisect
        b = (lo + hi) // 2 // unit * unit
    if hi is not None and (b <= lo or b >= hi):
        b = (lo + hi) // 2 // unit * unit
    return b if lo < b <= limit and (hi is None or b < hi) else None


def _chip_time(compiled: Compiled, chip: tpu_lib.Chip, model_flops_per_chip: float
               ) -> dict[str, float]:
    """Roofline estimate of one step on one chip (seconds): compute at the chip's peak bf16
    rate, collectives at its ring bandwidth; the step takes at least the larger of the two
    (full overlap) and at most their sum (none). HBM traffic is not modelled."""
    compute = model_flops_per_chip / chip.peak_bf16
    comm = sum(c.moved_bytes() * c.times for c in compiled.collectives) / chip.collective_bw
    best, worst = max(compute, comm), compute + comm
    return {"compute_s": compute, "collectives_s": comm, "step_s_overlapped": best,
            "step_s_serial": worst, "mfu_overlapped": compute / best if best else 0.0,
            "mfu_serial": compute / worst if worst else 0.0}


def plan(config: ml_collections.ConfigDict, tpu_name: str, num_slices: int = 1,
         max_batch: bool = False, progress: Progress = print,
         max_batch_tolerance: float = 0.0, max_batch_compiles: int = 16) -> dict[str, Any]:
    """Compile the run's step for the slice and return the report (``format_report``). The
    models are built for TPU (``kernels.compiling_for``): ``attention_impl='auto'`` plans the
    Pallas kernel where the slice would run it."""
    with kernels.compiling_for("tpu"):
        return _plan(config, tpu_name, num_slices, max_batch, progress, max_batch_tolerance,
                     max_batch_compiles)


def _plan(config: ml_collections.ConfigDict, tpu_name: str, num_slices: int, max_batch: bool,
          progress: Progress, max_batch_tolerance: float, max_batch_compiles: int
          ) -> dict[str, Any]:
    validate(config)
    tpu = tpu_lib.parse_slice(tpu_name)
    if not (isinstance(num_slices, int) and num_slices >= 1):
        raise ValueError(f"--num-slices={num_slices!r} is not valid: give 1 or more slices")
    progress(f"{tpu_name}: {num_slices} x {tpu.topology} ({tpu.chips * num_slices} chips "
             f"of TPU {tpu.chip.name}, {tpu.chip.hbm_bytes / 2 ** 30:.4g} GiB HBM each)")
    devices = tpu_lib.slice_devices(tpu, num_slices)
    mesh = mesh_lib.build_mesh(config.mesh, devices)
    mesh_lib.validate_batch(config, mesh)
    feeds = mesh_lib.batch_feeds(mesh)
    hosts = len({d.process_index for d in devices})
    progress(f"mesh {dict(mesh.shape)}; {hosts} hosts, {feeds.count} input feeds of "
             f"{config.batch_size // feeds.count} examples")
    training = steps_lib.build_training(config, mesh)
    device0 = mesh.devices.flat[0]
    params = errors.bytes_per_device(training.abstract.params, device0)
    opt_state = errors.bytes_per_device(training.abstract.opt_state, device0)
    chips = len(devices)
    flops = training.task.train_flops().total(config.batch_size)
    report: dict[str, Any] = {
        "tpu": tpu_name, "topology": tpu.topology, "num_slices": num_slices, "chips": chips,
        "hosts": hosts, "chip": dataclasses.asdict(tpu.chip), "mesh": dict(mesh.shape),
        "batch_size": config.batch_size, "microbatches": config.microbatches,
        "num_steps": config.num_steps,
        "per_chip": {"params": params, "opt_state": opt_state},
        "model_flops_per_step": flops, "model_flops_per_chip": flops / chips,
    }
    try:
        compiled = compile_step(training, config.batch_size, chips, progress)
    except DoesNotFit as e:
        report.update(fits=False, error=str(e), needed_bytes=e.needed,
                      available_bytes=e.available)
        compiled = None
    if compiled is not None:
        memory = compiled.memory
        report["fits"] = True
        report["compile_s"] = compiled.compile_s
        report["per_chip"].update(
            batch=errors.bytes_per_device(training.abstract_batch(config.batch_size), device0),
            temporaries=memory["temp"],
            code=memory["generated_code"], total=memory["total"],
            headroom=tpu.chip.hbm_bytes - memory["total"])
        report["memory_analysis"] = memory
        report["xla_flops_per_chip"] = compiled.xla_flops
        report["collectives"] = [dataclasses.asdict(c) for c in compiled.collectives]
        report["pallas_kernel_calls"] = compiled.kernel_calls
        report["estimate"] = _chip_time(compiled, tpu.chip, flops / chips)
        report["estimate"]["days_to_num_steps"] = (
            report["estimate"]["step_s_overlapped"] * config.num_steps / 86400)
    if max_batch:
        unit = mesh_lib.batch_shards(mesh) * config.microbatches
        unit = unit * feeds.count // math.gcd(unit, feeds.count)
        progress(f"searching the largest global batch (multiples of {unit}) ...")
        lo, hi = largest_batch(training, compiled, config.batch_size, unit,
                               tpu.chip.hbm_bytes, chips, progress, max_batch_tolerance,
                               max_batch_compiles)
        report["max_batch"] = {"fits": lo, "refused": hi, "unit": unit}
    return report


def plan_study(study: ml_collections.ConfigDict, tpu_name: str, num_slices: int = 1,
               progress: Progress = print) -> dict[str, Any]:
    """Every entry of a study grid planned on the slice (its seed-1 training config): whether
    it fits, and the estimated time of one of its runs; the grid's runs per entry (the sweep's
    rates plus the later seeds) turn that into the whole grid's chip time."""
    from posjax.study import cells as cells_lib
    from posjax.study.spec import StudyConfigError, check_study, sweep_rates

    try:
        base, cells = check_study(study)
    except StudyConfigError as e:
        raise ValueError(str(e)) from None
    runs_per_entry = len(sweep_rates(study)[0]) + study.seeds - bool(sweep_rates(study)[0])
    entries: dict[str, Any] = {}
    for cell in cells:
        if cell.name in entries or cell.pending:
            continue
        progress(f"[study] planning {cell.name} ({len(entries) + 1} of "
                 f"{len({c.name for c in cells})})")
        report = plan(cells_lib.main_config(base, cell), tpu_name, num_slices,
                      progress=progress)
        days = report.get("estimate", {}).get("days_to_num_steps")
        entries[cell.name] = {"fits": report["fits"], "per_chip_total": report["per_chip"].get(
            "total"), "step_s": report.get("estimate", {}).get("step_s_overlapped"),
            "days_per_run": days, "report": report}
    total = [e["days_per_run"] for e in entries.values() if e["days_per_run"] is not None]
    return {"tpu": tpu_name, "num_slices": num_slices, "entries": entries,
            "runs_per_entry": runs_per_entry,
            "grid_days": runs_per_entry * sum(total) if len(total) == len(entries) else None,
            "fits": all(e["fits"] for e in entries.values())}


def format_study(report: dict[str, Any]) -> str:
    lines = [f"== study grid on {report['tpu']} ({report['num_slices']} slice(s)): "
             f"{len(report['entries'])} entries x {report['runs_per_entry']} runs each",
             f"{'entry':<22} {'fits':<5} {'per chip':>10} {'step (est.)':>12} "
             f"{'days per run (est.)':>20}"]
    for name, e in report["entries"].items():
        step = "-" if e["step_s"] is None else f"{e['step_s'] * 1e3:.1f} ms"
        days = "-" if e["days_per_run"] is None else f"{e['days_per_run']:.2f}"
        lines.append(f"{name:<22} {'yes' if e['fits'] else 'NO':<5} "
                     f"{_size(e['per_chip_total']):>10} {step:>12} {days:>20}")
    if report["grid_days"] is not None:
        lines.append(f"whole grid >= {report['grid_days']:.2f} days of this slice (ESTIMATE: "
                     "roofline step times, one run after another; evaluation not counted)")
    return "\n".join(lines)


def _size(n: float | None) -> str:
    return "?" if n is None else ("-" if n < 0 else "") + errors.byte_size(abs(n))


def collective_rows(collectives: list[dict[str, Any]]) -> list[tuple[str, int, float, bool]]:
    """(kind and dtypes, executions per step, bytes per step, in a loop) grouped."""
    rows: dict[tuple[str, bool], list[float]] = {}
    for c in collectives:
        key = (f"{c['kind']} ({'/'.join(c['dtypes'])}, {c['group']} devices)", c["in_loop"])
        entry = rows.setdefault(key, [0, 0.0])
        entry[0] += c["times"]
        entry[1] += c["bytes"] * c["times"]
    return [(k[0], int(v[0]), v[1], k[1]) for k, v in sorted(rows.items())]


def format_report(report: dict[str, Any]) -> str:
    """The plan as a person reads it."""
    chip = report["chip"]
    lines = [f"== {report['tpu']}: {report['chips']} chips ({report['hosts']} hosts), mesh "
             f"{report['mesh']}, global batch {report['batch_size']}"
             + (f" in {report['microbatches']} microbatches" if report["microbatches"] > 1
                else "")]
    pc = report["per_chip"]
    lines.append("per chip:")
    lines.append(f"  parameters       {_size(pc['params'])}")
    lines.append(f"  optimizer state  {_size(pc['opt_state'])}")
    if report["fits"]:
        lines.append(f"  batch            {_size(pc['batch'])}")
        lines.append(f"  temporaries      {_size(pc['temporaries'])}  (activations, gradients, "
                     "workspace)")
        lines.append(f"  total            {_size(pc['total'])} of {_size(chip['hbm_bytes'])} "
                     f"HBM: headroom {_size(pc['headroom'])}")
        lines.append(f"fits: yes (compiled in {report['compile_s']:.1f} s)")
        if report["pallas_kernel_calls"]:
            lines.append(f"attention: the Pallas kernel ({report['pallas_kernel_calls']} "
                         "calls in the step, run per shard)")
    else:
        lines.append(f"fits: NO: {report['error']}")
        lines.append(f"  the TPU compiler needs {_size(report['needed_bytes'])} of "
                     f"{_size(report['available_bytes'] or chip['hbm_bytes'])} per chip "
                     "(try --config.model.remat=True, --config.microbatches=N, a smaller "
                     "batch_size, or more fsdp)")
    lines.append(f"FLOPs per step: {report['model_flops_per_step']:.4g} (posjax's count; "
                 f"{report['model_flops_per_chip']:.4g} per chip)"
                 + (f"; XLA's cost analysis {report['xla_flops_per_chip']:.4g} per chip "
                    "(counts a scanned layer loop once)" if report["fits"] else ""))
    if report["fits"]:
        lines.append("collectives per step (per chip):")
        for name, times, size, loop in collective_rows(report["collectives"]):
            lines.append(f"  {name:<44} x{times:<4} {_size(size):>10}"
                         f"{'  in the layer loop' if loop else ''}")
        if not report["collectives"]:
            lines.append("  none")
        est = report["estimate"]
        lines.append(
            f"ESTIMATE (roofline, not a measurement): compute {est['compute_s'] * 1e3:.1f} ms "
            f"at {chip['peak_bf16'] / 1e12:.0f} TFLOP/s, collectives "
            f"{est['collectives_s'] * 1e3:.1f} ms at {chip['collective_bw'] / 1e9:.0f} GB/s; "
            f"step {est['step_s_overlapped'] * 1e3:.1f}-{est['step_s_serial'] * 1e3:.1f} ms, "
            f"MFU {est['mfu_serial']:.2f}-{est['mfu_overlapped']:.2f}; {report['num_steps']} "
            "steps >= "
            f"{est['days_to_num_steps']:.2f} days (HBM traffic not modelled; chip numbers: "
            f"{chip['source']})")
    if "max_batch" in report:
        mb = report["max_batch"]
        lines.append(f"largest global batch that fits: {mb['fits']}"
                     + (f" ({mb['refused']} does not)" if mb["refused"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from absl import flags

    from posjax import cli

    argv = list(sys.argv if argv is None else argv)
    flags.DEFINE_string("tpu", None, "Cloud TPU slice: v4-32, v5litepod-16 (v5e-16), "
                        "v5p-128, v6e-64, or a topology such as v4:2x2x4.")
    flags.DEFINE_integer("num_slices", 1, "Slices joined over the data-center network "
                         "(multi-slice); the mesh's data axis spans them.")
    flags.DEFINE_bool("max_batch", False, "Also find the largest global batch that fits.")
    flags.DEFINE_string("json", None, "Write the whole report to this JSON file.")
    try:
        cli.define_config_flag(None, "Training config file[:variant], as train.py's.")
        cli.parse_flags(argv)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return EXIT_BAD_INPUT
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    f = flags.FLAGS
    if f.config is None or not f.tpu:
        print("error: give --config FILE[:variant] and --tpu NAME (e.g. --tpu v4-32)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    progress = lambda line: print(line, file=sys.stderr, flush=True)   # noqa: E731
    try:
        if is_study(f.config):
            report = plan_study(f.config, f.tpu, f.num_slices, progress=progress)
        else:
            report = plan(f.config, f.tpu, f.num_slices, f.max_batch, progress=progress)
    except (ValueError, RuntimeError) as e:   # bad input; libtpu missing
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_study(report) if is_study(f.config) else format_report(report))
    if f.json:
        with open(f.json, "w") as out:
            json.dump(report, out, indent=1)
    return EXIT_FITS if report["fits"] else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
