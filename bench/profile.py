"""``python -m bench profile``: where the time of one training step goes, per kind of op.

    python -m bench profile [--models BERT-A,ViT-S/16] [--frameworks ours,hf] [--steps 3]
                            [--top 10] [--smoke] [--xla-option K=V ...] [--out F.md]

Ours: the compiled step of ``bench.workloads.OursTrainer`` is traced with ``jax.profiler``
over ``--steps`` steps (after two warm-up steps). XLA:CPU records one event per executed thunk,
named after its instruction of the optimized HLO; each instruction is put in a category from
what it computes (the opcodes of its fused computation) and where it comes from (the
``op_name`` metadata JAX writes: the Flax module path, ``jvp``/``transpose`` for forward and
backward, ``threefry`` for random bits; outside ``jvp`` it is the optimizer). Hugging Face: the
same steps of ``HFTrainer`` under ``torch.profiler``; each aten op's self time is put in the
same categories by its name.

Both give each op wall time: torch's ops run one after another (each using the intra-op
threads), and their self times add up to the step; XLA's thunks may be in flight two or
three at a time (one per core, plus XLA's own dots, which finish asynchronously on Eigen's
pool), so each instant is shared equally among the thunks in flight (``thunk_times``): the
categories of one step add up to about its wall time (the table's last row). Each category's
ms is the median over the traced steps (ours: the fastest of a few more, since the trace's
buffers make an occasional traced step page-fault); tracing costs a few per cent of the step.
On our side that split is approximate: an elementwise thunk that runs beside an asynchronous
dot gets half of that time, though most of it is the dot's.

So each model also gets a split that does not depend on it: every distinct matrix product of
our optimized HLO run alone (``dot_signatures``, ``time_products_alone``) against the step's
untraced wall time, and HF's product ops against its own (``products_table``); with torch
installed, the same products run alone by torch too (``time_products_torch``), so the two
libraries are compared on the same work.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import math
import pathlib
import re
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Sequence

from bench.common import Table, format_cell, load_average, median, parse_options, timed

CATEGORIES = (
    "dense matmuls",          # projections, MLP, pooler/head, patch embedding (fwd + bwd)
    "attention matmuls",      # scores q·k, weights·v and their gradients (+ DeBERTa's terms)
    "fused attention",        # torch SDPA kernels (matmuls + softmax in one op)
    "softmax",                # attention softmax and its gradient (with scaling and masking)
    "position terms",         # TUPE/T5 biases, DeBERTa's relative gathers and shifts
    "LayerNorm",
    "GELU",
    "dropout RNG",            # random bits for the dropout masks
    "dropout apply",          # masking and scaling
    "transposes/copies",      # data movement: transposes (and what is fused with them), copies
    "parameter copies",       # XLA's copies of the (donated) parameters
    "embedding gather/scatter",
    "AdamW",                  # the optimizer update (and torch's zero_grad)
    "loss",
    "other elementwise",      # residual adds, biases, scalings, reductions not named above
    "framework overhead",     # torch autograd bookkeeping, XLA control thunks
)


# --------------------------------------------------------------------------- optimized HLO

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass
class Instruction:
    """One HLO instruction: its opcode, result type, op_name and called computations."""

    name: str
    opcode: str
    shape: str
    op_name: str
    calls: list[str]
    kind: str = ""
    operands: list[str] = dataclasses.field(default_factory=list)
    attrs: str = ""
    library: str = ""   # a library fusion's kind in its backend config: "ynn", "onednn", ...


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computations of an optimized HLO module's text -> ({name: instructions}, entry name)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _COMPUTATION.match(line)
            if m:
                current = computations.setdefault(m.group(1), [])
                if line.startswith("ENTRY"):
                    entry = m.group(1)
            elif line.startswith("}"):
                current = None
            continue
        m = _INSTRUCTION.match(line)
        if current is None or not m:
            continue
        name, shape, opcode, rest = m.groups()
        op = _OP_NAME.search(rest)
        kind = re.search(r"kind=(k\w+)", rest)
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        library = re.search(r'"kind":"__(\w+?)_fusion"', rest)
        current.append(Instruction(name, opcode, shape, op.group(1) if op else "",
                                   _CALLS.findall(rest), kind.group(1) if kind else "",
                                   operands, rest.split("metadata=", 1)[0],
                                   library.group(1) if library else ""))
    return computations, entry


def _inner(inst: Instruction, comps: dict[str, list[Instruction]]) -> list[Instruction]:
    """Every instruction ``inst`` runs: itself and, recursively, those of its computations."""
    out, stack, seen = [inst], list(inst.calls), set()
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for sub in comps[name]:
            out.append(sub)
            stack.extend(sub.calls)
    return out


_DATA_MOVEMENT = {"parameter", "constant", "bitcast", "copy", "transpose", "reshape",
                  "broadcast", "concatenate", "slice", "dynamic-slice", "dynamic-update-slice",
                  "pad", "tuple", "get-tuple-element", "iota", "reverse", "convert"}
_ATTENTION_PRODUCT = re.compile(r"bhqk|->bhq|bqhd,bkhd|,chd->|c2p|p2c")
_DENSE_MODULES = {"query", "key", "value", "out", "fc1", "fc2", "pooler", "classifier", "head",
                  "embedding", "dense", "pre_logits", "embed_proj", "query_for_positions",
                  "key_for_positions", "conv", "pos_proj", "pos_q_proj", "attend"}
_POSITION_MODULES = {"tupe_bias", "relative_bias", "rel_norm", "position_embeddings"}
_MODEL_PREFIX = re.compile(r"^.*?(?:transpose\()?jvp\(\w*\)\)?/?")


def _module_path(op_name: str) -> tuple[list[str], str]:
    """(Flax module path, primitive) of an op_name inside the model, e.g.
    'jit(step)/transpose(jvp(ViT))/encoder/layer_0/mlp/mul' -> (['encoder', 'layer_0', 'mlp'],
    'mul'); jit(...) wrappers are dropped."""
    path = _MODEL_PREFIX.sub("", op_name)
    parts = [p for p in path.split("/") if p and not p.startswith("jit(")]
    return (parts[:-1], parts[-1]) if parts else ([], "")


def categorize(inst: Instruction, comps: dict[str, list[Instruction]],
               parameters: frozenset[str] = frozenset()) -> str:
    """The CATEGORIES entry of one instruction of our step: what it computes (the opcodes of
    its fused computation) and where it comes from (JAX's op_name: Flax module path,
    jvp/transpose for forward/backward, threefry for random bits, none of them: optimizer)."""
    ops = _inner(inst, comps)
    opcodes = {i.opcode for i in ops} - {"parameter", "constant"}
    names = [i.op_name for i in ops if i.op_name]
    joined = " ".join(names)
    paths = [n for n in names if n.startswith("jit(")]
    own = inst.op_name or (collections.Counter(paths).most_common(1)[0][0] if paths else "")
    model = "jvp(" in own or (not inst.op_name and "jvp(" in joined)
    if opcodes & {"dot", "convolution"}:
        dots = [i.op_name for i in ops if i.opcode in ("dot", "convolution")]
        dense = any({m.split(".")[-1] for m in _module_path(n)[0][-1:]} & _DENSE_MODULES
                    for n in dots)
        if not dense and any(_ATTENTION_PRODUCT.search(n) for n in dots):
            return "attention matmuls"
        return "dense matmuls"
    if "threefry" in joined or (opcodes & {"xor", "shift-left", "shift-right-logical"}
                                and any(i.shape.startswith("u32") for i in ops)):
        return "dropout RNG"
    if inst.opcode == "copy" and inst.calls == [] and inst.operands[:1] and (
            inst.operands[0] in parameters):
        return "parameter copies"
    if opcodes <= {"tuple", "get-tuple-element", "while", "conditional", "call", "bitcast"}:
        return "framework overhead"
    if not model:
        if "take_along_axis" in joined or "jvp()" in joined:
            return "loss"
        return "AdamW" if names else "transposes/copies"
    modules, primitive = _module_path(own)
    if opcodes & {"gather", "scatter"}:
        if "take_along_axis" in joined:
            return "loss"
        if set(modules) & _POSITION_MODULES or "attention" in modules:
            return "position terms"
        return "embedding gather/scatter"
    if "transpose" in opcodes or primitive == "transpose" or opcodes <= _DATA_MOVEMENT:
        if set(modules) & _POSITION_MODULES or ("attention" in modules and "pad" in opcodes):
            return "position terms"
        return "transposes/copies"
    if set(modules) & _POSITION_MODULES or "rel_embeddings" in joined:
        return "position terms"
    if any(m.endswith("norm") or m.startswith("LayerNorm") for m in modules):
        return "LayerNorm"
    if any(m.startswith("Dropout") or m == "dropout" for m in modules):
        return "dropout apply"
    if modules[-1:] == ["mlp"] or "erf" in opcodes:
        return "GELU"
    if modules[-1:] == ["attention"]:
        return "softmax"
    if "jvp()" in own:
        return "loss"
    return "other elementwise"


def _dims(shape: str) -> list[int]:
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


DotSignature = tuple[str, tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]


def shape_index(comps: dict[str, list[Instruction]]) -> dict[str, str]:
    """{instruction name: result type} over the whole module (names are module-unique)."""
    return {i.name: i.shape for insts in comps.values() for i in insts}


def dot_signatures(inst: Instruction, comps: dict[str, list[Instruction]],
                   shapes: dict[str, str]) -> list[DotSignature]:
    """(dtype, lhs dims, rhs dims, (lhs contracting, rhs contracting, lhs batch, rhs batch))
    of every dot ``inst`` runs (itself or inside its fusion): enough to run the same product
    alone with ``jax.lax.dot_general``. ``shapes``: ``shape_index`` of the module."""
    out = []
    for i in _inner(inst, comps):
        if i.opcode != "dot" or len(i.operands) < 2:
            continue
        dims = tuple(tuple(int(d) for d in m.group(1).split(",") if d) if m else ()
                     for m in (re.search(rf"{k}=\{{([\d,]*)\}}", i.attrs) for k in (
                         "lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims",
                         "rhs_batch_dims")))
        lhs, rhs = (shapes.get(o, "") for o in i.operands[:2])
        out.append((lhs.split("[", 1)[0], tuple(_dims(lhs)), tuple(_dims(rhs)), dims))
    return out


def signature_flops(signature: DotSignature) -> float:
    """2 · multiply-adds of one product: every lhs element meets every rhs element that is
    neither contracted nor a batch dimension."""
    _, lhs, rhs, (_, rc, _, rb) = signature
    return 2.0 * math.prod(lhs) * math.prod(n for d, n in enumerate(rhs) if d not in rc + rb)


def _time_products(signatures: dict[DotSignature, int],
                   runner: Callable[[DotSignature], Callable[[], Any]], repeats: int
                   ) -> tuple[float, float]:
    """(ms, GFLOP): over the distinct products, count × the fastest of ``repeats`` runs of
    ``runner(signature)`` (a call that runs the product once and blocks), after two warm-up
    runs."""
    total_ms = total_gflop = 0.0
    for signature, count in signatures.items():
        run = runner(signature)
        run(), run()
        total_ms += count * min(timed(run) for _ in range(repeats)) * 1e3
        total_gflop += count * signature_flops(signature) / 1e9
    return total_ms, total_gflop


def time_products_alone(signatures: dict[DotSignature, int], repeats: int = 7
                        ) -> tuple[float, float]:
    """(ms, GFLOP) of the given products, each jitted and run alone on random operands:
    the sum over distinct products of count × the fastest of ``repeats`` runs (after two
    warm-up runs). A lower bound on what the same products cost inside the step."""
    import jax
    import numpy as np
    rng = np.random.default_rng(0)
    numpy_dtype = {"f32": "float32", "f64": "float64", "f16": "float16", "bf16": "bfloat16"}

    def runner(signature: DotSignature) -> Callable[[], Any]:
        dtype, lhs, rhs, (lc, rc, lb, rb) = signature
        a, b = (jax.numpy.asarray(rng.standard_normal(shape), dtype=numpy_dtype[dtype])
                for shape in (lhs, rhs))
        product = jax.jit(lambda x, y: jax.lax.dot_general(x, y, ((lc, rc), (lb, rb))))
        return lambda: product(a, b).block_until_ready()

    return _time_products(signatures, runner, repeats)


def canonical_product(signature: DotSignature) -> tuple[int, int, int, int]:
    """(batch, M, K, N) of a product: the batch, lhs-free, contracted and rhs-free sizes, i.e.
    the same product as ``batch`` row-major (M, K)·(K, N) matrix products."""
    _, lhs, rhs, (lc, rc, lb, rb) = signature
    batch, k = math.prod(lhs[d] for d in lb), math.prod(lhs[d] for d in lc)
    m = math.prod(n for d, n in enumerate(lhs) if d not in lc + lb)
    return batch, m, k, math.prod(n for d, n in enumerate(rhs) if d not in rc + rb)


def time_products_torch(signatures: dict[DotSignature, int], repeats: int = 7
                        ) -> tuple[float, float] | None:
    """``time_products_alone`` for torch's kernels: each product as ``torch.matmul`` of
    contiguous (batch, M, K) and (batch, K, N) operands (``canonical_product``), alone, on
    the intra-op threads. The same FLOPs as ours; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch_dtype = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16,
                   "bf16": torch.bfloat16}
    generator = torch.Generator().manual_seed(0)

    def runner(signature: DotSignature) -> Callable[[], Any]:
        batch, m, k, n = canonical_product(signature)
        lead = (batch,) if batch > 1 else ()
        a, b = (torch.randn(lead + shape, generator=generator).to(torch_dtype[signature[0]])
                for shape in ((m, k), (k, n)))
        return lambda: torch.matmul(a, b)

    return _time_products(signatures, runner, repeats)


