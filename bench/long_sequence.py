"""Long sequences, whole model (issue #35): forward + backward time and peak memory of a text
encoder per position scheme at L = 512 … 16k, plain attention vs the blocked path, and
Hugging Face's DebertaV2Model at the same lengths.

    python -m bench.long_sequence --out bench/results/long_sequence_cpu   # .json and .md
    python -m bench.long_sequence --smoke                                 # tiny, seconds

Model: embeddings + encoder (``posjax.models.text.TextEncoder``), batch 1, hidden 768, 12
heads, MLP 3072, **2 layers**, DeBERTa-v3-base's vocabulary (128,100 rows) for every scheme,
fp32, dropout off. Schemes: bert_abs, bert_rel, tupe_r (each given a position table of L rows,
``max_position_embeddings = L``), deberta_v2 (v3: 256 log buckets, max_relative_positions 512,
shared key, LayerNorm'd table, no absolute input), rope, alibi. Paths: ``plain`` (the L × L
logits materialised, ``blocked_attention_from = 0``) and ``blocked`` (``posjax.layers.blocked``
from the first token on, blocks of 512). One step = ``jax.grad`` of mean(sin(h)) over the last
hidden states h (B, L, H) with respect to every parameter. HF: ``transformers.DebertaV2Model``
of the same config (random init, torch fp32, eager attention, the same loss, ``backward()``).

Every measurement runs in its own subprocess, one at a time, under an address-space cap
(``RLIMIT_AS``, ``--cap-gib``, default 16). Ours: the child compiles the step and reads XLA's
``memory_analysis()`` (arguments + outputs + scratch); when that, added to what the process
already maps, exceeds the cap the step is not run ("does not fit (XLA)"). Otherwise it runs:
``--runs`` timed steps after one warm-up below ``--one-step-from`` tokens, one timed step (no
warm-up) from there. A step whose time, extrapolated ∝ L² from the last timed length of the
same model and path, exceeds ``--max-step-s`` is compiled for its memory but not run; beyond a
length that did not fit, longer ones of the same model and path are not tried (memory only
grows with L; this also spares compiling a 16k plain step, which alone takes ~13 GiB). Peak
memory is the child's peak RSS (``ru_maxrss``; it includes compiling). A child that dies or
raises an allocation error under the cap is reported as "did not fit". Children use glibc's
default malloc (freed memory is returned to the system). ``--deep`` adds
compile-only rows at 12 layers (unrolled, and one ``lax.scan`` with remat per layer) for the
memory a DeBERTa-v3-base-depth model would need.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
if __package__ in (None, ""):   # `python bench/long_sequence.py`
    sys.path.insert(0, str(ROOT))

SCHEMES = ("bert_abs", "bert_rel", "tupe_r", "deberta_v2", "rope", "alibi")
HF = "hf_deberta_v2"
NOT_TRIED = "not tried"   # a shorter length of the same model and path did not fit
PATHS = ("plain", "blocked")
ORDER = {m: i for i, m in enumerate(SCHEMES + (HF,))}   # row order of an updated report
GIB = 2 ** 30
FULL = dict(hidden=768, heads=12, mlp=3072, layers=2, vocab=128100, block=512,
            lengths=(512, 1024, 2048, 4096, 8192, 16384))
SMOKE = dict(hidden=32, heads=4, mlp=64, layers=2, vocab=512, block=32, lengths=(64, 128))
# Words in stderr of a child that ran out of its address space (XLA, torch, Python, C++).
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "MemoryError",
                 "bad_alloc", "can't allocate memory", "Cannot allocate memory",
                 "failed to map segment")


# ---------------------------------------------------------------------------------------------
# The child: one measurement
# ---------------------------------------------------------------------------------------------

def model_config(spec: dict[str, Any]):
    """The ``TextConfig`` of a measurement ``spec`` (scheme, path, length, size, layers,
    remat, scan)."""
    from bench.workloads import text_config
    from posjax.models.schemes import SCHEMES
    s, scheme = spec["size"], spec["scheme"]
    name = scheme if scheme != HF else "deberta_v2"
    smoke = spec["smoke"]
    kw = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_heads=s["heads"],
              mlp_dim=s["mlp"], num_layers=spec["layers"], dropout_rate=0.0,
              attention_dropout_rate=0.0, remat=spec.get("remat", False),
              scan_layers=spec.get("scan", False), attention_block_size=s["block"],
              blocked_attention_from=1 if spec["path"] == "blocked" else 0)
    if SCHEMES[name].learned_input or SCHEMES[name].untied:   # an absolute table: L rows
        kw["max_position_embeddings"] = spec["length"]
    return text_config(name, "smoke" if smoke else "cpu", **kw)


def _vm_bytes() -> int:
    """Address space the process maps now (VmSize: what RLIMIT_AS caps)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def xla_bytes(compiled: Any) -> dict[str, int]:
    """XLA's buffer sizes of a compiled step: argument, output, alias, temp and their
    ``total`` (arguments + outputs − aliased + scratch)."""
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in
           ("argument", "output", "alias", "temp", "generated_code")}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def fits(xla: dict[str, int], mapped_now: int, cap: int) -> bool:
    """Whether the step's new buffers (outputs and scratch; the arguments exist already) fit
    beside the ``mapped_now`` bytes under an address-space cap of ``cap`` bytes."""
    return mapped_now + xla["output"] - xla["alias"] + xla["temp"] <= cap


