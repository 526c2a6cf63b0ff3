"""Pallas backward kernels of ``posjax.kernels.flash``: the gradients of every input of the
forward kernel, logits recomputed per block (flash attention's backward), no L × L array.

Per block (query block i, key block j) of one (batch, head), with the forward's lse and
D = Σ_d dO·O per query row (both computed once),

    P = exp(S − lse) on visible pairs (0 elsewhere),   dP = dO·Vᵀ,   dS = P ⊙ (dP − D),

and dS is what every logit term's gradient is made of (``posjax.kernels.terms``: each term's
``q_grads`` / ``k_grads`` / ``scalar_grads`` / ``window_grads``). Three kernels, each over a
grid whose innermost axis accumulates into its outputs (VMEM-resident across it):

* ``dq``, grid (b, h, i, j): dQ = dS·K·scale, the query-side rows of the products (TUPE's
  Pq, BERT-A-d's), DeBERTa's c2p part of dQ; and every term's table entries as per-block sums
  of dS (T5's buckets, ALiBi's slopes, TUPE's [CLS] θ1, θ2): a (1, n) vector per (b, h, i).
* ``dkv``, grid (b, h, j, i): dV = Pᵀ·dO, dK = dSᵀ·Q·scale, the key-side product rows,
  DeBERTa's p2c part of dK.
* ``windows`` (DeBERTa only), grid (b, h, t, i) over the 2n − 1 block diagonals t = j − i +
  n − 1: every block of a diagonal reads the same 2·b rows of K_r and Q_r by offset
  (``DisentangledTerm``, blocks of b × b), so their gradients (dS unskewed, times Q or K)
  accumulate per diagonal, (2b, d); the diagonals' windows overlap by half and are summed
  outside. DeBERTa with block_q ≠ block_k (one per-head window of the table, no common
  diagonal) takes blocked.py's recomputing backward instead (the layers always use square
  blocks).

The kernels' outputs are gradients of the forward's operands (``terms.operands``); one
``jax.vjp`` of that operand construction carries them back to blocked.py's layout (rows
first, the DeBERTa tables' order by offset, the SMEM tables' flattening). fp32 throughout.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from posjax.kernels import terms as kt
from posjax.layers import blocked as bl

Array = jax.Array


def supported(plan: bl._Plan) -> bool:
    """Whether the backward kernels cover ``plan``: everything but DeBERTa's terms with
    block_q ≠ block_k."""
    terms = jax.tree.unflatten(plan.treedef, [None] * len(plan.roles))
    return terms.disentangled is None or (plan.block_q == plan.block_k
                                          and plan.num_q == plan.num_k)


def _regrid(spec: pl.BlockSpec, order) -> pl.BlockSpec:
    """``spec`` (indexed by the forward's (b, h, i, j)) for another grid: ``order`` maps that
    grid's indices to (b, h, i, j)."""
    if spec.index_map is None:
        return spec
    old = spec.index_map
    return dataclasses.replace(spec, index_map=lambda *g: old(*order(*g)))


def _zero_at(outs, first: Array) -> None:
    """Zero the (VMEM-resident) outputs at the first step of the accumulating axis."""
    @pl.when(first)
    def _init():
        for o in outs:
            o[...] = jnp.zeros(o.shape, jnp.float32)


def _zero_cotangent(x: Array):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


def flash_backward(plan: bl._Plan, interpret: bool, res, g: Array):
    """The custom_vjp backward of ``flash._flash``: res = (qr, kr, vb, shared, km, qm, rng,
    out, lse) in blocked.py's layout, g = dOut (nq, B, h, bq, dv) -> (dqr, dkr, dvb,
    dshared, None, None)."""
    qr, kr, vb, shared, km, qm, _, out, lse = res
    found = {}

    def build(qr, kr, vb, shared):
        ops, layout = kt.operands(plan, qr, kr, vb, shared, km, qm)
        found["ops"], found["layout"] = ops, layout
        return ops.arrays

    arrays, pull = jax.vjp(build, qr, kr, vb, shared)
    ops, layout = found["ops"], found["layout"]
    batch, heads = vb.shape[2], vb.shape[3]
    bq, bk, nq, nk = plan.block_q, plan.block_k, plan.num_q, plan.num_k
    dv = vb.shape[-1]

    def per_row(x: Array) -> Array:   # (nq, B, h, bq[, e]) -> (B, h, Lq_pad[, e])
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(x.shape[:2] + (nq * bq,) + x.shape[4:])

    d_out = per_row(g.astype(jnp.float32))                              # (B, h, Lq, dv)
    rows_layout = bq % 128 == 0   # lse and D as lane-dense rows (B, h, 1, Lq), else columns

    def row_values(x: Array) -> Array:   # (nq, B, h, bq) -> rows or a column per query
        x = per_row(x)
        return x[:, :, None, :] if rows_layout else x[..., None]

    stats = [row_values(lse), row_values(jnp.sum(g.astype(jnp.float32) * out, axis=-1))]
    stat_spec = (pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j: (b, h, 0, i))
                 if rows_layout else
                 pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j: (b, h, i, 0)))
    extra = [d_out] + stats
    extra_specs = [pl.BlockSpec((None, None, bq, dv), lambda b, h, i, j: (b, h, i, 0)),
                   stat_spec, stat_spec]
    num_ops = len(arrays)
    inputs = list(arrays) + extra
    specs = list(ops.specs) + extra_specs
    differentiable = [jnp.issubdtype(x.dtype, jnp.floating) for x in arrays]
    q_slots = [s for s, kind in enumerate(ops.kinds) if kind == "q" and differentiable[s]]
    k_slots = [s for s, kind in enumerate(ops.kinds) if kind == "k" and differentiable[s]
               and s != layout.v]
    targets = [t for term in layout.terms for t in term.scalar_targets]
    width = max(len(targets), 1)

    def block(ins, h, i, j):
        """-> (ctx, P, dS) of block (i, j), fp32 (bq, bk)."""
        ctx = kt.context(ins, layout, plan, h, i, j)
        s = kt.logits(ins, ctx, layout)
        lse_b, d_b = (_column(ins[num_ops + n][...], rows_layout) for n in (1, 2))
        p = jnp.where(s == -jnp.inf, 0.0, jnp.exp(s - lse_b))
        dp = kt.nt(ins[num_ops][...], ins[layout.v][...])
        return ctx, p, p * (dp - d_b)

    def accumulate(outs, slots: list[int], own: int, content: Array, by_term) -> None:
        """outs[n] += the gradient of operand slots[n]: the content term's for ``own`` (q or
        k), plus each term's (slot, value) pairs (``kt.SELF``: ``own``)."""
        grads = {own: content}
        for slot, value in (pair for pairs in by_term for pair in pairs):
            slot = own if slot == kt.SELF else slot
            grads[slot] = grads[slot] + value if slot in grads else value
        for slot, o in zip(slots, outs):
            if slot in grads:
                o[...] += grads[slot]

    # -- dq: query blocks outer, key blocks inner ---------------------------------------------
    def dq_kernel(*refs):
        ins, outs = refs[:len(inputs)], refs[len(inputs):]
        h, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)

        _zero_at(outs, j == 0)

        ctx, _, ds = block(ins, h, i, j)
        accumulate(outs, q_slots, layout.q, kt.nn(ds, ctx.k) * plan.scale,
                   [term.q_grads(ins, ctx, ds) for term in layout.terms])
        if targets:
            values = [v for term in layout.terms for v in term.scalar_grads(ins, ctx, ds)]
            lane = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
            vec = jnp.zeros((1, width), jnp.float32)
            for n, value in enumerate(values):
                vec = jnp.where(lane == n, value, vec)
            outs[-1][...] += vec

    dq_out_specs = [pl.BlockSpec((None, None, bq, arrays[s].shape[-1]),
                                 lambda b, h, i, j: (b, h, i, 0)) for s in q_slots]
    dq_shapes = [jax.ShapeDtypeStruct((batch, heads, plan.lq_pad, arrays[s].shape[-1]),
                                      jnp.float32) for s in q_slots]
    if targets:
        dq_out_specs.append(pl.BlockSpec((None, None, None, 1, width),
                                         lambda b, h, i, j: (b, h, i, 0, 0)))
        dq_shapes.append(jax.ShapeDtypeStruct((batch, heads, nq, 1, width), jnp.float32))
    dq_outs = pl.pallas_call(
        dq_kernel, grid=(batch, heads, nq, nk), in_specs=specs, out_specs=dq_out_specs,
        out_shape=dq_shapes, compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="posjax_flash_dq")(*inputs)

    # -- dk, dv: key blocks outer, query blocks inner -----------------------------------------
    def dkv_kernel(*refs):
        ins, outs = refs[:len(inputs)], refs[len(inputs):]
        h, j, i = pl.program_id(1), pl.program_id(2), pl.program_id(3)

        _zero_at(outs, i == 0)

        ctx, p, ds = block(ins, h, i, j)
        outs[0][...] += kt.tn(p, ins[num_ops][...])                      # dV = Pᵀ·dO
        accumulate(outs[1:], k_slots, layout.k, kt.tn(ds, ctx.q) * plan.scale,
                   [term.k_grads(ins, ctx, ds) for term in layout.terms])

    kv_order = lambda b, h, j, i: (b, h, i, j)   # noqa: E731
    dkv_outs = pl.pallas_call(
        dkv_kernel, grid=(batch, heads, nk, nq),
        in_specs=[_regrid(s, kv_order) for s in specs],
        out_specs=[pl.BlockSpec((None, None, bk, arrays[s].shape[-1]),
                                lambda b, h, j, i: (b, h, j, 0))
                   for s in [layout.v] + k_slots],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, plan.lk_pad, arrays[s].shape[-1]),
                                        jnp.float32) for s in [layout.v] + k_slots],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="posjax_flash_dkv")(*inputs)

    cotangents = [_zero_cotangent(x) for x in arrays]

    def put(slot: int, grad: Array) -> None:   # (B, h, L, e) fp32 -> the operand's shape
        x = arrays[slot]
        if x.ndim == 3:   # shared by the batch
            grad = jnp.sum(grad, axis=0)
        cotangents[slot] = cotangents[slot] + grad.astype(x.dtype)

    for slot, grad in zip(q_slots, dq_outs):
        put(slot, grad)
    for slot, grad in zip([layout.v] + k_slots, dkv_outs):
        put(slot, grad)
    if targets:   # per (b, h, i) sums -> d slot[base + h]
        local = jnp.sum(dq_outs[-1][:, :, :, 0, :], axis=(0, 2))            # (h, n)
        for n, (slot, base) in enumerate(targets):
            cotangents[slot] = cotangents[slot].at[base + jnp.arange(heads)].add(local[:, n])
    deberta = [t for t in layout.terms if isinstance(t, kt.DisentangledTerm)]
    if deberta:
        _window_grads(plan, interpret, deberta[0], inputs, specs, block, arrays, cotangents)
    dqr, dkr, dvb, dshared = pull(cotangents)
    return dqr, dkr, dvb, dshared, None, None