def matmul_kind(inst: Instruction, comps: dict[str, list[Instruction]]) -> str:
    """'YNNPACK' or 'oneDNN' (a library fusion; oneDNN only with the compile option
    ``xla_cpu_experimental_onednn_fusion_type``), 'XLA dot' (XLA's own dot thunk: Eigen) or
    'convolution'."""
    if any(i.opcode == "convolution" for i in _inner(inst, comps)):
        return "convolution"
    if inst.kind != "kCustom":
        return "XLA dot"
    return "oneDNN" if inst.library == "onednn" else "YNNPACK"


def categorize_module(text: str) -> tuple[dict[str, tuple[str, Instruction]], str]:
    """{instruction name: (category, instruction)} for every instruction of the entry
    computation and of the computations it calls (a thunk event may name either), and the
    module's name."""
    comps, entry = parse_hlo(text)
    module = re.match(r"HloModule ([\w.\-]+)", text)
    parameters = frozenset(i.name for i in comps.get(entry, []) if i.opcode == "parameter")
    out: dict[str, tuple[str, Instruction]] = {}
    for comp_name, insts in comps.items():
        for inst in insts:
            if inst.name not in out:
                out[inst.name] = (categorize(inst, comps, parameters), inst)
    for inst in comps.get(entry, []):   # the entry's own wins over a same-named inner one
        out[inst.name] = (categorize(inst, comps, parameters), inst)
    return out, module.group(1) if module else ""


