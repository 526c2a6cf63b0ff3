"""Shared benchmark machinery: result tables, timing, the measured matmul peak, run context.

Every suite returns a list of ``Table``; ``bench.run`` renders them as Markdown (the format of
BENCHMARKS.md) or JSON. Timings are wall-clock seconds of fully finished work
(``block_until_ready`` for JAX; CUDA is synchronised for torch on GPU).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable, Sequence, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from posjax.training.peak_flops import best_rate


@dataclasses.dataclass
class Table:
    """One result table: ``rows`` are lists aligned with ``columns``; ``notes`` follow it."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = dataclasses.field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"### {self.title}", "",
                 "| " + " | ".join(self.columns) + " |",
                 "|" + "|".join("---" for _ in self.columns) + "|"]
        lines += ["| " + " | ".join(format_cell(v) for v in row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def format_cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if v != v:
            return "—"
        a = abs(v)
        if a == 0 or 0.01 <= a < 1e5:
            return f"{v:.3g}" if a < 100 else f"{v:.0f}"
        return f"{v:.2e}"
    return str(v)


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big a run is: ``cpu`` (the CPU tables), ``smoke`` (CI seconds), ``gpu`` (real sizes)."""

    name: str
    runs: int            # timed runs per measurement (medians over these)
    budget_s: float      # wall-clock budget for the whole invocation (0: none)
    dtype: str = "float32"   # compute dtype of the models (bf16 with --gpu)
    xla_options: dict[str, Any] | None = None   # --xla-option: ours is also timed with these
    models: tuple[str, ...] = ()   # --models: throughput times only these (name prefixes)

    @property
    def smoke(self) -> bool:
        return self.name == "smoke"

    @property
    def compiler_options(self) -> dict[str, Any] | None:
        """Smoke runs only check that everything works: compile fast, unoptimised."""
        if self.smoke:
            return {"xla_backend_optimization_level": 0,
                    "xla_llvm_disable_expensive_passes": True}
        return None

    @property
    def gpu(self) -> bool:
        return self.name == "gpu"


class Budget:
    """A wall-clock allowance shared by the suites; ``left()`` in seconds (inf when unlimited)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds if seconds > 0 else float("inf")

    def left(self) -> float:
        return self.deadline - time.monotonic()


def say(suite: str, text: str, stream: TextIO | None = None) -> None:
    """A progress line of ``suite`` on stderr (the tables go to stdout)."""
    print(f"[{suite}] {text}", file=stream or sys.stderr, flush=True)


class Progress:
    """One line on stderr as each unit of a suite's work ends: the unit, done/total, seconds
    since the start and an ETA from the work left. ``weights`` are the units' expected costs
    (e.g. L² per attention length), so the ETA scales with them; the budget may end a suite
    before its last unit.

        [attention] L = 1024 done (4/6), 37 s, ETA 0:02:13
    """

    def __init__(self, suite: str, weights: Sequence[float], stream: TextIO | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.suite, self.weights, self.stream, self.clock = suite, list(weights), stream, clock
        self.done, self.start = 0, clock()

    def tick(self, unit: str) -> None:
        self.done = min(self.done + 1, len(self.weights))
        elapsed = self.clock() - self.start
        spent, left = sum(self.weights[:self.done]), sum(self.weights[self.done:])
        eta = datetime.timedelta(seconds=round(elapsed * left / spent)) if spent > 0 else "?"
        say(self.suite, f"{unit} done ({self.done}/{len(self.weights)}), {elapsed:.0f} s, "
            f"ETA {eta}", self.stream)


def block(x: Any) -> Any:
    """Wait until every array in the pytree ``x`` is computed."""
    return jax.block_until_ready(x)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds taken by ``fn()`` (which must block until its work is done)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def repeats_for(step_s: float, target_s: float = 0.5, cap: int = 20) -> int:
    """How many steps to time together so that one timing lasts about ``target_s`` (small
    models' steps of a few ms are too short to time one by one on a shared machine)."""
    return max(1, min(cap, round(target_s / max(step_s, 1e-9))))


def timed_steps(step: Callable[[], Any], count: int) -> float:
    """Seconds per call of ``step`` (which blocks), timed over ``count`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(count):
        step()
    return (time.perf_counter() - t0) / count


def one_line_error(e: BaseException, limit: int = 500) -> str:
    """'Type: first line of the message' of an exception, for the notes of a report."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:limit]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if len(xs) else float("nan")


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over paired runs of num[i] / den[i] (pairs were measured back to back)."""
    return median([a / b for a, b in zip(num, den)])


def ratio_range(num: Sequence[float], den: Sequence[float]) -> str:
    """'min–max' over paired runs of num[i] / den[i]."""
    ratios = [a / b for a, b in zip(num, den)]
    return f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "—"


def measure_peak_flops(n: int, dtype: str = "float32", reps: int = 5) -> dict[str, float]:
    """Best FLOP/s of an (n × n) @ (n × n) matmul in ``dtype``: jitted JAX and, on CPU, torch.

    Returns {'jax': …, 'torch': …, 'peak': max}; 2n³ FLOPs per product. The best of ``reps``
    is the least disturbed by other processes on a shared machine. On an accelerator each
    trial queues 10 products before waiting, so launch latency does not lower the peak.
    """
    calls = 1 if jax.default_backend() == "cpu" else 10
    flops = 2.0 * n ** 3 * calls
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    mm = jax.jit(lambda x, y: x @ y)
    block(mm(a, a))
    out = {"jax": best_rate(flops, lambda: block([mm(a, a) for _ in range(calls)]), reps)}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and jax.default_backend() == "cpu":
        ta = torch.randn(n, n, dtype=getattr(torch, dtype))
        ta @ ta
        out["torch"] = best_rate(flops, lambda: ta @ ta, reps)
    out["peak"] = max(out.values())
    return out


def parse_options(items: Sequence[str], flag: str) -> dict[str, Any] | None:
    """['key=value', ...] -> {key: value} for XLA compile options (ints, booleans converted;
    an empty value stays '', e.g. ``xla_cpu_experimental_ynn_fusion_type=`` turns YNNPACK
    fusions off)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("xla_"):
            raise ValueError(f"{flag}={item!r} is not xla_KEY=VALUE "
                             "(e.g. xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT)")
        lowered = value.lower()
        out[key] = (lowered == "true" if lowered in ("true", "false")
                    else int(value) if re.fullmatch(r"-?\d+", value) else value)
    return out or None


def load_average() -> str:
    """'1-, 5-, 15-minute load average / cores' of this machine (other jobs slow the timings)."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def environment() -> dict[str, str]:
    """Versions and hardware the numbers belong to."""
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.processor() or platform.machine(),
        **_cpu_description(),
        "cores": str(os.cpu_count()),
        "jax": jax.__version__,
        "backend": f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
        "numpy": np.__version__,
    }
    for mod in ("flax", "optax", "torch", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return info


# Vector extensions that set a CPU's matmul speed, so runs on one "AMD EPYC" can be told
# apart (a Zen 5 multiplies fp32 twice as fast in XLA as an older one: BENCHMARKS.md, run P).
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def _cpu_description(cpuinfo: str | None = None) -> dict[str, str]:
    """{'cpu_model': name, 'cpu_family_model': 'F/M', 'cpu_simd': 'avx2 fma ...'} of the first
    CPU in /proc/cpuinfo (``cpuinfo``: its text); the family and extensions are left out where
    it does not say them."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    info = {"cpu_model": fields.get("model name") or platform.processor() or "unknown"}
    if "cpu family" in fields and "model" in fields:
        info["cpu_family_model"] = f"{fields['cpu family']}/{fields['model']}"
    if "flags" in fields:
        flags = set(fields["flags"].split())
        info["cpu_simd"] = (" ".join(f for f in SIMD_FLAGS if f in flags)
                            or "none of " + " ".join(SIMD_FLAGS))
    return info


def write_between_markers(doc: "os.PathLike[str]", name: str, text: str) -> None:
    """Replace what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in the
    Markdown file ``doc`` with ``text`` (the markers are appended when absent)."""
    import pathlib   # noqa: PLC0415
    path = pathlib.Path(doc)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    head, _, rest = path.read_text().partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
