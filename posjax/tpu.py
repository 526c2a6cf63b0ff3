"""Cloud TPU slices without the hardware: chip facts, slice names, compile-only devices, and
what a compiled program tells about itself (memory, collectives).

* ``CHIPS``: published per-chip numbers (peak bf16 FLOP/s, HBM, collective bandwidth), each
  with its source.
* ``parse_slice('v4-32')``: a Cloud TPU name (``v4-32``, ``v5p-128``: TensorCores;
  ``v5litepod-16``, ``v5e-16``, ``v6e-64``: chips) or a raw topology (``v4:2x2x4``) ->
  ``Slice`` (chip, topology, chips).
* ``slice_devices``: the slice's devices from libtpu's topology description
  (``jax.experimental.topologies``): compile-only, each with its ``process_index`` (host),
  ``coords`` and ``slice_index``; ``jit(...).lower(...).compile()`` runs the real TPU compiler
  on them, on any machine with ``libtpu`` installed.
* ``collectives(hlo_text)``: every collective of an optimized HLO module (kind, bytes, group
  size, whether it runs inside a loop and how many times).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip as Google publishes it. ``collective_bw``: bytes/s one chip moves in a
    ring collective (all-reduce bandwidth per pod / chips, or half the bidirectional ICI
    bandwidth per chip; both give the same 200 and 400 GB/s for v5e and v6e)."""

    name: str
    topology_prefix: str      # libtpu's topology name prefix (v4:2x2x4)
    peak_bf16: float          # FLOP/s
    hbm_bytes: int
    hbm_bw: float             # bytes/s
    collective_bw: float      # bytes/s
    dims: int                 # 2D (v5e, v6e) or 3D (v4, v5p) torus
    name_counts_cores: bool   # v4-N and v5p-N count TensorCores (2 per chip)
    source: str


CHIPS: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s; all-reduce
    # bandwidth per pod 1.1 PB/s over 4096 chips = 269 GB/s per chip.
    "v4": Chip("v4", "v4", 275e12, 32 * GIB, 1200e9, 1.1e15 / 4096, 3, True,
               "cloud.google.com/tpu/docs/v4"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s, ICI 400 GB/s
    # bidirectional per chip; all-reduce bandwidth per pod 51.2 TB/s over 256 chips.
    "v5e": Chip("v5e", "v5e", 197e12, 16 * GIB, 819e9, 51.2e12 / 256, 2, False,
                "cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2765 GB/s, ICI 1200 GB/s
    # bidirectional per chip.
    "v5p": Chip("v5p", "v5p", 459e12, 95 * GIB, 2765e9, 1200e9 / 2, 3, True,
                "cloud.google.com/tpu/docs/v5p"),
    # cloud.google.com/tpu/docs/v6e (Trillium): 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s, ICI
    # 800 GB/s bidirectional per chip; all-reduce bandwidth per pod 102.4 TB/s over 256 chips.
    "v6e": Chip("v6e", "v6e", 918e12, 32 * GIB, 1638e9, 102.4e12 / 256, 2, False,
                "cloud.google.com/tpu/docs/v6e"),
}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "trillium": "v6e"}
MAX_CHIPS = {"v4": 4096, "v5e": 256, "v5p": 8960, "v6e": 256}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: ``topology`` as libtpu names it (``v4:2x2x4``)."""

    name: str
    chip: Chip
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def topology(self) -> str:
        return f"{self.chip.topology_prefix}:{'x'.join(map(str, self.shape))}"


def _shape_3d(chips: int) -> tuple[int, ...]:
    """The standard 3D slice shape of ``chips`` (4 -> 2x2x1, 8 -> 2x2x2, 16 -> 2x2x4, 32 ->
    2x4x4, 64 -> 4x4x4, ...): grow by doubling the last dimension below the largest."""
    shape = [2, 2, 1]
    while math.prod(shape) < chips:
        smaller = [i for i in range(3) if shape[i] < max(shape)]
        shape[smaller[-1] if smaller else 2] *= 2
    return tuple(shape)


def _shape_2d(chips: int) -> tuple[int, ...]:
    """The standard 2D slice shape (1 -> 1x1, 4 -> 2x2, 8 -> 2x4, 16 -> 4x4, ... 256 -> 16x16)."""
    a = 1 << (int(math.log2(chips)) // 2)
    return (a, chips // a)


def parse_slice(name: str) -> Slice:
    """A Cloud TPU name or raw topology -> Slice; one ValueError naming the accepted forms."""
    usage = ("give a Cloud TPU name (v4-32, v5p-128: TensorCores; v5litepod-16, v5e-16, "
             "v6e-64: chips) or a topology (v4:2x2x4, v5e:4x4, v5p:4x4x8, v6e:8x8)")
    text = name.strip().lower()
    if m := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+){1,2})", text):
        kind, dims = ALIASES.get(m[1], m[1]), tuple(int(d) for d in m[2].split("x"))
        if kind not in CHIPS or len(dims) != CHIPS[kind].dims or min(dims) < 1:
            raise ValueError(f"--tpu {name!r} is not a known topology: {usage}")
        return Slice(name, CHIPS[kind], dims)
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    kind = ALIASES.get(m[1], m[1]) if m else None
    if kind not in CHIPS:
        raise ValueError(f"--tpu {name!r} is unknown: {usage}")
    chip, count = CHIPS[kind], int(m[2])
    chips = count // 2 if chip.name_counts_cores else count
    smallest = 4 if chip.dims == 3 else 1
    if (count % 2 and chip.name_counts_cores) or chips < smallest or chips & (chips - 1) \
            or chips > MAX_CHIPS[kind]:
        what = "TensorCores (2 per chip)" if chip.name_counts_cores else "chips"
        raise ValueError(f"--tpu {name!r}: {kind} slices count {what} as a power of two from "
                         f"{smallest * (2 if chip.name_counts_cores else 1)} to "
                         f"{MAX_CHIPS[kind] * (2 if chip.name_counts_cores else 1)}: {usage}")
    return Slice(name, chip, _shape_3d(chips) if chip.dims == 3 else _shape_2d(chips))


def slice_devices(tpu: Slice, num_slices: int = 1) -> list[Any]:
    """Compile-only devices of ``num_slices`` copies of ``tpu`` (one device per chip: v4 in
    megacore mode), from libtpu; a RuntimeError saying how to install it when it is absent."""
    import os

    from jax.experimental import topologies

    # libtpu takes a machine-wide lock when it loads; compiling only, it need not (a TPU VM's
    # training run may hold the lock, or other plan processes).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs: dict[str, Any] = {"chip_config_name": "megacore"} if tpu.chip.name == "v4" else {}
    if num_slices > 1:
        kwargs["num_slices"] = num_slices
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=tpu.topology,
                                                 **kwargs).devices)
    except Exception as e:   # noqa: BLE001 -- libtpu missing or a topology it refuses
        text = str(e)
        if "not found" in text.lower() or "no module" in text.lower() or \
                "libtpu" in text.lower() and "topology" not in text.lower():
            raise RuntimeError("compiling for TPU needs libtpu: pip install "
                               "\"jax[tpu]==<your jax version>\" (it installs on any Linux "
                               f"machine; no TPU needed) ({text.splitlines()[0]})") from None
        raise ValueError(f"--tpu {tpu.name!r}: libtpu does not know topology {tpu.topology} "
                         f"({text.splitlines()[0]})") from None


# ------------------------------------------------------------------ collectives of an HLO module

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                    "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: ``bytes`` of its result per device, ``group`` devices
    taking part, ``times`` it runs per step (its loop's trip count, or 1)."""

    kind: str
    name: str
    bytes: int
    group: int
    dtypes: tuple[str, ...]
    in_loop: bool
    times: int

    def moved_bytes(self) -> float:
        """Bytes each device sends per execution in a bandwidth-optimal ring algorithm."""
        n = max(self.group, 1)
        if n == 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2.0 * (n - 1) / n * self.bytes
        if self.kind == "reduce-scatter":       # result is 1/n of the input
            return float(n - 1) * self.bytes
        if self.kind == "collective-permute":
            return float(self.bytes)
        return (n - 1) / n * self.bytes          # all-gather, all-to-all