def _timed_steps(step, runs: int, warmup: bool) -> list[float]:
    if warmup:
        step()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def measure_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile (and unless ``spec['runs']`` is 0, or the step does not fit ``spec['cap']``,
    run) one forward + backward of our encoder -> result dict."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from posjax.models.text import TextEncoder

    cfg = model_config(spec)
    model = TextEncoder(cfg)
    length = spec["length"]
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (1, length), np.int32))
    mask = jnp.ones((1, length), jnp.int32)
    params = jax.jit(lambda k: nn.meta.unbox(model.init(k, ids[:, :8], mask[:, :8])["params"]))(
        jax.random.key(0))

    def loss(p, ids, mask):
        h = model.apply({"params": p}, ids, mask)
        return jnp.mean(jnp.sin(h.astype(jnp.float32)))

    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss)).lower(params, ids, mask).compile()
    result: dict[str, Any] = {"compile_s": time.perf_counter() - t0, "xla": xla_bytes(compiled),
                              "params": int(sum(np.prod(p.shape) for p in
                                                jax.tree.leaves(params)))}
    if not fits(result["xla"], _vm_bytes(), spec["cap"]):
        return {**result, "status": "does not fit (XLA)", "peak_rss": peak_rss_bytes()}
    if not spec["runs"]:
        return {**result, "status": "not run", "peak_rss": peak_rss_bytes()}
    result["rss_before_run"] = peak_rss_bytes()
    times = _timed_steps(lambda: jax.block_until_ready(compiled(params, ids, mask)),
                         spec["runs"], spec["warmup"])
    return {**result, "status": "ok", "times": times, "peak_rss": peak_rss_bytes()}


def measure_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """One forward + backward of transformers' DebertaV2Model of the same config (random
    init, fp32, eager, dropout off) -> result dict."""
    import numpy as np
    import torch
    import transformers

    from bench.workloads import hf_deberta_v2_config

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    cfg = model_config(spec)
    model = transformers.DebertaV2Model(hf_deberta_v2_config(cfg)).train()
    length = spec["length"]
    ids = torch.from_numpy(np.random.default_rng(0).integers(
        1, cfg.vocab_size, (1, length)).astype(np.int64))
    mask = torch.ones_like(ids)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.sin(h).mean().backward()

    result: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()),
                              "attn_implementation": getattr(model.config,
                                                             "_attn_implementation", "eager")}
    if not spec["runs"]:
        return {**result, "status": "not run", "peak_rss": peak_rss_bytes()}
    result["rss_before_run"] = peak_rss_bytes()
    times = _timed_steps(step, spec["runs"], spec["warmup"])
    return {**result, "status": "ok", "times": times, "peak_rss": peak_rss_bytes()}