def _column(x: Array, rows_layout: bool) -> Array:
    """A (1, bq) row of per-query values as a (bq, 1) column (or the column itself)."""
    if not rows_layout:
        return x
    return jnp.broadcast_to(x, (8, x.shape[1])).T[:, 0:1]


def _window_grads(plan: bl._Plan, interpret: bool, term: "kt.DisentangledTerm", inputs,
                  specs, block, arrays, cotangents) -> None:
    """DeBERTa's K_r and Q_r by offset: per block diagonal t (blocks j = i + t − (n − 1)) the
    gradient of the 2b rows its blocks share, summed into the tables' cotangents."""
    n, b_size = plan.num_q, plan.block_q
    sides = [s for s in (term.c2p, term.p2c) if s is not None]
    d = [arrays[s[0]].shape[-1] for s in sides]
    batch, heads = arrays[0].shape[0], arrays[0].shape[1]

    def kernel(*refs):
        ins, outs = refs[:len(inputs)], refs[len(inputs):]
        h, t, i = pl.program_id(1), pl.program_id(2), pl.program_id(3)
        j = i + t - (n - 1)

        _zero_at(outs, i == 0)

        @pl.when((j >= 0) & (j < n))
        def _accumulate():
            ctx, _, ds = block(ins, h, i, j)
            grads = [x for x in term.window_grads(ins, ctx, ds) if x is not None]
            for o, grad in zip(outs, grads):
                o[...] += grad

    diagonal = lambda b, h, t, i: (b, h, i, jnp.clip(i + t - (n - 1), 0, n - 1))  # noqa: E731
    windows = pl.pallas_call(
        kernel, grid=(batch, heads, 2 * n - 1, n),
        in_specs=[_regrid(s, diagonal) for s in specs],
        out_specs=[pl.BlockSpec((None, None, None, 2 * b_size, e),
                                lambda b, h, t, i: (b, h, t, 0, 0)) for e in d],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, 2 * n - 1, 2 * b_size, e), jnp.float32)
                   for e in d],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="posjax_flash_deberta_tables")(*inputs)
    for slots, grad in zip(sides, windows):
        grad = jnp.sum(grad, axis=0)                    # (h, 2n − 1, 2b, d) per diagonal
        if slots is term.p2c:   # p2c's window of diagonal t starts at block 2n − 2 − t
            grad = grad[:, ::-1]
        first = grad[:, :, :b_size].reshape(heads, -1, grad.shape[-1])
        second = grad[:, :, b_size:].reshape(heads, -1, grad.shape[-1])
        pad = ((0, 0), (0, b_size), (0, 0))
        table = jnp.pad(first, pad) + jnp.pad(second, ((0, 0), (b_size, 0), (0, 0)))
        x = arrays[slots[0]]
        cotangents[slots[0]] = cotangents[slots[0]] + table.astype(x.dtype)