# --------------------------------------------------------------------------- our trace

def _trace_events(directory: pathlib.Path) -> list[dict[str, Any]]:
    files = sorted(directory.rglob("*.trace.json.gz"))
    if not files:
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {directory}")
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def thunk_times(events: Iterable[dict[str, Any]], module: str
                ) -> tuple[list[dict[str, float]], set[str]]:
    """Per execution (run_id) of ``module``: {hlo_op: µs of wall time} of its top-level
    thunks; and the names of thunks nested in another of the same run on the same thread
    (while loops' bodies), left out so that nothing is counted twice.

    A thunk lasts from its event's start to the end of its ``end: <op>`` event: XLA's own dot
    thunks hand their work to Eigen's pool and return at once, finishing later. Thunks in
    flight at the same time (up to one per core, and the asynchronous dots) share each
    instant of wall time equally, so that a step's ops add up to its busy wall time."""
    runs: dict[str, list[tuple[float, float, Any, str]]] = collections.defaultdict(list)
    ends: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X":
            continue
        if str(e.get("name", "")).startswith("end: "):
            ends[e["name"][5:]].append(float(e["ts"]) + float(e.get("dur", 0.0)))
        elif args.get("hlo_module") == module and "hlo_op" in args:
            runs[args.get("run_id", "")].append((float(e["ts"]), float(e["dur"]), e.get("tid"),
                                                  args["hlo_op"]))
    for times in ends.values():
        times.sort()
    out, nested_names = [], set()
    for run_id in sorted(runs, key=lambda r: min(t for t, *_ in runs[r])):
        spans: list[tuple[float, float, str]] = []
        open_until: dict[Any, float] = {}
        for ts, dur, tid, op in sorted(runs[run_id]):
            if ts < open_until.get(tid, -1.0):
                nested_names.add(op)
                continue
            open_until[tid] = ts + dur
            done = [t for t in ends.get(op, ()) if t >= ts]
            spans.append((ts, max(ts + dur, done[0] if done else ts + dur), op))
        out.append(_share_wall_time(spans))
    return out, nested_names


