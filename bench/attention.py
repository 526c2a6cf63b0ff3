"""Suite ``attention``: DeBERTa disentangled attention vs sequence length.

One ``DisentangledAttention`` layer in the DeBERTa-v3 setting (log buckets, k = 256 so the
relative table has R = 512 rows, shared attention key), batch 1, forward + backward (gradients
of Σ out·g with respect to the parameters, the input and the table). Compared:

* ours with each gather strategy (``TextConfig.gather``): ``take`` (take_along_axis),
  ``onehot`` (einsum with an (L, L, R) one-hot), ``shift`` (the relative shift of the 2L − 1
  distance rows' product where 2L − 1 <= R, ``take`` beyond), ``skew`` (the relative shift at
  every length: no L × L gather, more FLOPs beyond 2L − 1 = R);
* ``naive``: the paper's equation written directly, materialising K_r[δ(i,j)] and Q_r[δ(i,j)]
  as (L, L, h, d) tensors.

Memory is XLA's own account of the compiled function (``memory_analysis().temp_size_in_bytes``:
scratch beyond arguments and outputs), so even lengths that do not fit in RAM are measured.
Lengths whose scratch exceeds the timing cap are compiled but not run.
"""
from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (Budget, Progress, Scale, Table, block, median, median_ratio,
                          timed)
from posjax.layers.attention import attention_weights
from posjax.layers.disentangled import DisentangledAttention

STRATEGIES = ("take", "onehot", "shift", "skew")
RUNS = 3           # timed runs per length and variant (each is one fwd + bwd call)
TIME_TITLE = "Disentangled attention: forward + backward time (ms), batch 1"
MEMORY_TITLE = "Disentangled attention: XLA scratch memory (MiB) vs length"
VARIANTS = STRATEGIES + ("naive",)


def settings(scale: Scale) -> dict:
    """Shapes, lengths and the scratch-memory cap above which a variant is not timed."""
    if scale.smoke:
        return dict(hidden=32, heads=4, buckets=8, max_position=32, lengths=(16,),
                    time_cap=2 ** 28, dtype=scale.dtype)
    return dict(hidden=768, heads=12, buckets=256, max_position=512,
                lengths=(128, 256, 512, 1024, 2048, 4096),
                time_cap=_gpu_time_cap() if scale.gpu else 2 * 2 ** 30, dtype=scale.dtype)


def _gpu_time_cap() -> float:
    """Half of the device memory JAX may use (the rest: arguments, outputs, torch's cache)."""
    stats = jax.devices()[0].memory_stats() or {}
    return 0.5 * stats["bytes_limit"] if "bytes_limit" in stats else 40 * 2 ** 30


def make_layer(s: dict, gather: str) -> DisentangledAttention:
    return DisentangledAttention(
        num_heads=s["heads"], head_dim=s["hidden"] // s["heads"], pos_att_type=("c2p", "p2c"),
        span=s["buckets"], max_relative_positions=s["max_position"],
        position_buckets=s["buckets"], share_att_key=True, gather=gather,
        dtype=jnp.dtype(s["dtype"]))


def naive_attention(params: dict, x: jax.Array, rel_table: jax.Array, mask: jax.Array,
                    index: np.ndarray, scale: float) -> jax.Array:
    """The paper's disentangled attention with per-pair relative vectors materialised.

    logits[b,h,i,j] = (q_i·k_j + q_i·K_r[δ(i,j)] + k_j·Q_r[δ(i,j)]) · scale, shared key
    projection (v2 ``share_att_key``): K_r = table W_K + b_K, Q_r = table W_Q + b_Q.
    x: (B, L, H); rel_table: (R, H); index: (L, L) -> (B, L, H).
    """
    def project(p, t):
        return jnp.einsum("...e,ehd->...hd", t, p["kernel"]) + p["bias"]

    q, k, v = (project(params[n], x) for n in ("query", "key", "value"))
    key_pairs = project(params["key"], rel_table)[index]        # (L, L, h, d)
    query_pairs = project(params["query"], rel_table)[index]    # (L, L, h, d)
    logits = (jnp.einsum("bqhd,bkhd->bhqk", q, k)
              + jnp.einsum("bqhd,qkhd->bhqk", q, key_pairs)
              + jnp.einsum("bkhd,qkhd->bhqk", k, query_pairs)) * scale
    weights = attention_weights(logits, mask)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return jnp.einsum("bqhd,hde->bqe", out, params["out"]["kernel"]) + params["out"]["bias"]


