"""Memory-bounded ("blocked", flash-style) attention for every position scheme (issue #35).

    out[b, i] = Σ_j softmax_j(s[b, h, i, j], visible) v[b, j],
    s[i, j]   = q_i·k_j · scale + Σ_terms t(i, j)

computed over blocks of ``block_q`` queries × ``block_k`` keys with an online softmax: per
query row a running max m, running sum l and running weighted value sum acc (all fp32),

    m' = max(m, max_j s_ij),  l' = e^(m − m') l + Σ_j e^(s_ij − m'),
    acc' = e^(m − m') acc + Σ_j e^(s_ij − m') v_j,  out = acc / l,

so no L × L array exists: forward memory is O(L·h·d) plus one (B, h, block_q, block_k)
block. The backward pass (a ``jax.custom_vjp``) keeps only the output and the row
log-sum-exp lse = m + log l, and recomputes each block's logits:

    p = e^(s − lse),  dv_j += Σ_i p_ij do_i,  dp_ij = do_i·v_j,
    ds_ij = p_ij (dp_ij − D_i),  D_i = do_i·out_i,

then pulls ds back through the block's logit function (``jax.vjp``) to q, k and every
term's inputs. Its peak memory is again O(L·h·d) plus one block.

Each scheme's logit terms are described, not materialised, by ``BlockTerms`` (a pytree of
small dataclasses): per block they are computed from the block's query/key positions only.

* ``Product``        — left[i]·right[j]·scale (TUPE's untied positions, BERT-A-d's mixed
  word/position terms), with TUPE's [CLS] reset (row 0 → θ1, column 0 → θ2, row wins).
* ``RelativeBucketBias`` — T5 buckets (BERT-R, TUPE-R): table[bucket(j − i)]; the bucket of
  each of the 2L − 1 offsets is static numpy; grids use per-axis coordinates.
* ``LinearBias``     — ALiBi-style −slope_h·|i − j|.
* ``Disentangled``   — DeBERTa c2p + p2c: per block the bq + bk − 1 offsets it spans pick
  their δ rows of K_r and Q_r, two small products, then a static skew into (bq, bk).

RoPE and NoPE need nothing here (RoPE rotates q and k before the call).

``blocked_attention`` is the one entry point; the plain-JAX scan below is its only backend
today. A fused kernel (Pallas) can replace ``_flash`` with the same inputs: blocks of query
rows, blocks of key rows, values, shared tables, masks, and the static ``_Plan``.
Attention dropout is supported: each (query block, key block) draws its mask from
fold_in(fold_in(rng, query block), key block) (the same masks forward and backward; not the
plain path's masks, which are drawn for the whole L × L array).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from posjax.layers import logit_terms, positions
from posjax.layers.dropout import dropout

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Term descriptions
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockContext:
    """What a term sees for one block: q (bq, B, h, d) and k (bk, B, h, d) rows of the block
    (rows first), their global positions qpos (bq,), kpos (bk,) (int32), and the padded
    lengths (static)."""

    q: Array
    k: Array
    qpos: Array
    kpos: Array
    lq_pad: int
    lk_pad: int


@struct.dataclass
class Product:
    """t[i, j] = query_side[i]·key_side[j] · scale, then (TUPE's untied [CLS]) column 0 → θ2
    (``first_col``) and row 0 → θ1 (``first_row``), the row winning at [0, 0].

    query_side: (Lq, h, d) or (B, Lq, h, d); key_side: (Lk, h, d) or (B, Lk, h, d);
    first_row / first_col: (h,) or None. Per block: (bq, h, d)·(bk, h, d) -> (h, bq, bk)
    (``logit_terms.untied_logits``, as the plain path's ``TupePositionBias``).
    """

    query_side: Array
    key_side: Array
    first_row: Array | None = None
    first_col: Array | None = None
    scale: float = struct.field(pytree_node=False, default=1.0)

    ROW_FIELDS = {"query_side": "q", "key_side": "k"}

    def block_logits(self, ctx: BlockContext) -> Array:
        return logit_terms.untied_logits(self.query_side, self.key_side, ctx.qpos,
                                         ctx.kpos, self.first_row, self.first_col, self.scale)


@struct.dataclass
class RelativeBucketBias:
    """T5 relative bias: t[i, j] = Σ_axes table[a, bucket(c_a[j] − c_a[i]), h] (not scaled).

    table: (A, num_buckets [+1], h), A = 1 (text: c = token index) or 2 (``grid``: row and
    column of each patch, [CLS] at (0, 0) when ``untie_cls``). With ``untie_cls`` column 0
    uses bucket num_buckets and row 0 bucket num_buckets/2 (row wins), as
    ``positions.t5_bucket_matrix``. Per block: the static bucket-per-difference lookup
    (``positions.t5_pair_buckets`` of the block's positions), then a (bq, bk) gather of the
    table (``logit_terms.t5_logits``) -> (h, bq, bk), as the plain path's ``T5RelativeBias``.
    """

    table: Array
    num_buckets: int = struct.field(pytree_node=False, default=32)
    max_distance: int = struct.field(pytree_node=False, default=128)
    untie_cls: bool = struct.field(pytree_node=False, default=False)
    grid: tuple[int, int] | None = struct.field(pytree_node=False, default=None)

    ROW_FIELDS = {}   # every array is shared by all blocks

    def block_logits(self, ctx: BlockContext) -> Array:
        axes = positions.t5_axes(self.num_buckets, self.max_distance, self.untie_cls,
                                 self.grid, max(ctx.lq_pad, ctx.lk_pad))
        return logit_terms.t5_logits(self.table, [
            positions.t5_pair_buckets(axis, ctx.qpos, ctx.kpos, self.num_buckets,
                                      self.untie_cls) for axis in axes])


@struct.dataclass
class LinearBias:
    """ALiBi-style symmetric linear bias t[h, i, j] = −slopes[h]·|i − j|; slopes: (h,). On a
    patch grid (``coords`` (A, L) int: each token's row and column, constants without a
    gradient; ``positioned`` (L,) bool) the distance is Σ_a |c_a[i] − c_a[j]|, and 0 for a pair with a token without a position
    ([CLS]): ``logit_terms.alibi_logits`` of the block's positions, as the plain path's
    ``position_bias.alibi_bias``."""

    slopes: Array
    coords: Array | None = None
    positioned: Array | None = None

    ROW_FIELDS = {}   # every array is shared by all blocks

    def block_logits(self, ctx: BlockContext) -> Array:
        if self.coords is None:
            return logit_terms.alibi_logits(self.slopes, [ctx.qpos], [ctx.kpos])
        # padded positions past L read the last token's entries; they are masked
        cq = jnp.take(self.coords, ctx.qpos, axis=1, mode="clip")
        ck = jnp.take(self.coords, ctx.kpos, axis=1, mode="clip")
        return logit_terms.alibi_logits(self.slopes, list(cq), list(ck),
                                        jnp.take(self.positioned, ctx.qpos, mode="clip"),
                                        jnp.take(self.positioned, ctx.kpos, mode="clip"))


@struct.dataclass
class Disentangled:
    """DeBERTa's position terms (text), each · ``scale`` (1/√(d·(1 + #terms))):

        c2p[i, j] = Q_c[i]·K_r[δ(i, j)],  p2c[i, j] = K_c[j]·Q_r[δ(i, j)],
        δ(i, j) = clamp(bucket(i − j) + span, 0, 2·span − 1)

    (``positions.deberta_relative_index`` with ``bucket_size``/``max_position``).
    rel_key K_r, rel_query Q_r: (2·span, h, d) projected relative tables, either None to omit
    its term. Q_c, K_c are the attention's own q and k. Per block with first query qs and
    first key ks, the offsets r = i − j span W = bq + bk − 1 values
    r = qs − ks − (bk − 1) + w (w = 0…W−1): their δ rows (W, h, d) of each table are gathered,
    q_blk·K_r[δ_w] -> (B, h, bq, W) and k_blk·Q_r[δ_w] -> (B, h, bk, W), and skewed into
    (B, h, bq, bk) at w(a, c) = a − c + bk − 1 by a slice and reshape
    (``positions.offset_window``, ``logit_terms.disentangled_logits``, as the plain path's
    relative shift).
    """

    rel_key: Array | None
    rel_query: Array | None
    span: int = struct.field(pytree_node=False, default=256)
    bucket_size: int = struct.field(pytree_node=False, default=0)
    max_position: int = struct.field(pytree_node=False, default=0)
    scale: float = struct.field(pytree_node=False, default=1.0)

    ROW_FIELDS = {}   # every array is shared by all blocks

    def block_logits(self, ctx: BlockContext) -> Array:
        by_offset = positions.deberta_offset_rows(self.span, self.bucket_size,
                                                  self.max_position, ctx.lq_pad, ctx.lk_pad)
        bq, bk = ctx.qpos.shape[0], ctx.kpos.shape[0]

        def band() -> Array:   # the block's offsets pick several rows: the skewed products
            window = positions.offset_window(by_offset, ctx.qpos[0], ctx.kpos[0], bq, bk,
                                             ctx.lk_pad)
            c2p, p2c = logit_terms.disentangled_logits(ctx.q, ctx.k, self.rel_key,
                                                       self.rel_query, window)
            return c2p if p2c is None else p2c if c2p is None else c2p + p2c

        # Offsets r = i − j at or below r_low all take δ's first row, at or above r_high its
        # last (the clamp): a block whose W offsets all lie there uses one row δ*, and its
        # terms are a column plus a row, c2p[a, c] = Q_c[a]·K_r[δ*], p2c[a, c] = K_c[c]·Q_r[δ*]
        # (O((bq + bk)·d), not O((bq + bk)·W·d)). Static thresholds, a traced choice.
        r_low, r_high = positions.clamped_offsets(by_offset, ctx.lk_pad)
        r_first = ctx.qpos[0] - ctx.kpos[0] - (bk - 1)
        r_last = ctx.qpos[0] - ctx.kpos[0] + (bq - 1)

        def far() -> Array:
            row = jnp.where(r_first >= r_high, by_offset[-1], by_offset[0])
            total = jnp.zeros((ctx.q.shape[1], ctx.q.shape[2], bq, bk), jnp.float32)
            if self.rel_key is not None:
                total = total + jnp.einsum("qbhd,hd->bhq", ctx.q, self.rel_key[row],
                                           preferred_element_type=jnp.float32)[..., None]
            if self.rel_query is not None:
                total = total + jnp.einsum("kbhd,hd->bhk", ctx.k, self.rel_query[row],
                                           preferred_element_type=jnp.float32)[..., None, :]
            return total

        outside = (r_last <= r_low) | (r_first >= r_high)
        return jax.lax.cond(outside, far, band) * self.scale


@struct.dataclass
class BlockTerms:
    """Every additive logit term beyond q·k·scale, un-materialised (see the module docstring).
    Any field may be empty; ``products`` may hold several ``Product`` terms."""

    products: tuple[Product, ...] = ()
    relative_bias: RelativeBucketBias | None = None
    linear_bias: LinearBias | None = None
    disentangled: Disentangled | None = None

    def with_products(self, *extra: Product) -> "BlockTerms":
        return self.replace(products=tuple(self.products) + tuple(extra))

    def terms(self) -> list[Any]:
        return [t for t in (*self.products, self.relative_bias, self.linear_bias,
                            self.disentangled) if t is not None]

    def needs_positions(self) -> bool:
        """Whether any term depends on query/key positions (then Lq must equal Lk)."""
        return bool(self.terms())

    def rows(self, num_queries: int, length: int) -> Array:
        """The terms' sum for queries 0…num_queries−1 against all ``length`` keys, materialised:
        (1 or B, h, num_queries, length) fp32, O(num_queries·L) — for the plain path's few query
        rows (the encoder's ``first_only`` [CLS] query), not for whole sequences. Not for
        ``Disentangled`` (its terms need the layer's q and k)."""
        if self.disentangled is not None:
            raise ValueError("Disentangled terms are formed inside DisentangledAttention")
        qpos = jnp.arange(num_queries, dtype=jnp.int32)
        kpos = jnp.arange(length, dtype=jnp.int32)

        def rows_first(x: Array, n: int) -> Array:   # (L, …) or (B, L, …) -> (n, [B,] …)
            return x[:n] if x.ndim == 3 else jnp.moveaxis(x[:, :n], 1, 0)

        products = tuple(p.replace(query_side=rows_first(p.query_side, num_queries),
                                   key_side=rows_first(p.key_side, length))
                         for p in self.products)
        ctx = BlockContext(None, None, qpos, kpos, length, length)
        total = sum(t.block_logits(ctx) for t in self.replace(products=products).terms())
        return total if total.ndim == 4 else total[None]


def _roles(terms: BlockTerms) -> list[str]:
    """Per leaf of ``terms`` (flatten order): 'q' (indexed by query row), 'k' (by key row)
    or 's' (shared by every block)."""
    roles: list[str] = []
    for t in terms.terms():
        marked = t.replace(**{f.name: t.ROW_FIELDS.get(f.name, "s")
                              for f in dataclasses.fields(t)
                              if f.metadata.get("pytree_node", True)
                              and getattr(t, f.name) is not None})
        roles.extend(jax.tree.leaves(marked))
    return roles


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static description of one call: term structure and roles, scale, block geometry."""

    treedef: Any
    roles: tuple[str, ...]
    scale: float
    block_q: int
    block_k: int
    num_q: int
    num_k: int
    dropout_rate: float

    @property
    def lq_pad(self) -> int:
        return self.block_q * self.num_q

    @property
    def lk_pad(self) -> int:
        return self.block_k * self.num_k


def blocked_attention(q: Array, k: Array, v: Array, *, key_mask: Array | None = None,
                      query_mask: Array | None = None, scale: float, block_q: int = 128,
                      block_k: int = 128, block_terms: BlockTerms | None = None,
                      dropout_rate: float = 0.0, dropout_rng: Array | None = None) -> Array:
    """softmax(q·k·scale + block_terms, masked) v without any Lq × Lk array.

    q: (B, Lq, h, d); k: (B, Lk, h, d); v: (B, Lk, h, dv); key_mask: (B|1, Lk) bool
    (True = may be attended); query_mask: (B|1, Lq) bool (False rows get all-zero weights,
    DeBERTa's XSoftmax). Rows with no visible key output zeros (as ``attention_weights``).
    Lengths need not be multiples of the blocks: they are padded internally and the pad
    masked; a block larger than its length shrinks to it. Position terms require Lq = Lk
    (query i and key i are the same token). Logits, softmax and accumulation run in fp32;
    the output has v's dtype. ``dropout_rate`` > 0 (with ``dropout_rng``): attention dropout,
    one mask per block (module docstring). -> (B, Lq, h, dv).

    Memory: O((Lq + Lk)·B·h·d) plus O(B·h·block_q·block_k) per block, forward and backward.
    """
    plan, blocked = prepare(q, k, v, key_mask=key_mask, query_mask=query_mask, scale=scale,
                            block_q=block_q, block_k=block_k, block_terms=block_terms,
                            dropout_rate=dropout_rate)
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng")
    rng = dropout_rng if dropout_rate > 0.0 else None
    return unblock(_flash(plan, *blocked, rng), q.shape[1], v.dtype)


def prepare(q: Array, k: Array, v: Array, *, key_mask: Array | None, query_mask: Array | None,
            scale: float, block_q: int, block_k: int, block_terms: BlockTerms | None,
            dropout_rate: float = 0.0) -> tuple[_Plan, tuple[Any, ...]]:
    """``blocked_attention``'s checks and block layout, shared with the Pallas kernel
    (``posjax.kernels.flash``): (the static plan, (qr, kr, vb, shared, km, qm)) — q, k and the
    terms' row inputs rows first in blocks, (count, size, [B,] …); the terms' shared tables;
    the masks (count, B|1, size)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.shape[0] != k.shape[0] \
            or k.shape[:3] != v.shape[:3] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} must be (B, Lq, h, d), "
                         "(B, Lk, h, d), (B, Lk, h, dv)")
    batch, lq, heads, _ = q.shape
    lk = k.shape[1]
    terms = BlockTerms() if block_terms is None else block_terms
    if terms.needs_positions() and lq != lk:
        raise ValueError(f"position terms need queries and keys of the same tokens; got "
                         f"Lq={lq}, Lk={lk} (use the plain path for a subset of queries)")
    for name, m, n in (("key_mask", key_mask, lk), ("query_mask", query_mask, lq)):
        if m is not None and (m.ndim != 2 or m.shape[1] != n or m.shape[0] not in (1, batch)):
            raise ValueError(f"{name} {tuple(m.shape)} must be (B or 1, {n}) bool")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={dropout_rate!r} is outside [0, 1)")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q={block_q}, block_k={block_k} must be positive")
    bq, bk = min(block_q, lq), min(block_k, lk)
    nq, nk = -(-lq // bq), -(-lk // bk)

    leaves, treedef = jax.tree.flatten(terms)
    roles = _roles(terms)
    assert len(roles) == len(leaves), (len(roles), len(leaves))
    plan = _Plan(treedef, tuple(roles), float(scale), bq, bk, nq, nk, float(dropout_rate))

    def blocks(x: Array, batched_axis: bool, size: int, count: int) -> Array:
        """(B, L, …) or (L, …) -> rows first, padded, (count, size, [B,] …)."""
        x = jnp.moveaxis(x, 1, 0) if batched_axis else x
        x = jnp.pad(x, [(0, size * count - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((count, size) + x.shape[1:])

    qr = [blocks(q, True, bq, nq)] + [blocks(x, x.ndim == 4, bq, nq)
                                      for x, r in zip(leaves, roles) if r == "q"]
    kr = [blocks(k, True, bk, nk)] + [blocks(x, x.ndim == 4, bk, nk)
                                      for x, r in zip(leaves, roles) if r == "k"]
    shared = [x for x, r in zip(leaves, roles) if r == "s"]
    vb = blocks(v, True, bk, nk)

    def mask_blocks(m: Array | None, n: int, size: int, count: int) -> Array:
        m = jnp.ones((1, n), bool) if m is None else m.astype(bool)
        m = jnp.pad(m, ((0, 0), (0, size * count - n)))   # pad: False
        return jnp.swapaxes(m.reshape(m.shape[0], count, size), 0, 1)   # (count, B|1, size)

    km = mask_blocks(key_mask, lk, bk, nk)
    qm = mask_blocks(query_mask, lq, bq, nq)
    return plan, (qr, kr, vb, shared, km, qm)


def unblock(out: Array, length: int, dtype: Any) -> Array:
    """(nq, B, h, bq, dv) per query block -> (B, length, h, dv) in ``dtype``."""
    nq, batch, heads, bq, dv = out.shape
    out = jnp.transpose(out, (1, 0, 3, 2, 4)).reshape(batch, nq * bq, heads, dv)
    return out[:, :length].astype(dtype)


# ---------------------------------------------------------------------------------------------
# Plain-JAX backend: online softmax forward, recomputing backward
# ---------------------------------------------------------------------------------------------

def _block_logits(plan: _Plan, qr: Sequence[Array], kr: Sequence[Array],
                  shared: Sequence[Array], qpos: Array, kpos: Array) -> Array:
    """s = q·k·scale + Σ terms for one block -> fp32 (B, h, bq, bk). qr/kr: the block's rows
    (rows first) of q/k and of the terms' row-indexed inputs; shared: the terms' tables."""
    s = jnp.einsum("qbhd,kbhd->bhqk", qr[0], kr[0],
                   preferred_element_type=jnp.float32) * plan.scale
    it = {"q": iter(qr[1:]), "k": iter(kr[1:]), "s": iter(shared)}
    terms: BlockTerms = jax.tree.unflatten(plan.treedef, [next(it[r]) for r in plan.roles])
    ctx = BlockContext(qr[0], kr[0], qpos, kpos, plan.lq_pad, plan.lk_pad)
    for term in terms.terms():
        s = s + term.block_logits(ctx)
    return s


def _visible(qm: Array, km: Array) -> Array:
    """(B|1, bq), (B|1, bk) -> (B|1, 1, bq, bk): query row unmasked and key unmasked."""
    return qm[:, None, :, None] & km[:, None, None, :]


def _dropout_scale(plan: _Plan, rng: Array | None, qi: Array, ki: Array,
                   shape: tuple[int, ...]) -> Array | None:
    """Per block keep-mask / P(keep) (``posjax.layers.dropout``) from
    fold_in(fold_in(rng, query block), key block), or None without dropout."""
    if rng is None or plan.dropout_rate == 0.0:
        return None
    key = jax.random.fold_in(jax.random.fold_in(rng, qi), ki)
    return dropout(jnp.ones(shape, jnp.float32), plan.dropout_rate, key)


def _positions(size: int, count: int) -> Array:
    return jnp.arange(size * count, dtype=jnp.int32).reshape(count, size)


def _forward(plan: _Plan, qr, kr, vb, shared, km, qm, rng) -> tuple[Array, Array]:
    """-> out (nq, B, h, bq, dv) fp32, lse (nq, B, h, bq) (+inf for rows with no visible key)."""
    qpos, kpos = _positions(plan.block_q, plan.num_q), _positions(plan.block_k, plan.num_k)
    batch, heads, dv = vb.shape[2], vb.shape[3], vb.shape[4]
    bq = plan.block_q

    def query_block(xs):
        qr_b, qm_b, qpos_b, qi = xs

        def step(carry, ys):
            m, l, acc = carry
            kr_b, v_b, km_b, kpos_b, ki = ys
            s = _block_logits(plan, qr_b, kr_b, shared, qpos_b, kpos_b)
            s = jnp.where(_visible(qm_b, km_b), s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)   # all masked so far: 0
            p = jnp.exp(s - shift[..., None])
            corr = jnp.exp(m - shift)
            l = corr * l + jnp.sum(p, axis=-1)
            z = _dropout_scale(plan, rng, qi, ki, p.shape)
            pv = jnp.einsum("bhqk,kbhd->bhqd", (p if z is None else p * z).astype(v_b.dtype),
                            v_b, preferred_element_type=jnp.float32)
            return (m_new, l, corr[..., None] * acc + pv), None

        init = (jnp.full((batch, heads, bq), -jnp.inf, jnp.float32),
                jnp.zeros((batch, heads, bq), jnp.float32),
                jnp.zeros((batch, heads, bq, dv), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(step, init, (kr, vb, km, kpos, jnp.arange(plan.num_k)))
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return out, lse

    return jax.lax.map(query_block, (qr, qm, qpos, jnp.arange(plan.num_q)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, qr, kr, vb, shared, km, qm, rng) -> Array:
    return _forward(plan, qr, kr, vb, shared, km, qm, rng)[0]


def _flash_fwd(plan: _Plan, qr, kr, vb, shared, km, qm, rng):
    out, lse = _forward(plan, qr, kr, vb, shared, km, qm, rng)
    return out, (qr, kr, vb, shared, km, qm, rng, out, lse)


def _flash_bwd(plan: _Plan, res, g: Array):
    """Outer scan over key blocks (emits dk-side and dv per key block), inner scan over query
    blocks (emits dq-side per query block, summed over the outer steps); shared-table
    gradients are carried. Logits are recomputed per block."""
    qr, kr, vb, shared, km, qm, rng, out, lse = res
    qpos, kpos = _positions(plan.block_q, plan.num_q), _positions(plan.block_k, plan.num_k)
    big_d = jnp.sum(g * out, axis=-1)                                  # (nq, B, h, bq)
    f32 = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, jnp.float32))
    add = functools.partial(jax.tree.map, lambda a, b: a + b.astype(jnp.float32))

    def key_block(carry, xs):
        dqr_total, dshared = carry
        kr_b, v_b, km_b, kpos_b, ki = xs

        def step(c, ys):
            dkr_b, dv_b, dsh = c
            qr_b, qm_b, qpos_b, qi, g_b, lse_b, d_b = ys
            s, pull = jax.vjp(
                lambda a, b, t: _block_logits(plan, a, b, t, qpos_b, kpos_b), qr_b, kr_b, shared)
            p = jnp.where(_visible(qm_b, km_b), jnp.exp(s - lse_b[..., None]), 0.0)
            z = _dropout_scale(plan, rng, qi, ki, p.shape)
            dv_b = dv_b + jnp.einsum("bhqk,bhqd->kbhd", p if z is None else p * z, g_b)
            dp = jnp.einsum("bhqd,kbhd->bhqk", g_b, v_b.astype(jnp.float32))
            ds = p * ((dp if z is None else dp * z) - d_b[..., None])
            dqr_b, dkr_i, dsh_i = pull(ds)
            return ((add(dkr_b, dkr_i), dv_b, add(dsh, dsh_i)),
                    jax.tree.map(lambda x: x.astype(jnp.float32), dqr_b))

        init = (f32(kr_b), jnp.zeros(v_b.shape, jnp.float32), dshared)
        (dkr_b, dv_b, dshared), dqr = jax.lax.scan(
            step, init, (qr, qm, qpos, jnp.arange(plan.num_q), g, lse, big_d))
        return (add(dqr_total, dqr), dshared), (dkr_b, dv_b)

    (dqr, dshared), (dkr, dvb) = jax.lax.scan(
        key_block, (f32(qr), f32(shared)), (kr, vb, km, kpos, jnp.arange(plan.num_k)))
    cast = functools.partial(jax.tree.map, lambda d, x: d.astype(x.dtype))
    return (cast(dqr, qr), cast(dkr, kr), dvb.astype(vb.dtype), cast(dshared, shared),
            None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------
# The layers' hook
# ---------------------------------------------------------------------------------------------

def layer_attention(module: Any, q: Array, k: Array, v: Array, *, block_size: int,
                    scale: float, mask: Array | None = None, query_mask: Array | None = None,
                    bias: Array | None = None, block_terms: BlockTerms | None = None,
                    mixed: tuple[Array, Array, Array, Array] | None = None,
                    dropout_rate: float = 0.0,
                    attention_fn: Any = blocked_attention) -> Array:
    """The blocked path of ``MultiHeadAttention`` / ``DisentangledAttention`` (``block_size``
    > 0): projected q (B, Lq, h, d), k, v (B, Lk, h, d) -> combined heads (B, Lq, h, d),
    before the output projection.

    mask: None or a key mask (B, 1, 1, Lk) (a per-query (B, 1, Lq, Lk) mask would be an L × L
    array: give its query part as ``query_mask`` (B, Lq)). ``bias`` must be None: the shared
    terms come un-materialised as ``block_terms`` (``T5RelativeBias.block_terms``,
    ``TupePositionBias.block_terms``). ``mixed``: BERT-A-d's (x W̃_Q, P Ũ_K, P Ũ_Q, x W̃_K),
    two ``Product`` terms at ``scale``. Attention dropout draws 'dropout' rngs from ``module``.
    ``attention_fn`` runs it: ``blocked_attention`` or the Pallas kernel
    (``posjax.kernels.attention_fn``).
    """
    if bias is not None:
        raise ValueError("with block_size > 0 give the shared position terms as block_terms "
                         "(T5RelativeBias.block_terms / TupePositionBias.block_terms), not as a "
                         "materialised (1, h, L, L) bias")
    key_mask = None
    if mask is not None:
        if mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
            raise ValueError(f"with block_size > 0 the mask {tuple(mask.shape)} must be a key "
                             "mask (B, 1, 1, Lk); give masked queries as query_mask (B, Lq)")
        key_mask = mask[:, 0, 0]
    terms = BlockTerms() if block_terms is None else block_terms
    if mixed is not None:
        word_q, pos_k, pos_q, word_k = mixed
        terms = terms.with_products(Product(word_q, pos_k, scale=scale),
                                    Product(pos_q, word_k, scale=scale))
    rng = module.make_rng("dropout") if dropout_rate > 0.0 else None
    return attention_fn(q, k, v, key_mask=key_mask, query_mask=query_mask, scale=scale,
                        block_q=block_size, block_k=block_size, block_terms=terms,
                        dropout_rate=dropout_rate, dropout_rng=rng)