def _share_wall_time(spans: Sequence[tuple[float, float, str]]) -> dict[str, float]:
    """{op: µs}: every instant of wall time split equally among the spans covering it."""
    points = sorted({t for a, b, _ in spans for t in (a, b)})
    share: dict[str, float] = collections.defaultdict(float)
    starts = sorted(spans)
    active: list[tuple[float, float, str]] = []
    i = 0
    for left, right in zip(points, points[1:]):
        while i < len(starts) and starts[i][0] <= left:
            active.append(starts[i])
            i += 1
        active = [s for s in active if s[1] > left]
        if active:
            for _, _, op in active:
                share[op] += (right - left) / len(active)
    for _, _, op in spans:
        share.setdefault(op, 0.0)
    return dict(share)


@dataclasses.dataclass
class Profile:
    """One framework's profile of one model: category -> ms per step (median over steps),
    the top ops, the traced steps' wall times."""

    framework: str
    model: str
    categories: dict[str, float]
    top: list[tuple[str, str, float, str]]    # (op, category, ms per step, detail)
    wall_ms: list[float]
    note: str = ""
    matmuls: list[list[Any]] = dataclasses.field(default_factory=list)   # see matmul_table
    products_alone: tuple[float, float] | None = None   # ours: (ms, GFLOP), time_products_alone
    attention_alone: tuple[float, float] | None = None  # the same, attention products only
    torch_alone: tuple[float, float] | None = None      # ours' products by torch, alone
    torch_attention_alone: tuple[float, float] | None = None   # its attention products
    untraced_ms: list[float] = dataclasses.field(default_factory=list)   # steps without the tracer

    @property
    def total_ms(self) -> float:
        return sum(self.categories.values())