def _array_bytes(text: str) -> tuple[int, tuple[str, ...]]:
    total, dtypes = 0, []
    for dtype, dims in _ARRAY.findall(text):
        total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        dtypes.append(dtype)
    return total, tuple(sorted(set(dtypes)))


def _group_size(line: str, devices: int) -> int:
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m[1]))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m[2]) if a in sizes)
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=", line):
        return int(m[1].split(",")[-1])
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len([x for x in m[1].split(",") if x])
    if "source_target_pairs" in line:
        return 2
    return devices


def collectives(hlo_text: str, devices: int) -> list[Collective]:
    """Every collective of an optimized HLO module (``compiled.as_text()``). Asynchronous pairs
    (``all-gather-start``/``-done``) count once, at their start, with the gathered result.
    A collective in a computation reached from a while loop's body runs once per iteration:
    the trip count is read from the loop condition's integer constant (1 when there is none)."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if (m := _HEADER.match(line)) and not line.startswith(" "):
            current = m[1]
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    # loop bodies and their trip counts; who calls whom
    trips: dict[str, int] = {}
    callees: dict[str, set[str]] = {name: set() for name in comps}
    for name, lines in comps.items():
        for line in lines:
            for a, b in _CALLS.findall(line):
                callees[name].update([a] if a else re.findall(r"%?([\w.\-]+)", b))
            if " while(" in line and (body := re.search(r"body=%?([\w.\-]+)", line)):
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                consts = [int(c) for c in re.findall(r"s32\[\][^=]*constant\((\d+)\)",
                                                     "\n".join(comps.get(cond[1], [])))] \
                    if cond else []
                trips[body[1]] = max(consts) if consts else 1
    times: dict[str, int] = {}
    looped: set[str] = set()

    def visit(name: str, factor: int, in_loop: bool) -> None:
        if times.get(name, 0) >= factor and (name in looped or not in_loop):
            return
        times[name] = max(factor, times.get(name, 0))
        if in_loop:
            looped.add(name)
        for callee in callees.get(name, ()):
            visit(callee, factor * trips.get(callee, 1), in_loop or callee in trips)

    entry = next((n for n in comps if re.search(rf"^ENTRY\s+%?{re.escape(n)}\b", hlo_text,
                                                 re.M)), None)
    if entry:
        visit(entry, 1, False)
    found = []
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            opcode = m[3]
            kind = next((k for k in COLLECTIVE_KINDS
                         if opcode in (k, f"{k}-start")), None)
            if kind is None:
                continue
            result = m[2]
            if opcode.endswith("-start") and kind in ("all-gather", "collective-permute") \
                    and result.startswith("("):
                # (operand, result[, contexts]): the gathered / received part
                parts = re.findall(r"\w+\[[\d,]*\]", result)
                result = parts[1] if len(parts) > 1 else result
            size, dtypes = _array_bytes(result)
            n = times.get(name, 1)
            found.append(Collective(kind, m[1], size, _group_size(line, devices), dtypes,
                                    name in looped, n))
    return found