def child_main(spec: dict[str, Any]) -> int:
    """Measure ``spec`` in this process under its address-space cap (set here, before jax or
    torch start any thread); its result is the last stdout line (JSON)."""
    resource.setrlimit(resource.RLIMIT_AS, (int(spec["cap"]), int(spec["cap"])))
    # glibc's default malloc (not host_memory.keep_freed_memory, which the step-time suites
    # use): large blocks are mapped and unmapped, so memory freed after compiling is returned
    # rather than kept in a heap that a later multi-GiB block cannot reuse.
    try:
        result = measure_hf(spec) if spec["scheme"] == HF else measure_ours(spec)
    except Exception as e:   # an allocation failure under the cap is one line, not a crash
        text = f"{type(e).__name__}: {e}"
        status = ("did not fit" if any(w in text for w in OUT_OF_MEMORY) else "failed")
        result = {"status": status, "error": text[:500], "peak_rss": peak_rss_bytes()}
    print(json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: one child per measurement
# ---------------------------------------------------------------------------------------------

def mem_available() -> int:
    """MemAvailable of this machine in bytes (0 where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def safe_cap(cap: int, wait_s: float, margin: int = 2 * GIB, poll_s: float = 10.0) -> int:
    """The address-space cap for the next child: ``cap``, once the machine has ``cap`` +
    ``margin`` bytes available (waiting up to ``wait_s`` for other jobs to free memory);
    else what is available less ``margin``, so that no measurement can push the machine
    into OOM."""
    deadline = time.monotonic() + wait_s
    while True:
        available = mem_available()
        if not available or available >= cap + margin:
            return cap
        if time.monotonic() >= deadline:
            lower = max(available - margin, 0)
            print(f"only {available / GIB:.1f} GiB available: capping this measurement at "
                  f"{lower / GIB:.1f} GiB", file=sys.stderr, flush=True)
            return lower
        time.sleep(poll_s)


def run_child(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run ``spec`` in a subprocess capped at ``spec['cap']`` bytes of address space; its
    result, or a "did not fit" / "failed" / "timed out" result when it died."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.long_sequence", "--child",
                               json.dumps(spec)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "error": f"killed after {timeout_s:.0f} s",
                "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return {**json.loads(lines[-1]), "wall_s": wall}
        except json.JSONDecodeError:
            pass
    err = proc.stderr.strip().splitlines()
    tail = " | ".join(err[-3:])[-500:]
    killed = proc.returncode < 0 and -proc.returncode in (signal.SIGKILL, signal.SIGABRT,
                                                          signal.SIGSEGV)
    oom = killed or any(w in proc.stderr for w in OUT_OF_MEMORY)
    return {"status": "did not fit" if oom else "failed", "returncode": proc.returncode,
            "error": tail, "wall_s": wall}


def predicted_step_s(previous: tuple[int, float] | None, length: int) -> float | None:
    """A step's seconds at ``length`` extrapolated ∝ L² from ``previous`` = (length, s)."""
    if previous is None:
        return None
    return previous[1] * (length / previous[0]) ** 2


def step_ms(result: dict[str, Any]) -> float | None:
    """Median step time in ms of an "ok" result, None otherwise."""
    times = result.get("times")
    if result.get("status") != "ok" or not times:
        return None
    times = sorted(times)
    mid = len(times) // 2
    return 1e3 * (times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2)


def cell_time(result: dict[str, Any] | None) -> str:
    """A table cell for the step time of ``result``."""
    if result is None:
        return "—"
    ms = step_ms(result)
    if ms is not None:
        return f"{ms:,.0f}" + ("" if result.get("warmup", True) else " ¹")
    status = result["status"]
    cap = f"cap {result['cap_gib']:.1f} GiB" if result.get("cap_gib") else ""
    if status == "does not fit (XLA)":
        gib = result["xla"]["total"] / GIB
        return f"does not fit (XLA {gib:,.1f} GiB" + (f", {cap})" if cap else ")")
    if status == NOT_TRIED:
        return f"not tried ({result['shorter']:,} did not fit)"
    if status == "not run":
        return "not run" + (f" (~{result['predicted_s']:,.0f} s)" if result.get("predicted_s")
                            else "")
    return status + (f" ({cap})" if cap else "")


def cell_gib(value: int | None) -> str:
    return "—" if value is None else f"{value / GIB:,.2f}"


def row_label(model: str, layers: int) -> str:
    name = "HF DebertaV2Model (torch)" if model == HF else model
    return f"{name}, {layers} layers"


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: the measurement table, the largest lengths, the 12-layer rows."""
    env, s = report["environment"], report["size"]
    out = [f"Command: `{report['command']}`", "",
           f"CPU: {env['cpu_model']} ({env['cores']} cores), {env['date']}; jax {env['jax']}, "
           f"torch {env.get('torch', '—')}, transformers {env.get('transformers', '—')}; load "
           f"before / after: {report['load_before']} / {report.get('load_after', '…')}; cap "
           f"{report['cap_gib']:g} GiB of address space per measurement; wall time "
           f"{report.get('wall_s', 0) / 60:,.1f} min.", ""]
    for i, u in enumerate(report.get("updates", []), 1):
        out += [f"Rows marked {'†' * i} re-measured by `{u['command']}` ({u['date']}; load "
                f"before / after: {u['load_before']} / {u.get('load_after', '…')}; wall time "
                f"{u.get('wall_s', 0) / 60:,.1f} min).", ""]
    out += [f"Batch 1, hidden {s['hidden']}, {s['heads']} heads, MLP {s['mlp']}, "
            f"{s['layers']} layers, vocabulary {s['vocab']:,}, fp32, dropout off; forward + "
            f"backward (gradient of mean sin(h) w.r.t. every parameter); blocked path: blocks "
            f"of {s['block']}.", "",
            "| model | L | plain ms | blocked ms | plain peak RSS GiB | blocked peak RSS GiB | "
            "plain XLA GiB | blocked XLA GiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    ordered = sorted(report["rows"], key=lambda r: (ORDER.get(r["model"], len(ORDER)),
                                                    r["layers"], bool(r.get("scan")),
                                                    r["length"]))
    for r in ordered:
        if r.get("layers", s["layers"]) == s["layers"]:
            rows.setdefault((r["model"], r["length"]), {})[r["path"]] = r
    for (model, length), paths in rows.items():
        plain, blocked = paths.get("plain"), paths.get("blocked")

        def rss(r):
            return cell_gib(r.get("peak_rss")) if r and r.get("status") == "ok" else "—"

        def xla(r):
            return cell_gib(r["xla"]["total"]) if r and "xla" in r else "—"

        mark = "†" * max(r.get("update", 0) for r in paths.values())
        out.append(f"| {row_label(model, s['layers'])}{' ' + mark if mark else ''} | "
                   f"{length:,} | {cell_time(plain)} | "
                   f"{cell_time(blocked)} | {rss(plain)} | {rss(blocked)} | {xla(plain)} | "
                   f"{xla(blocked)} |")
    out += ["", "¹ one timed step (no warm-up); other times: median of "
            f"{report['runs']} steps after a warm-up (L < {report.get('one_step_from', '—')}). "
            "XLA GiB: memory_analysis() arguments + outputs + scratch of the compiled step. "
            "Peak RSS: the measuring process's ru_maxrss (includes compiling and, for ours, "
            "the arguments). \"does not fit (XLA …)\": compiled, not run, as XLA's estimate "
            "exceeds the cap; \"not run (~N s)\": compiled, not run, as its time "
            "extrapolated ∝ L² exceeds --max-step-s; "
            "\"did not fit\": the process ran out of its capped address space; \"not tried (N "
            "did not fit)\": skipped, as the shorter length N of the same model and path "
            "did not fit.", "",
            "Largest L per model and path: measured (ran under the cap) / XLA's estimate "
            "within the cap (compiled, whether run or not).", "",
            "| model | plain: ran | blocked: ran | plain: XLA fits | blocked: XLA fits |",
            "|---|---:|---:|---:|---:|"]
    for model, best in largest(report).items():
        out.append(f"| {row_label(model, s['layers'])} | " + " | ".join(
            f"{best[k]:,}" if best.get(k) else "—" for k in
            ("plain_ran", "blocked_ran", "plain_xla", "blocked_xla")) + " |")
    deep = [r for r in ordered if r.get("layers", s["layers"]) != s["layers"]]
    if deep:
        out += ["", "Compile-only rows (XLA memory_analysis, not run):", "",
                "| model | L | layers | layer loop | XLA total GiB | arguments GiB | "
                "scratch GiB |", "|---|---:|---:|---|---:|---:|---:|"]
        for r in deep:
            loop = ("lax.scan + remat per layer" if r.get("scan") and r.get("remat")
                    else "unrolled, no remat")
            x = r.get("xla")
            out.append(f"| {r['model']} ({r['path']}) | {r['length']:,} | {r['layers']} | {loop} "
                       f"| {cell_gib(x['total']) if x else r['status']} | "
                       f"{cell_gib(x['argument']) if x else '—'} | "
                       f"{cell_gib(x['temp']) if x else '—'} |")
    return "\n".join(out) + "\n"


def largest(report: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{model: {'plain_ran', 'blocked_ran', 'plain_xla', 'blocked_xla': largest L}} over
    the report's rows at its base depth."""
    cap = report["cap_gib"] * GIB
    best: dict[str, dict[str, int]] = {}
    for r in report["rows"]:
        if r.get("layers", report["size"]["layers"]) != report["size"]["layers"]:
            continue
        b = best.setdefault(r["model"], {})
        if r.get("status") == "ok":
            key = f"{r['path']}_ran"
            b[key] = max(b.get(key, 0), r["length"])
        if "xla" in r and r["xla"]["total"] <= cap:
            key = f"{r['path']}_xla"
            b[key] = max(b.get(key, 0), r["length"])
    return best


def write(report: dict[str, Any], out: str) -> None:
    if out:
        pathlib.Path(out + ".json").write_text(json.dumps(report, indent=1) + "\n")
        pathlib.Path(out + ".md").write_text(markdown(report))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.long_sequence",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, L = 64, 128")
    p.add_argument("--models", nargs="+", choices=SCHEMES + (HF,), default=list(SCHEMES + (HF,)))
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--lengths", type=int, nargs="+", help="override the lengths")
    p.add_argument("--runs", type=int, default=3, help="timed steps after a warm-up")
    p.add_argument("--one-step-from", type=int, default=4096,
                   help="from this length on: one timed step, no warm-up")
    p.add_argument("--max-step-s", type=float, default=600.0,
                   help="steps predicted (∝ L²) to take longer are compiled, not run")
    p.add_argument("--cap-gib", type=float, default=16.0,
                   help="address-space cap per measurement (at most 16)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per measurement")
    p.add_argument("--wait-s", type=float, default=30.0,
                   help="wait this long for cap + 2 GiB of free memory before a measurement; "
                        "then cap it at what is free less 2 GiB")
    p.add_argument("--deep", nargs="*", default=None, metavar="SCHEME:L",
                   help="compile-only rows at 12 layers (default deberta_v2:8192; smoke: "
                        "deberta_v2:128)")
    p.add_argument("--out", default="", help="write OUT.json and OUT.md (after every row)")
    p.add_argument("--update", default="", metavar="OUT",
                   help="re-measure the rows this command names in the report OUT.json (in "
                        "place; OUT.md rewritten, the command recorded)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 < args.cap_gib <= 16:
        p.error(f"--cap-gib={args.cap_gib}: must lie in (0, 16]")
    if args.runs < 1:
        p.error(f"--runs={args.runs}: must be >= 1")
    if args.update and not pathlib.Path(args.update + ".json").is_file():
        p.error(f"--update={args.update}: {args.update}.json does not exist")
    if args.out and not pathlib.Path(args.out).parent.is_dir():
        p.error(f"--out={args.out}: folder {pathlib.Path(args.out).parent} does not exist")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    from bench.common import environment, load_average
    size = dict(SMOKE if args.smoke else FULL)
    if args.lengths:
        size["lengths"] = tuple(args.lengths)
    deep = args.deep if args.deep is not None else (
        ["deberta_v2:128"] if args.smoke else ["deberta_v2:8192"])
    cap = int(args.cap_gib * GIB)
    command = "python -m bench.long_sequence " + " ".join(
        sys.argv[1:] if argv is None else argv)
    report: dict[str, Any] = {"command": command, "environment": environment(), "size": size,
                              "smoke": args.smoke, "runs": args.runs,
                              "one_step_from": args.one_step_from,
                              "cap_gib": args.cap_gib, "load_before": load_average(),
                              "rows": []}
    update: dict[str, Any] | None = None
    if args.update:   # re-measure rows of an earlier report, in place
        report = json.loads(pathlib.Path(args.update + ".json").read_text())
        update = {"command": command, "date": environment()["date"],
                  "load_before": load_average()}
        report.setdefault("updates", []).append(update)
        size = report["size"] if not args.lengths else {**report["size"], "lengths":
                                                        tuple(args.lengths)}
        args.out, args.smoke = args.update, report.get("smoke", args.smoke)
    t_start = time.perf_counter()

    def add_row(row: dict[str, Any]) -> None:
        """Append ``row`` (with --update: in place of the report's row of the same model,
        path, length and depth) and write the report."""
        if update is not None:
            row["update"] = len(report["updates"])
            report["rows"] = [r for r in report["rows"] if row_key(r) != row_key(row)]
            update["wall_s"] = time.perf_counter() - t_start
        else:
            report["wall_s"] = time.perf_counter() - t_start
        report["rows"].append(row)
        write(report, args.out)

    def measure(model: str, path: str, length: int, runs: int, layers: int | None = None,
                **extra: Any) -> dict[str, Any]:
        spec = dict(scheme=model, path=path, length=length, size=size, smoke=args.smoke,
                    layers=layers or size["layers"], runs=runs,
                    warmup=length < args.one_step_from, cap=cap, **extra)
        spec["cap"] = safe_cap(cap, args.wait_s)
        result = {"model": model, "path": path, "length": length, "layers": spec["layers"],
                  "warmup": spec["warmup"] and runs > 0, **extra,
                  **run_child(spec, args.timeout_s)}
        if spec["cap"] < cap:
            result["cap_gib"] = spec["cap"] / GIB
        add_row(result)
        write(report, args.out)
        print(f"[{(time.perf_counter() - t_start) / 60:5.1f} min] {model} {path} L={length} "
              f"layers={spec['layers']}: {cell_time(result)} (ms), peak RSS "
              f"{cell_gib(result.get('peak_rss'))} GiB, XLA "
              f"{cell_gib(result['xla']['total']) if 'xla' in result else '—'} GiB",
              file=sys.stderr, flush=True)
        return result

    for model in args.models:
        for path in (["plain"] if model == HF else args.paths):
            last: tuple[int, float] | None = None   # (length, s) of the last timed step
            gone: int = 0          # a shorter length that did not fit (memory grows with L)
            for length in size["lengths"]:
                predicted = predicted_step_s(last, length)
                too_slow = predicted is not None and predicted > args.max_step_s
                if gone or (model == HF and too_slow):
                    add_row({"model": model, "path": path, "length": length,
                             "layers": size["layers"], "status": NOT_TRIED if gone else
                             "not run", "shorter": gone, "predicted_s": predicted})
                    continue
                runs = 0 if too_slow else args.runs if length < args.one_step_from else 1
                result = measure(model, path, length, runs)
                if too_slow:
                    result["predicted_s"] = predicted
                if step_ms(result) is not None:
                    last = (length, step_ms(result) / 1e3)
                if result["status"] in ("did not fit", "does not fit (XLA)", "timed out"):
                    gone = length
    for item in deep:
        scheme, _, length = item.partition(":")
        for scan_remat in (False, True):
            measure(scheme, "blocked", int(length), 0, layers=12, scan=scan_remat,
                    remat=scan_remat)
    if update is not None:
        update.update(load_after=load_average(), wall_s=time.perf_counter() - t_start)
    else:
        report["load_after"] = load_average()
        report["wall_s"] = time.perf_counter() - t_start
    write(report, args.out)
    print(markdown(report))
    return 0


def row_key(row: dict[str, Any]) -> tuple:
    """What a row measures: model, path, length, depth, layer loop."""
    return (row["model"], row["path"], row["length"], row["layers"], bool(row.get("scan")))


if __name__ == "__main__":
    sys.exit(main())