# Steps traced beyond those kept, the slowest ones dropped: the trace buffers grow the heap, and
# an occasional traced step then page-faults (ViT-S/16 on an idle Xeon: one of three traced
# steps took 233,000 minor faults and 2.3x its time; the first model of another run, two).
_EXTRA_TRACED_STEPS = 2


def profile_ours(workload: Any, steps: int, compiler_options: dict[str, Any] | None = None,
                 top: int = 10) -> Profile:
    """Trace ``steps`` steps of our compiled step (after two warm-up steps): the fastest
    ``steps`` of ``steps + _EXTRA_TRACED_STEPS`` traced ones."""
    import jax
    from bench.workloads import OursTrainer
    trainer = OursTrainer(workload, compiler_options=compiler_options)
    trainer.step(), trainer.step()
    untraced = [timed(trainer.step) * 1e3 for _ in range(max(steps, 5))]
    categories, module = categorize_module(trainer._compiled.as_text())
    with tempfile.TemporaryDirectory(prefix="posjax_profile_") as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        try:
            wall = [timed(trainer.step) * 1e3 for _ in range(steps + _EXTRA_TRACED_STEPS)]
        finally:
            jax.profiler.stop_trace()
        per_run, nested = thunk_times(_trace_events(pathlib.Path(tmp)), module)
    per_run = [r for r in per_run if r][-len(wall):]
    traced = len(wall)
    if len(per_run) == traced:    # the ``steps`` fastest traced steps, in order
        keep = sorted(sorted(range(traced), key=wall.__getitem__)[:steps])
        per_run, wall, kept = [per_run[i] for i in keep], [wall[i] for i in keep], "fastest"
    else:
        per_run, wall, kept = per_run[-steps:], wall[-steps:], "last"
    if not per_run:
        raise RuntimeError(f"the trace holds no thunk of module {module!r}")
    per_step = []
    for run in per_run:
        sums: dict[str, float] = collections.defaultdict(float)
        for op, us in run.items():
            sums[categories.get(op, ("other elementwise", None))[0]] += us / 1e3
        per_step.append(sums)
    cats = {c: median([s.get(c, 0.0) for s in per_step]) for c in CATEGORIES}
    ops = sorted({op for r in per_run for op in r},
                 key=lambda op: -median([r.get(op, 0.0) for r in per_run]))
    rows = []
    for op in ops[:top]:
        cat, inst = categories.get(op, ("other elementwise", None))
        detail = "" if inst is None else f"{inst.shape} {_short_op_name(inst.op_name)}"
        rows.append((op, cat, median([r.get(op, 0.0) for r in per_run]) / 1e3, detail))
    comps, _ = parse_hlo(trainer._compiled.as_text())
    shapes = shape_index(comps)
    groups: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    signatures = {c: collections.Counter() for c in ("dense matmuls", "attention matmuls")}
    for op in {op for r in per_run for op in r}:
        cat, inst = categories.get(op, ("", None))
        if inst is None or cat not in ("dense matmuls", "attention matmuls"):
            continue
        products = dot_signatures(inst, comps, shapes)
        signatures[cat].update(products)
        backward = "transpose(jvp" in inst.op_name or (
            not inst.op_name and "transpose(jvp" in " ".join(i.op_name for i in
                                                           _inner(inst, comps)))
        entry = groups[(cat, matmul_kind(inst, comps), "backward" if backward else "forward")]
        entry[0] += 1
        entry[1] += median([r.get(op, 0.0) for r in per_run]) / 1e3
        entry[2] += sum(map(signature_flops, products)) / 1e9
    matmuls = [[c, k, pss, n, ms, gf, _rate(gf, ms)]
               for (c, k, pss), (n, ms, gf) in sorted(groups.items())]
    note = (f"the {kept} {len(wall)} of {traced} traced steps; "
            f"{len(categories)} HLO instructions, {len(per_run[0])} thunks per step"
            + (f"; {len(nested)} thunks nested in loops left out" if nested else ""))
    dense, attention = (time_products_alone(signatures[c])
                        for c in ("dense matmuls", "attention matmuls"))
    torch_dense, torch_attention = (time_products_torch(signatures[c])
                                    for c in ("dense matmuls", "attention matmuls"))
    return Profile("ours", workload.name, {k: v for k, v in cats.items() if v}, rows, wall,
                   note, matmuls, untraced_ms=untraced, attention_alone=attention,
                   products_alone=(dense[0] + attention[0], dense[1] + attention[1]),
                   torch_attention_alone=torch_attention,
                   torch_alone=None if torch_dense is None or torch_attention is None else (
                       torch_dense[0] + torch_attention[0], torch_dense[1] + torch_attention[1]))


def _short_op_name(op_name: str) -> str:
    """The tail of a JAX op_name that says what the op is (module path and primitive)."""
    text = op_name.replace("jit(step)/", "").replace("TextForSequenceClassification", "")
    text = text.replace("TextForMaskedLM", "")
    parts = [p for p in text.split("/") if p]
    return "/".join(parts[-4:])


