"""A Pallas (TPU-style) flash-attention kernel for every position scheme (issue #52).

``pallas_attention`` has ``blocked.blocked_attention``'s signature, semantics and shape
contract (without attention dropout) and computes the same thing,

    out[b, i] = Σ_j softmax_j(q_i·k_j·scale + Σ_terms t(i, j), visible) v[b, j],

with every term of ``blocked.BlockTerms`` computed inside the kernel from small per-block
operands (``posjax.kernels.terms``): no L × L array exists in HBM.

Kernel: ``pl.pallas_call`` over the grid (batch, head, query block i, key block j), the key
blocks innermost ("arbitrary"; the others "parallel"). q, k, v come in as (B, h, L, d)
blocks (bq, d), (bk, d), (bk, dv); key and query masks as (B|1, 1, L) / (B|1, L, 1) int32
blocks (1, bk) / (bq, 1). The running max m, sum l (bq, 1) and weighted value sum acc
(bq, dv) live in VMEM scratch across the key blocks (fp32, the online softmax of blocked.py:
an all-masked row keeps m = −inf, shift 0, l = 0); at the last key block the kernel writes
out = acc / l (0 for a row with no visible key) and lse = m + log l (+inf there), fp32 (lse
as lane-dense rows (B, h, 1, L) when block_q is a multiple of 128, else as a column).
Lengths are padded to the blocks as in blocked.py, and a block larger than its length
shrinks to it. For the TPU's (8, 128) tiling the blocks should be multiples of 128 where the
length allows (blocked.py's default 128 × 128; the key mask's (1, bk) blocks need it).
Mosaic (libtpu 0.0.42.1) compiles the kernel for v5e and v6e with every term (L = 512,
h = 12, d = 64, blocks 128; DeBERTa also with 128 × 256 blocks and with far blocks), and the
forward and backward kernels of every scheme for v5e up to L = 32k (blocks of 512;
``bench.kernel_memory``).

The operands are built from blocked.py's rows-first block layout (``blocked.prepare``, the
same checks, so that the custom_vjp below shares blocked.py's residuals) by
``terms.operands``: q, k, v and the terms' row inputs transposed to (B, h, L, d) outside the
kernel, and the output back; wiring the kernel into the layers can feed (B, h, L, d)
directly.

Backward: a ``jax.custom_vjp`` whose backward is the Pallas kernels of
``posjax.kernels.backward`` (dq; dk and dv; DeBERTa's tables per block diagonal), logits
recomputed per block; DeBERTa with block_q ≠ block_k takes blocked.py's recomputing
``_flash_bwd`` on blocked.py's own layout (the forward's (out, lse) converted to it).

``interpret=True`` runs the kernel in Pallas' interpreter (any backend, CPU included: the
tests); ``interpret=False`` compiles it with Mosaic for a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from posjax.kernels import backward
from posjax.kernels import terms as kt
from posjax.layers import blocked as bl

Array = jax.Array


def pallas_attention(q: Array, k: Array, v: Array, *, key_mask: Array | None = None,
                     query_mask: Array | None = None, scale: float, block_q: int = 128,
                     block_k: int = 128, block_terms: bl.BlockTerms | None = None,
                     dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                     interpret: bool = False) -> Array:
    """softmax(q·k·scale + block_terms, masked) v by a Pallas kernel: ``blocked_attention``'s
    contract (q (B, Lq, h, d), k (B, Lk, h, d), v (B, Lk, h, dv), key_mask (B|1, Lk),
    query_mask (B|1, Lq) bool; rows with no visible key give 0; fp32 logits and softmax; the
    output in v's dtype) -> (B, Lq, h, dv). Attention dropout is not supported
    (``dropout_rate`` > 0 is a ValueError). ``interpret``: run in Pallas' interpreter."""
    if dropout_rate:
        raise ValueError(f"dropout_rate={dropout_rate!r}: attention dropout is not supported "
                         "by the Pallas kernel; use attention_impl='blocked' or attention "
                         "dropout 0")
    del dropout_rng
    plan, blocked = bl.prepare(q, k, v, key_mask=key_mask, query_mask=query_mask, scale=scale,
                               block_q=block_q, block_k=block_k, block_terms=block_terms)
    return bl.unblock(_flash(plan, bool(interpret), *blocked), q.shape[1], v.dtype)


def _forward(plan: bl._Plan, interpret: bool, qr, kr, vb, shared, km, qm
             ) -> tuple[Array, Array]:
    """The kernel on blocked.py's block layout -> out (nq, B, h, bq, dv) fp32 and lse
    (nq, B, h, bq) (+inf for rows with no visible key), as ``blocked._forward``."""
    batch, heads, dv = vb.shape[2], vb.shape[3], vb.shape[4]
    bq, nk = plan.block_q, plan.num_k
    ops, layout = kt.operands(plan, qr, kr, vb, shared, km, qm)
    num_inputs = len(ops.arrays)
    lq_pad = plan.lq_pad
    # lse: rows (B, h, 1, Lq_pad) when the query block fills whole lanes; else a column
    # (B, h, Lq_pad, 1), which TPU HBM pads to 128 lanes (blocks of 128 avoid it).
    lse_rows = bq % 128 == 0
    lse_block, lse_shape = ((None, None, 1, bq), (batch, heads, 1, lq_pad)) if lse_rows else \
        ((None, None, bq, 1), (batch, heads, lq_pad, 1))

    def kernel(*refs):
        ins, (o_ref, lse_ref, m_ref, l_ref, acc_ref) = refs[:num_inputs], refs[num_inputs:]
        h, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        ctx = kt.context(ins, layout, plan, h, i, j)
        s = kt.logits(ins, ctx, layout)

        m, l = m_ref[...], l_ref[...]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # all masked so far: 0
        p = jnp.exp(s - shift)
        corr = jnp.exp(m - shift)
        l_ref[...] = corr * l + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_new
        v = ins[layout.v][...]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        acc_ref[...] = corr * acc_ref[...] + pv

        @pl.when(j == nk - 1)
        def _finish():
            m, l = m_ref[...], l_ref[...]
            seen = l > 0
            safe = jnp.where(seen, l, 1.0)
            o_ref[...] = jnp.where(seen, acc_ref[...] / safe, 0.0)
            lse = jnp.where(seen, m + jnp.log(safe), jnp.inf)   # (bq, 1)
            if lse_rows:   # lane-dense: a (bq, 128) tile transposed, its first row
                lse = jnp.broadcast_to(lse, (bq, 128)).T[0:1, :]
            lse_ref[...] = lse

    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, heads, plan.num_q, nk),
        in_specs=ops.specs,
        out_specs=[pl.BlockSpec((None, None, bq, dv), lambda b, h, i, j: (b, h, i, 0)),
                   pl.BlockSpec(lse_block, (lambda b, h, i, j: (b, h, 0, i)) if lse_rows
                                else (lambda b, h, i, j: (b, h, i, 0)))],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, lq_pad, dv), jnp.float32),
                   jax.ShapeDtypeStruct(lse_shape, jnp.float32)],
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="posjax_flash_forward",
    )(*ops.arrays)
    out = out.reshape(batch, heads, plan.num_q, bq, dv).transpose(2, 0, 1, 3, 4)
    lse = lse.reshape(batch, heads, plan.num_q, bq).transpose(2, 0, 1, 3)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(plan: bl._Plan, interpret: bool, qr, kr, vb, shared, km, qm) -> Array:
    return _forward(plan, interpret, qr, kr, vb, shared, km, qm)[0]


def _flash_fwd(plan: bl._Plan, interpret: bool, qr, kr, vb, shared, km, qm):
    out, lse = _forward(plan, interpret, qr, kr, vb, shared, km, qm)
    return out, (qr, kr, vb, shared, km, qm, None, out, lse)


def _flash_bwd(plan: bl._Plan, interpret: bool, res, g: Array):
    if backward.supported(plan):
        return backward.flash_backward(plan, interpret, res, g)
    return bl._flash_bwd(plan, res, g)[:6]   # blocked.py's recomputing backward (no rng)


_flash.defvjp(_flash_fwd, _flash_bwd)