def _inputs(s: dict, length: int):
    kx, kt, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (1, length, s["hidden"]), jnp.float32)
    table = jax.random.normal(kt, (2 * s["buckets"], s["hidden"]), jnp.float32)
    cotangent = jax.random.normal(kg, (1, length, s["hidden"]), jnp.float32)
    mask = jnp.ones((1, 1, length, length), bool)
    return x, table, cotangent, mask


def _forward(s: dict, variant: str, length: int) -> Callable:
    """(params, x, table, mask) -> out for one variant."""
    if variant == "naive":
        layer = make_layer(s, "take")
        index = layer.relative_index(length, length, None)[0]
        scale = (s["hidden"] // s["heads"] * 3) ** -0.5
        dtype = jnp.dtype(s["dtype"])      # compute in the dtype ours runs in (bf16 on GPU)

        def naive(p, x, t, m):
            p, x, t = jax.tree.map(lambda a: a.astype(dtype), (p, x, t))
            return naive_attention(p, x, t, m, index, scale)
        return naive
    layer = make_layer(s, variant)
    return lambda p, x, t, m: layer.apply({"params": p}, x, x, rel_table=t, mask=m)


def _train_fn(forward: Callable) -> Callable:
    """Forward + backward: gradients of Σ out·g w.r.t. params, input and relative table."""
    def loss(p, x, t, m, g):
        return jnp.sum(forward(p, x, t, m) * g)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _params(s: dict):
    x, table, _, mask = _inputs(s, 8)
    variables = make_layer(s, "take").init(jax.random.key(1), x, x, rel_table=table, mask=mask)
    return nn.meta.unbox(variables["params"])


def max_abs_difference(s: dict, length: int) -> float:
    """max |ours − naive| over every strategy's output (forward), as a correctness check."""
    params = _params(s)
    x, table, _, mask = _inputs(s, length)
    ref = _forward(s, "naive", length)(params, x, table, mask)
    return max(float(jnp.max(jnp.abs(_forward(s, v, length)(params, x, table, mask) - ref)))
               for v in STRATEGIES)


def run(scale: Scale, budget: Budget, context: dict) -> list[Table]:
    s = settings(scale)
    params = _params(s)
    memory: dict[tuple[int, str], float] = {}
    times: dict[tuple[int, str], list[float]] = {}
    progress = Progress("attention", [n * n for n in s["lengths"]])   # cost grows as L²
    for length in s["lengths"]:
        if budget.left() <= 0:
            break
        x, table, g, mask = _inputs(s, length)
        runnable = {}
        for v in VARIANTS:
            fn = _train_fn(_forward(s, v, length))
            compiled = fn.lower(params, x, table, mask, g).compile(scale.compiler_options)
            memory[length, v] = float(compiled.memory_analysis().temp_size_in_bytes)
            if memory[length, v] <= s["time_cap"]:
                runnable[v] = compiled
        for compiled in runnable.values():      # warm-up
            block(compiled(params, x, table, mask, g))
        for v in runnable:
            times[length, v] = []
        for r in range(min(scale.runs, RUNS)):
            if r >= 2 and budget.left() <= 0:
                break
            for v, compiled in runnable.items():   # alternate the variants each round
                times[length, v].append(timed(lambda: block(compiled(params, x, table, mask, g))))
        del runnable
        progress.tick(f"L = {length}")
    lengths = [n for n in s["lengths"] if (n, "take") in memory]
    # The shortest length, and the first beyond the table (2L − 1 > R: skew shifts, shift
    # gathers), if it is not the same.
    beyond = [n for n in lengths if 2 * n - 1 > 2 * s["buckets"]][:1]
    diff = {n: max_abs_difference(s, n) for n in sorted(set(lengths[:1] + beyond))}
    return [_time_table(s, lengths, times, diff), _memory_table(s, lengths, memory),
            _strategy_table(lengths, times)]


def _time_table(s: dict, lengths: list[int], times: dict, diff: dict[int, float]) -> Table:
    rows = []
    for n in lengths:
        rows.append([n] + [1e3 * median(times[n, v]) if (n, v) in times else None
                           for v in VARIANTS])
    h, d = s["heads"], s["hidden"] // s["heads"]
    skipped = [n for n in s["lengths"] if n not in lengths]
    budget_note = ([f"Not measured (time budget spent): L = {', '.join(map(str, skipped))}."]
                   if skipped else [])
    return Table(TIME_TITLE,
                 ["L"] + list(VARIANTS), rows,
                 [f"One layer, H = {s['hidden']}, h = {h} (d = {d}), k = {s['buckets']} "
                  f"(R = {2 * s['buckets']} table rows), log buckets, shared key, c2p + p2c.",
                  "— : not run, XLA scratch above the timing cap of "
                  f"{s['time_cap'] / 2 ** 20:.0f} MiB (see the memory table).",
                  ("Every strategy's output equals the naive form: max |Δ| = "
                   + ", ".join(f"{d:.1e} at L = {n}" for n, d in diff.items()) + "."
                   if diff else "No length measured (time budget spent).")] + budget_note)


def _memory_table(s: dict, lengths: list[int], memory: dict) -> Table:
    h, d = s["heads"], s["hidden"] // s["heads"]
    rows = []
    size = jnp.dtype(s["dtype"]).itemsize
    for n in lengths:
        lh = 4.0 * n * n * h            # one fp32 (h, L, L) tensor (logits, softmax: fp32)
        rows.append([n] + [memory[n, v] / 2 ** 20 for v in VARIANTS]
                    + [memory[n, "take"] / lh, memory[n, "naive"] / (size * n * n * h * d)])
    notes = ["XLA temp (scratch) memory of forward + backward, MiB. "
             "Units: one fp32 (h, L, L) tensor = 4·L²·h bytes (logits and softmax run in fp32).",
             "ours/L²h: take's scratch in those units; bounded as L grows means O(L·k + L²·h) "
             "(no L²·d term); naive/L²hd: the naive scratch in units of one (L, L, h, d) "
             f"{s['dtype']} tensor ({size}·L²·h·d bytes)."]
    if len(lengths) >= 2:
        a, b = lengths[-2], lengths[-1]
        growth = {v: memory[b, v] / memory[a, v] for v in VARIANTS}
        notes.append(f"Growth from L = {a} to {b} (×{b // a} length): "
                     + ", ".join(f"{v} ×{g:.2f}" for v, g in growth.items())
                     + f" (L² predicts ×{(b / a) ** 2:.0f}).")
    return Table(MEMORY_TITLE,
                 ["L"] + list(VARIANTS) + ["ours/L²h", "naive/L²hd"], rows, notes)


def fastest_strategy(lengths: list[int], times: dict) -> tuple[str | None, dict[str, float]]:
    """The strategy with the smallest geometric-mean time ratio to ``take`` over the lengths
    where every strategy was timed; returns (name, {strategy: geo-mean ratio})."""
    common = [n for n in lengths if all((n, v) in times for v in STRATEGIES)]
    if not common:
        return None, {}
    ratios = {v: math.exp(np.mean([math.log(median_ratio(times[n, v], times[n, "take"]))
                                   for n in common])) for v in STRATEGIES}
    return min(ratios, key=ratios.get), ratios


def _strategy_table(lengths: list[int], times: dict) -> Table:
    from posjax import TextConfig
    best, ratios = fastest_strategy(lengths, times)
    rows = []
    for n in lengths:
        timed_here = [v for v in STRATEGIES if (n, v) in times]
        if not timed_here:
            continue
        ratios_here = [median_ratio(times[n, v], times[n, "take"])
                       if (n, v) in times and (n, "take") in times else None for v in STRATEGIES]
        shown = {v: r for v, r in zip(STRATEGIES, ratios_here) if r is not None}
        fastest = (min(shown, key=shown.get) if shown   # by the ratio the row shows
                   else min(timed_here, key=lambda v: median(times[n, v])))
        rows.append([n] + ratios_here + [fastest])
    rows.append(["geo-mean"] + [ratios.get(v) for v in STRATEGIES] + [best or "—"])
    default = TextConfig().gather
    return Table("Gather strategies: time relative to take (median per-round ratio)",
                 ["L", *STRATEGIES, "fastest"], rows,
                 [f"Fastest over the lengths where all ran: {best}; current default "
                  f"TextConfig.gather = ViTConfig.gather = {default!r}."])