# --------------------------------------------------------------------------- Hugging Face

_TORCH_CATEGORIES = (
    (r"_fused_adamw|adamw", "AdamW"),
    (r"scaled_dot_product|flash_attention|_efficient_attention", "fused attention"),
    (r"^aten::(bmm|baddbmm)$", "attention matmuls"),
    (r"^aten::(mm|addmm|matmul|linear|convolution|_convolution|mkldnn_convolution|"
     r"convolution_backward|_slow_conv2d_forward|_slow_conv2d_backward|"
     r"mkldnn_convolution_backward|addmv|mv|dot)$", "dense matmuls"),
    (r"softmax", "softmax"),
    (r"layer_norm", "LayerNorm"),
    (r"gelu", "GELU"),
    (r"bernoulli|uniform_|rand|native_dropout$", "dropout RNG"),
    (r"dropout", "dropout apply"),
    (r"embedding|index_select|index_add|gather|scatter|take|index$", "embedding gather/scatter"),
    (r"cross_entropy|nll_loss|log_softmax", "loss"),
    (r"^aten::(copy_|contiguous|clone|t|transpose|permute|view|reshape|_unsafe_view|expand|"
     r"as_strided|cat|stack|split|chunk|slice|select|unsqueeze|squeeze|flatten|narrow|"
     r"empty|empty_like|empty_strided|resize_|alias|detach|_reshape_alias|unbind|to|_to_copy|"
     r"new_empty|new_empty_strided|zeros|zeros_like|ones|ones_like|full|lift_fresh|"
     r"expand_as|view_as|unflatten|_unsafe_split)$", "transposes/copies"),
    (r"^autograd::|^torch::autograd::|Backward\d*$|^\[|Optimizer|^ProfilerStep|"
     r"^record_param_comms", "framework overhead"),
)


def torch_category(name: str) -> str:
    """The CATEGORIES entry of a torch profiler event name."""
    for pattern, category in _TORCH_CATEGORIES:
        if re.search(pattern, name):
            return category
    return "other elementwise"


# Profiled steps thrown away before those kept: the process's first torch.profiler sessions
# ran the step at half speed (BERT-A on an idle Xeon: 2,345 ms traced against 1,064 untraced,
# every session of the first model profiled; the next model's were not slowed).
_HF_PROFILER_WARMUP = 2


def profile_hf(workload: Any, steps: int, top: int = 10) -> Profile:
    """``torch.profiler`` over ``steps`` steps of the HF counterpart (after two warm-up steps
    and ``_HF_PROFILER_WARMUP`` profiled ones thrown away)."""
    import torch
    from bench.workloads import HFTrainer
    trainer = HFTrainer(workload)
    trainer.step(), trainer.step()
    untraced = [timed(trainer.step) * 1e3 for _ in range(max(steps, 5))]
    per_step: list[dict[str, float]] = []
    per_op_steps: list[dict[str, float]] = []
    op_flops: dict[str, tuple[int, float]] = {}
    wall = []
    for i in range(_HF_PROFILER_WARMUP + steps):   # one profiler per step, as for ours
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    with_flops=True) as prof:
            ms = timed(trainer.step) * 1e3
        if i < _HF_PROFILER_WARMUP:
            continue
        wall.append(ms)
        ops: dict[str, float] = collections.defaultdict(float)
        for avg in prof.key_averages():
            ops[avg.key] += avg.self_cpu_time_total / 1e3
            if avg.flops:
                op_flops[avg.key] = (avg.count, avg.flops / 1e9)
        per_op_steps.append(dict(ops))
        sums: dict[str, float] = collections.defaultdict(float)
        for name, ms in ops.items():
            sums[torch_category(name)] += ms
        per_step.append(sums)
    cats = {c: median([s.get(c, 0.0) for s in per_step]) for c in CATEGORIES}
    names = sorted({n for s in per_op_steps for n in s},
                   key=lambda n: -median([s.get(n, 0.0) for s in per_op_steps]))
    rows = [(n, torch_category(n), median([s.get(n, 0.0) for s in per_op_steps]), "")
            for n in names[:top]]
    note = (f"attention {trainer.attn_implementation}, AdamW {trainer.optimizer_kind}, "
            f"{torch.get_num_threads()} threads")
    matmuls = []
    for name, (count, gflop) in sorted(op_flops.items()):
        if torch_category(name) not in ("dense matmuls", "attention matmuls"):
            continue
        ms = median([s.get(name, 0.0) for s in per_op_steps])
        matmuls.append([torch_category(name), name, "both", count, ms, gflop,
                        _rate(gflop, ms)])
    return Profile("hf", workload.name, {k: v for k, v in cats.items() if v}, rows, wall, note,
                   matmuls, untraced_ms=untraced)


# --------------------------------------------------------------------------- tables

def breakdown_table(model: str, profiles: Sequence[Profile]) -> Table:
    """ms per step and share per category, one column pair per framework."""
    cols = ["category"]
    for p in profiles:
        cols += [f"{p.framework} ms", f"{p.framework} %"]
    if len(profiles) == 2:
        cols.append(f"{profiles[0].framework} − {profiles[1].framework} ms")
    rows = []
    for c in CATEGORIES:
        values = [p.categories.get(c, 0.0) for p in profiles]
        if not any(values):
            continue
        row: list[Any] = [c]
        for p, v in zip(profiles, values):
            row += [v, 100 * v / p.total_ms if p.total_ms else float("nan")]
        if len(profiles) == 2:
            row.append(values[0] - values[1])
        rows.append(row)
    total: list[Any] = ["sum of ops"]
    for p in profiles:
        total += [p.total_ms, 100.0]
    if len(profiles) == 2:
        total.append(profiles[0].total_ms - profiles[1].total_ms)
    rows.append(total)
    wall: list[Any] = ["step wall time (traced)"]
    for p in profiles:
        wall += [median(p.wall_ms), 100 * median(p.wall_ms) / p.total_ms]
    if len(profiles) == 2:
        wall.append(median(profiles[0].wall_ms) - median(profiles[1].wall_ms))
    rows.append(wall)
    notes = [f"{p.framework}: median over {len(p.wall_ms)} traced steps; {p.note}."
             for p in profiles]
    notes.append("ms = wall time of the category's ops per step (ours: each instant shared "
                 "equally among the thunks in flight; HF: torch's self time per op); % = share "
                 "of the sum of ops; the wall-time row's % is wall / sum (above 100: time "
                 "between ops, e.g. dispatch and tracing).")
    return Table(f"Where the step time goes: {model}", cols, rows, notes)


def matmul_table(profiles: Sequence[Profile]) -> Table:
    """Per framework, the matrix products by kind: count, ms and GFLOP per step, GFLOP/s."""
    rows = [[p.framework] + r for p in profiles for r in p.matmuls]
    return Table(f"Matrix products: {profiles[0].model}",
                 ["framework", "category", "kernel", "pass", "ops", "ms per step",
                  "GFLOP per step", "GFLOP/s"], rows,
                 ["ours: kernel = how XLA:CPU runs the product (a YNNPACK or oneDNN library "
                  "fusion, or its own dot thunk), GFLOP counted from the optimized HLO's dot "
                  "shapes (convolutions: not counted); hf: torch.profiler's FLOP count of each "
                  "aten op (forward and backward together)."])


def products_table(profiles: Sequence[Profile]) -> Table:
    """Per framework: the step's wall time, what its matrix products cost, and the rest.

    Ours: the products alone (``time_products_alone``), since inside the step XLA:CPU runs
    them overlapped with other thunks and no per-op time is exact. HF: its product ops' self
    times in the step (they run one after another)."""
    rows = []
    for p in profiles:
        wall = min(p.untraced_ms)
        if p.products_alone is not None:
            (ms, gflop), (att_ms, att_gflop) = p.products_alone, p.attention_alone or (0.0, 0.0)
            how = "each product alone"
        else:
            att_ms = sum(p.categories.get(c, 0.0) for c in ("attention matmuls",
                                                            "fused attention"))
            ms = att_ms + p.categories.get("dense matmuls", 0.0)
            gflop = sum(r[5] for r in p.matmuls)
            att_gflop = sum(r[5] for r in p.matmuls if r[0] == "attention matmuls")
            how = "in the step"
        rows.append([p.framework, how, wall, ms, gflop, _rate(gflop, ms), att_ms,
                     _rate(att_gflop, att_ms), wall - ms, 100 * (wall - ms) / wall])
        if p.torch_alone is not None:
            (ms, gflop), (att_ms, att_gflop) = p.torch_alone, p.torch_attention_alone
            nan = float("nan")
            rows.append(["torch", "our products alone", nan, ms, gflop,
                         _rate(gflop, ms), att_ms, _rate(att_gflop, att_ms), nan, nan])
    notes = ["products = the matrix products only (ours: the distinct dot shapes of the "
             "optimized HLO, each jitted alone on random operands, fastest of 7 runs, times its "
             "count; convolutions not included; HF: aten mm/addmm/bmm and SDPA self times, "
             "GFLOP from torch's counter, SDPA's not counted); attention = the products of "
             "queries with keys and of weights with values (with HF's SDPA, its whole fused "
             "op: softmax included, FLOPs not counted); step wall = the fastest of "
             "the untraced steps timed before tracing (at least 5); rest = wall − products: "
             "everything else, plus what running inside the step costs the products."]
    ours = next((p for p in profiles if p.torch_alone is not None), None)
    if ours is not None:
        notes.append("torch = our products (the same distinct shapes and counts) run alone by "
                     "`torch.matmul` on contiguous (batch, M, K)·(batch, K, N) operands, "
                     "fastest of 7: the two libraries on the same work.")
        notes.append(f"Our products alone: XLA:CPU {format_cell(ours.products_alone[0])} ms, "
                     f"torch {format_cell(ours.torch_alone[0])} ms (XLA:CPU takes "
                     f"{format_cell(ours.products_alone[0] / ours.torch_alone[0])}× torch's "
                     f"time; attention products {format_cell(ours.attention_alone[0])} "
                     f"against {format_cell(ours.torch_attention_alone[0])} ms).")
    if len(profiles) == 2 and profiles[0].products_alone is not None:
        best = min(profiles[1].untraced_ms) / profiles[0].products_alone[0]
        notes.append(f"Were everything but the products free and the products as fast as "
                     f"alone, ours would be {best:.3g}× as fast as {profiles[1].framework} "
                     "(its step wall / our products).")
    return Table(f"Matrix products alone and the rest: {profiles[0].model}",
                 ["framework", "products timed", "fastest step ms (untraced)", "products ms",
                  "products GFLOP", "GFLOP/s", "of which attention ms", "attention GFLOP/s",
                  "rest ms", "rest %"], rows, notes)


def _rate(gflop: float, ms: float) -> float:
    """GFLOP/s, nan where either is unknown (zero)."""
    return gflop / ms * 1e3 if ms and gflop else float("nan")


def top_table(profile: Profile) -> Table:
    return Table(f"Largest ops, {profile.framework}: {profile.model}",
                 ["op", "category", "ms per step", "what"],
                 [list(r) for r in profile.top], [])


# --------------------------------------------------------------------------- entry point

def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench profile",
                                description=__doc__.split("\n")[0])
    p.add_argument("--models", default="BERT-A,TUPE-R,DeBERTa-v3,ViT-S/16",
                   help="comma-separated name prefixes of the throughput workloads")
    p.add_argument("--frameworks", default="ours,hf", help="ours, hf or both")
    p.add_argument("--steps", type=int, default=3, help="traced steps per model (medians)")
    p.add_argument("--top", type=int, default=10, help="largest ops listed per framework")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (tests)")
    p.add_argument("--xla-option", action="append", default=[], metavar="K=V",
                   help="XLA compile option of our step")
    p.add_argument("--out", default="", help="also write the tables to this .md file")
    args = p.parse_args(argv)
    from bench.workloads import all_workloads
    scale = "smoke" if args.smoke else "cpu"
    workloads = all_workloads(scale)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    chosen = [w for w in workloads if any(w.name.startswith(n) for n in names)]
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    problems = []
    unknown = [n for n in names if not any(w.name.startswith(n) for w in workloads)]
    if unknown or not chosen:
        problems.append(f"--models={args.models!r}: unknown {unknown}; choose from "
                        f"{[w.name for w in workloads]}")
    if not frameworks or set(frameworks) - {"ours", "hf"}:
        problems.append(f"--frameworks={args.frameworks!r}: give ours, hf or ours,hf")
    if args.steps < 1:
        problems.append(f"--steps={args.steps}: give at least 1")
    try:
        options = parse_options(args.xla_option, "--xla-option")
    except ValueError as e:
        problems.append(str(e))
        options = None
    if args.out and not pathlib.Path(args.out).parent.is_dir():
        problems.append(f"--out={args.out}: folder {pathlib.Path(args.out).parent} does not "
                        "exist")
    if problems:
        p.error("; ".join(problems))
    if options is None and args.smoke:
        options = {"xla_backend_optimization_level": 0}
    _set_torch_threads()
    command = "python -m bench profile " + " ".join(
        argv if argv is not None else sys.argv[2:] if sys.argv[1:2] == ["profile"]
        else sys.argv[1:])
    load0, t0 = load_average(), time.perf_counter()
    parts = [f"Command: `{command}`\n"]
    print(parts[0], flush=True)
    for w in chosen:
        profiles = []
        if "ours" in frameworks:
            profiles.append(profile_ours(w, args.steps, options, args.top))
        if "hf" in frameworks and w.hf:
            profiles.append(profile_hf(w, args.steps, args.top))
        tables = ([breakdown_table(w.name, profiles), matmul_table(profiles),
                   products_table(profiles)]
                  + [top_table(pr) for pr in profiles])
        text = "\n".join(t.markdown() for t in tables)
        print(text, flush=True)
        parts.append(text)
        print(f"[profile] {w.name} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
    tail = (f"Load average before / after: {load0} / {load_average()}; wall time "
            f"{time.perf_counter() - t0:.0f} s.\n")
    print(tail)
    parts.append(tail)
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(parts))
    return 0


def _set_torch_threads() -> None:
    try:
        import torch
    except ImportError:
        return
    import os
    torch.set_num_threads(os.cpu_count() or 1)
