"""Each ``blocked.BlockTerms`` term inside the Pallas kernel (``posjax.kernels.flash``).

For every term a ``build_*`` function, run at trace time outside the kernel, turns the term's
arrays (in ``blocked``'s rows-first block layout) into small kernel operands, each with its
``BlockSpec`` over the kernel grid (batch, head, query block i, key block j), and returns a
static description whose ``logits(refs, ctx)`` computes the term's (bq, bk) fp32 block inside
the kernel. No operand is L × L: rows of length L (per head), tables of O(L·h·d) or smaller,
and scalars in SMEM.

* ``Product``: the sides' rows come in like q and k ((h, L, d) shared by the batch, or
  (B, h, L, d)); the [CLS] reset compares global positions (iota) with 0.
* ``RelativeBucketBias``: the bucket of each pair is computed in-kernel from the pair's
  coordinate difference r (text: kpos − qpos; a grid: per-axis coordinates, small int
  operands) as a static sum of steps, bucket(r) = bucket(r_min) + Σ_t Δ_t·[r ≥ r_t] (the
  change points of ``positions.t5_axes``' static bucket-per-difference table: exact, no log
  in the kernel), then the bias by a select-accumulate over the reachable buckets with the
  table in SMEM (no gather: Mosaic handles gathers badly).
* ``LinearBias``: −slope_h·|i − j| from iota; on a grid Σ_a |c_a[i] − c_a[j]| from per-token
  coordinates, 0 where a token has no position.
* ``Disentangled``: K_r and Q_r "by offset" (one row per offset r = i − j, O(L·h·d)), c2p's
  in key-minus-query order, p2c's in query-minus-key order, so that a block's W = bq + bk − 1
  offsets are consecutive rows; per block they are loaded (two block-aligned halves when
  bq = bk, else a ``pl.ds`` window of the per-head table), multiplied against the block's q
  (bq × W) and k (bk × W), and skewed into (bq, bk) by a per-row rotate (``pltpu.roll`` with
  stride 1: row a rotated by a + const) and a slice — see ``_skew``. Blocks whose offsets
  all fall in δ's clamp use blocked.py's shortcut: one row δ*, a column plus a row.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from posjax.layers import blocked as bl
from posjax.layers import positions

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Operands, the per-block context
# ---------------------------------------------------------------------------------------------

class Operands:
    """Collects the kernel's inputs: (array, BlockSpec) pairs; ``add`` returns the slot.
    ``geo``: blocked.py's plan (block_q, block_k, num_q, num_k, lq_pad, lk_pad)."""

    def __init__(self, geo: bl._Plan):
        self.geo = geo
        self.arrays: list[Array] = []
        self.specs: list[pl.BlockSpec] = []
        self.kinds: list[str] = []   # 'q' / 'k' rows, 'smem', 'column', 'row', 'window', 'mask'

    def add(self, x: Array, spec: pl.BlockSpec, kind: str = "window") -> int:
        self.arrays.append(x)
        self.specs.append(spec)
        self.kinds.append(kind)
        return len(self.arrays) - 1

    def rows(self, x: Array, side: str) -> int:
        """Per-head rows: (B, h, L, d) or (h, L, d) (shared by the batch), blocked along L by
        the query ('q') or key ('k') block."""
        n = self.geo.block_q if side == "q" else self.geo.block_k
        if x.ndim == 4:
            return self.add(x, pl.BlockSpec(
                (None, None, n, x.shape[-1]),
                (lambda b, h, i, j: (b, h, i, 0)) if side == "q" else
                (lambda b, h, i, j: (b, h, j, 0))), side)
        return self.add(x, pl.BlockSpec(
            (None, n, x.shape[-1]),
            (lambda b, h, i, j: (h, i, 0)) if side == "q" else (lambda b, h, i, j: (h, j, 0))),
            side)

    def column(self, x: Array) -> int:
        """Per-query-token values, (L, A) -> blocks (bq, A): a column per axis."""
        return self.add(x, pl.BlockSpec((self.geo.block_q, x.shape[1]),
                                        lambda b, h, i, j: (i, 0)), "column")

    def row(self, x: Array) -> int:
        """Per-key-token values, (A, L) -> blocks (A, bk): a row per axis."""
        return self.add(x, pl.BlockSpec((x.shape[0], self.geo.block_k),
                                        lambda b, h, i, j: (0, j)), "row")

    def scalars(self, x: Array) -> int:
        """A small fp32 vector read by scalar index (per head): whole, in SMEM."""
        return self.add(jnp.ravel(x).astype(jnp.float32),
                        pl.BlockSpec(memory_space=pltpu.SMEM), "smem")


@dataclasses.dataclass(frozen=True)
class Context:
    """What a term sees inside the kernel for one block: the loaded q (bq, d) and k (bk, d)
    of this (batch, head), the pairs' global positions qpos, kpos (bq, bk) int32, the head
    index h and block indices i, j (traced scalars)."""

    q: Array
    k: Array
    qpos: Array
    kpos: Array
    h: Array
    i: Array
    j: Array
    geo: bl._Plan


def nt(a: Array, b: Array) -> Array:
    """a (m, d) · b (n, d)ᵀ -> fp32 (m, n) (the dtypes promoted as XLA's einsum does)."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def nn(a: Array, b: Array) -> Array:
    """a (m, k) · b (k, n) -> fp32 (m, n) (fp32 operands)."""
    return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                               (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def tn(a: Array, b: Array) -> Array:
    """a (k, m)ᵀ · b (k, n) -> fp32 (m, n) (fp32 operands)."""
    return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                               (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# A term's gradient for the attention's own q (``q_grads``) or k (``k_grads``), not a slot.
SELF = -1


def to_heads_rows(x: Array) -> Array:
    """blocked's rows-first blocks (n, size, [B,] h, d) -> (h, L, d) or (B, h, L, d)."""
    n, size = x.shape[:2]
    x = x.reshape((n * size,) + x.shape[2:])
    return jnp.moveaxis(x, 0, -2)


# ---------------------------------------------------------------------------------------------
# Terms
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProductTerm:
    query_side: int
    key_side: int
    first_row: int | None
    first_col: int | None
    scale: float

    def logits(self, refs, ctx: Context) -> Array:
        t = nt(refs[self.query_side][...], refs[self.key_side][...])
        if self.scale != 1.0:
            t = t * self.scale
        if self.first_col is not None:
            t = jnp.where(ctx.kpos == 0, refs[self.first_col][ctx.h], t)
        if self.first_row is not None:
            t = jnp.where(ctx.qpos == 0, refs[self.first_row][ctx.h], t)
        return t


    def _own(self, ctx: Context, ds: Array) -> Array:
        """ds where the product itself is the logit (not the [CLS] reset), · scale."""
        if self.first_col is not None:
            ds = jnp.where(ctx.kpos == 0, 0.0, ds)
        if self.first_row is not None:
            ds = jnp.where(ctx.qpos == 0, 0.0, ds)
        return ds * self.scale if self.scale != 1.0 else ds

    def q_grads(self, refs, ctx: Context, ds: Array) -> list[tuple[int, Array]]:
        return [(self.query_side, nn(self._own(ctx, ds), refs[self.key_side][...]))]

    def k_grads(self, refs, ctx: Context, ds: Array) -> list[tuple[int, Array]]:
        return [(self.key_side, tn(self._own(ctx, ds), refs[self.query_side][...]))]

    @property
    def scalar_targets(self) -> tuple[tuple[int, int], ...]:
        """(SMEM slot, base) of each value of ``scalar_grads``: it is d slot[base + h]."""
        return tuple((slot, 0) for slot in (self.first_row, self.first_col) if slot is not None)

    def scalar_grads(self, refs, ctx: Context, ds: Array) -> list[Array]:
        out = []
        if self.first_row is not None:
            out.append(jnp.sum(jnp.where(ctx.qpos == 0, ds, 0.0)))
        if self.first_col is not None:
            won = ctx.kpos == 0 if self.first_row is None else (ctx.kpos == 0) & (ctx.qpos != 0)
            out.append(jnp.sum(jnp.where(won, ds, 0.0)))
        return out


def build_product(p: bl.Product, ops: Operands) -> ProductTerm:
    return ProductTerm(
        ops.rows(to_heads_rows(p.query_side), "q"), ops.rows(to_heads_rows(p.key_side), "k"),
        None if p.first_row is None else ops.scalars(p.first_row),
        None if p.first_col is None else ops.scalars(p.first_col), float(p.scale))


def _steps(by_diff: np.ndarray, offset: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """A static integer function of the difference r (table ``by_diff`` at r + offset) as
    base + Σ_t Δ_t·[r ≥ r_t] over its change points; exact for every r in the table, and
    constant beyond its ends."""
    change = np.nonzero(by_diff[1:] != by_diff[:-1])[0] + 1
    return int(by_diff[0]), tuple((int(t - offset), int(by_diff[t] - by_diff[t - 1]))
                                  for t in change)


@dataclasses.dataclass(frozen=True)
class BucketTerm:
    # per axis: (query coordinate slot, key coordinate slot) or None (text: the position),
    # and the bucket's steps (base, ((threshold, delta), …))
    axes: tuple[tuple[tuple[int, int] | None, tuple[int, tuple[tuple[int, int], ...]]], ...]
    buckets: tuple[tuple[int, ...], ...]   # per axis: the buckets that can occur
    table: int                              # SMEM (A · rows · h,): table[a, bucket, h]
    rows: int
    heads: int
    num_buckets: int
    untie_cls: bool

    def _bucket(self, refs, ctx: Context, a: int) -> Array:
        """Axis a's bucket of every pair of the block, (bq, bk) int32."""
        coords, (base, steps) = self.axes[a]
        if coords is None:
            r = ctx.kpos - ctx.qpos
        else:
            r = refs[coords[1]][a:a + 1, :] - refs[coords[0]][:, a:a + 1]   # (bq, bk)
        bucket = jnp.full(r.shape, base, jnp.int32)
        for threshold, delta in steps:
            bucket = bucket + jnp.where(r >= threshold, delta, 0)
        if self.untie_cls:
            bucket = jnp.where(ctx.kpos == 0, self.num_buckets, bucket)
            bucket = jnp.where(ctx.qpos == 0, self.num_buckets // 2, bucket)
        return bucket

    def logits(self, refs, ctx: Context) -> Array:
        total = None
        for a in range(len(self.axes)):
            bucket = self._bucket(refs, ctx, a)
            bias = jnp.zeros(bucket.shape, jnp.float32)
            for b in self.buckets[a]:
                value = refs[self.table][(a * self.rows + b) * self.heads + ctx.h]
                bias = jnp.where(bucket == b, value, bias)
            total = bias if total is None else total + bias
        return total

    def q_grads(self, refs, ctx: Context, ds: Array) -> list[tuple[int, Array]]:
        return []

    k_grads = q_grads

    @property
    def scalar_targets(self) -> tuple[tuple[int, int], ...]:
        return tuple((self.table, (a * self.rows + b) * self.heads)
                     for a in range(len(self.axes)) for b in self.buckets[a])

    def scalar_grads(self, refs, ctx: Context, ds: Array) -> list[Array]:
        """d table[a, b, h] = Σ of ds over the block's pairs in bucket b of axis a."""
        out = []
        for a in range(len(self.axes)):
            bucket = self._bucket(refs, ctx, a)
            out.extend(jnp.sum(jnp.where(bucket == b, ds, 0.0)) for b in self.buckets[a])
        return out


def build_bucket_bias(t: bl.RelativeBucketBias, ops: Operands) -> BucketTerm:
    geo = ops.geo
    axes = positions.t5_axes(t.num_buckets, t.max_distance, t.untie_cls, t.grid,
                             max(geo.lq_pad, geo.lk_pad))
    specs, reachable = [], []
    coord_slots = None
    if t.grid is not None:   # per-token coordinates of every axis: (L, A) and (A, L) int32
        coords = np.stack([c for c, _, _ in axes]).astype(np.int32)   # (A, Lpad)
        coord_slots = (ops.column(jnp.asarray(coords[:, :geo.lq_pad].T)),
                       ops.row(jnp.asarray(coords[:, :geo.lk_pad])))
    for coords, by_diff, offset in axes:
        specs.append((coord_slots, _steps(by_diff, offset)))
        extra = (t.num_buckets // 2, t.num_buckets) if t.untie_cls else ()
        reachable.append(tuple(sorted(set(by_diff.tolist()) | set(extra))))
    table = t.table.astype(jnp.float32)   # (A, rows, h)
    return BucketTerm(tuple(specs), tuple(reachable), ops.scalars(table), table.shape[1],
                      table.shape[2], t.num_buckets, t.untie_cls)


@dataclasses.dataclass(frozen=True)
class LinearTerm:
    slopes: int
    coords: tuple[int, int] | None       # (query (L, A) f32, key (A, L) f32) or None: text
    positioned: tuple[int, int] | None   # (query (L, 1), key (1, L)) int32
    axes: int

    def _distance(self, refs, ctx: Context) -> Array:
        if self.coords is None:
            return jnp.abs(ctx.qpos - ctx.kpos).astype(jnp.float32)
        cq, ck = refs[self.coords[0]], refs[self.coords[1]]
        dist = None
        for a in range(self.axes):
            d = jnp.abs(cq[:, a:a + 1] - ck[a:a + 1, :])
            dist = d if dist is None else dist + d
        both = (refs[self.positioned[0]][...] != 0) & (refs[self.positioned[1]][...] != 0)
        return jnp.where(both, dist, 0.0)

    def logits(self, refs, ctx: Context) -> Array:
        return -refs[self.slopes][ctx.h] * self._distance(refs, ctx)

    def q_grads(self, refs, ctx: Context, ds: Array) -> list[tuple[int, Array]]:
        return []   # the coordinates are constants (no gradient)

    k_grads = q_grads

    @property
    def scalar_targets(self) -> tuple[tuple[int, int], ...]:
        return ((self.slopes, 0),)

    def scalar_grads(self, refs, ctx: Context, ds: Array) -> list[Array]:
        return [-jnp.sum(ds * self._distance(refs, ctx))]


def build_linear_bias(t: bl.LinearBias, ops: Operands) -> LinearTerm:
    geo = ops.geo
    slopes = ops.scalars(t.slopes)
    if t.coords is None:
        return LinearTerm(slopes, None, None, 1)

    def pad(x: Array, n: int) -> Array:   # padded tokens take the last token's entries
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])], mode="edge")

    coords = t.coords.astype(jnp.float32)
    positioned = (jnp.ones(coords.shape[1:], bool) if t.positioned is None
                  else t.positioned).astype(jnp.int32)
    return LinearTerm(
        slopes, (ops.column(pad(coords, geo.lq_pad).T), ops.row(pad(coords, geo.lk_pad))),
        (ops.column(pad(positioned, geo.lq_pad)[:, None]),
         ops.row(pad(positioned, geo.lk_pad)[None])), coords.shape[0])


def _reverse_rows(x: Array) -> Array:
    """x (n, m) with its rows in reverse order, fp32, exactly: the exchange matrix (0/1, exact
    in bf16) times x split into three bf16 parts (x = x1 + x2 + x3 exactly; each product
    exact) — three single-pass MXU products (Mosaic has no reverse)."""
    n = x.shape[0]
    rows, cols = (jax.lax.broadcasted_iota(jnp.int32, (n, n), d) for d in (0, 1))
    exchange = (rows + cols == n - 1).astype(jnp.bfloat16)
    rest, out = x.astype(jnp.float32), None
    for _ in range(3):
        part = rest.astype(jnp.bfloat16)
        rest = rest - part.astype(jnp.float32)
        flipped = jax.lax.dot_general(exchange, part, (((1,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
        out = flipped if out is None else out + flipped
    return out


def _turned(g: Array, width: int) -> Array:
    """``_skew``'s transpose up to row order: g (n, cols) -> (n, width) with
    out[n − 1 − a, c + (n − 1 − a)] = g[a, c], 0 elsewhere. The transpose must turn row a by
    n − 1 − a (``_skew`` turns it by a + const, and Mosaic's strided roll only counts up):
    reversed, row a' = n − 1 − a is turned by a' (``pltpu.roll`` stride 1). So for the
    gradients, with J the row reversal, unskew(g) = J·turned(g): unskew(g)·W =
    J·(turned(g)·W) and unskew(g)ᵀ·x = turned(g)ᵀ·(J·x), reversing only (n, d) and (n, cols)
    arrays (``_reverse_rows``)."""
    n, cols = g.shape
    g = jnp.concatenate([_reverse_rows(g), jnp.zeros((n, width - cols), jnp.float32)], axis=1)
    return pltpu.roll(g, 0, 1, stride=1, stride_axis=0)


def _skew(s: Array, cols: int) -> Array:
    """The relative shift, Mosaic-friendly: s (n, Wp), Wp ≥ n + cols − 1 -> (n, cols) with
    out[a, c] = s[a, c + (n − 1 − a)]. ``pltpu.roll`` with stride 1 along rows rotates row a
    by shift + a (jnp.roll's direction: out[a, c] = s[a, (c − shift − a) mod Wp]), so
    shift = Wp − n + 1 gives (c + n − 1 − a) mod Wp = c + n − 1 − a (it lies in [0, Wp))."""
    n, width = s.shape
    return pltpu.roll(s, width - n + 1, 1, stride=1, stride_axis=0)[:, :cols]


@dataclasses.dataclass(frozen=True)
class DisentangledTerm:
    # c2p: K_r by key-minus-query offset m = j − i (row m + Lq_pad − 1); p2c: Q_r by
    # query-minus-key offset r = i − j (row r + Lk_pad − 1). Each: one slot (h, R, d) whole
    # per head (``pl.ds`` window) or two slots of block-aligned halves (block_q = block_k).
    c2p: tuple[int, ...] | None
    p2c: tuple[int, ...] | None
    aligned: bool
    far: tuple[int, int] | None   # (r_low, r_high) when some block is all-clamped, else None
    scale: float

    def _window(self, refs, slots: tuple[int, ...], start: Array, width: int) -> Array:
        if self.aligned:
            return jnp.concatenate([refs[slots[0]][...], refs[slots[1]][...]], axis=0)
        return refs[slots[0]][pl.ds(start, width), :]

    def _windows(self, refs, ctx: Context) -> tuple[Array | None, Array | None]:
        """The block's W + 1 rows of K_r (c2p) and Q_r (p2c) by offset, (bq + bk, d) each."""
        geo = ctx.geo
        bq, bk = geo.block_q, geo.block_k
        width = bq + bk   # W = bq + bk − 1 offsets, and one more row (unused) for alignment
        qs, ks = ctx.i * bq, ctx.j * bk
        align = int(np.gcd(bq, bk))
        c2p_rows = p2c_rows = None
        if self.c2p is not None:   # m0 = ks − qs − (bq − 1) at row m0 + Lq_pad − 1
            start = pl.multiple_of(ks + (geo.num_q - 1) * bq - qs, align)
            c2p_rows = self._window(refs, self.c2p, start, width)
        if self.p2c is not None:   # r0 = qs − ks − (bk − 1) at row r0 + Lk_pad − 1
            start = pl.multiple_of(qs + (geo.num_k - 1) * bk - ks, align)
            p2c_rows = self._window(refs, self.p2c, start, width)
        return c2p_rows, p2c_rows

    def _banded(self, ctx: Context, band: Callable[[], Any], far: Callable[[], Any]) -> Any:
        """band() for a block whose offsets pick several rows; far() (blocked.py's shortcut:
        every window row is δ*) for one whose offsets all lie in δ's clamp."""
        if self.far is None:
            return band()
        r_low, r_high = self.far
        bq, bk = ctx.geo.block_q, ctx.geo.block_k
        r_first = ctx.i * bq - ctx.j * bk - (bk - 1)
        r_last = ctx.i * bq - ctx.j * bk + (bq - 1)
        return jax.lax.cond((r_last <= r_low) | (r_first >= r_high), far, band)

    def logits(self, refs, ctx: Context) -> Array:
        bq, bk = ctx.geo.block_q, ctx.geo.block_k
        c2p_rows, p2c_rows = self._windows(refs, ctx)

        def band() -> Array:
            total = jnp.zeros((bq, bk), jnp.float32)
            if c2p_rows is not None:   # c2p[a, c] = q[a]·K_r[δ(−m0 − (c − a + bq − 1))]
                total = total + _skew(nt(ctx.q, c2p_rows), bk)
            if p2c_rows is not None:   # p2c[a, c] = k[c]·Q_r[δ(r0 + a − c + bk − 1)]
                total = total + _skew(nt(ctx.k, p2c_rows), bq).T
            return total

        def far() -> Array:   # every window row is δ*: a column plus a row
            total = jnp.zeros((bq, bk), jnp.float32)
            if c2p_rows is not None:
                row = c2p_rows[0:1, :]
                dtype = jnp.promote_types(ctx.q.dtype, row.dtype)
                total = total + jnp.sum(ctx.q.astype(dtype).astype(jnp.float32)
                                        * row.astype(dtype).astype(jnp.float32),
                                        axis=1, keepdims=True)
            if p2c_rows is not None:   # an 8-row matmul (sublane tile), its first row
                rows8 = jnp.broadcast_to(p2c_rows[0:1, :], (8, p2c_rows.shape[1]))
                total = total + nt(rows8, ctx.k)[0:1, :]
            return total

        return self._banded(ctx, band, far) * self.scale

    # Backward (``posjax.kernels.backward``), g = ds·scale: c2p = skew(q·Wcᵀ) gives
    # dq = unskew(g)·Wc and dWc = unskew(g)ᵀ·q; p2c = skew(k·Wpᵀ)ᵀ gives dk = unskew(gᵀ)·Wp and
    # dWp = unskew(gᵀ)ᵀ·k (each unskew as ``_turned``); in a far block the row sums of g
    # (gᵀ) times the row δ*.

    def q_grads(self, refs, ctx: Context, ds: Array) -> list[tuple[int, Array]]:
        if self.c2p is None:
            return []
        rows = self._windows(refs, ctx)[0]
        g = ds * self.scale
        return [(SELF, self._banded(
            ctx, lambda: _reverse_rows(nn(_turned(g, rows.shape[0]), rows)),
            lambda: jnp.sum(g, axis=1, keepdims=True) * rows[0:1, :].astype(jnp.float32)))]

    def k_grads(self, refs, ctx: Context, ds: Array) -> list[tuple[int, Array]]:
        if self.p2c is None:
            return []
        rows = self._windows(refs, ctx)[1]
        g = (ds * self.scale).T
        return [(SELF, self._banded(
            ctx, lambda: _reverse_rows(nn(_turned(g, rows.shape[0]), rows)),
            lambda: jnp.sum(g, axis=1, keepdims=True) * rows[0:1, :].astype(jnp.float32)))]

    scalar_targets = ()

    def scalar_grads(self, refs, ctx: Context, ds: Array) -> list[Array]:
        return []

    def window_grads(self, refs, ctx: Context, ds: Array) -> tuple[Array | None, Array | None]:
        """d of the block's (bq + bk, d) windows of K_r (c2p) and Q_r (p2c) by offset."""
        geo = ctx.geo
        width = geo.block_q + geo.block_k
        g = ds * self.scale
        out = []
        for slots, side, grad in ((self.c2p, ctx.q, g), (self.p2c, ctx.k, g.T)):
            if slots is None:
                out.append(None)
                continue

            def far(side=side, grad=grad) -> Array:   # all into the window's first row
                first = tn(jnp.sum(grad, axis=1, keepdims=True), side)          # (1, d)
                rows = jax.lax.broadcasted_iota(jnp.int32, (width, side.shape[1]), 0)
                return jnp.where(rows == 0, first, 0.0)

            out.append(self._banded(ctx, lambda side=side, grad=grad: tn(
                _turned(grad, width), _reverse_rows(side)), far))
        return out[0], out[1]


def build_disentangled(t: bl.Disentangled, q_dtype: Any, ops: Operands) -> DisentangledTerm:
    geo = ops.geo
    bq, bk = geo.block_q, geo.block_k
    by_offset = positions.deberta_offset_rows(t.span, t.bucket_size, t.max_position,
                                              geo.lq_pad, geo.lk_pad)   # r + Lk_pad − 1
    aligned = bq == bk and geo.num_q == geo.num_k
    total_rows = (geo.num_q + geo.num_k) * bq if aligned else \
        -(-(geo.lq_pad + geo.lk_pad) // 8) * 8

    def table(rel: Array | None, order: np.ndarray, side: str) -> tuple[int, ...] | None:
        if rel is None:
            return None
        x = rel.astype(jnp.promote_types(q_dtype, rel.dtype))[order]        # (rows, h, d)
        x = jnp.pad(jnp.moveaxis(x, 1, 0), ((0, 0), (0, total_rows - x.shape[0]), (0, 0)))
        if not aligned:   # whole per head, a pl.ds window per block
            return (ops.add(x, pl.BlockSpec((None, total_rows, x.shape[-1]),
                                            lambda b, h, i, j: (h, 0, 0))),)
        n = geo.num_q   # = num_k: the window starts at block (j + n − i − 1) (c2p), or
        first = ((lambda b, h, i, j: (h, j + n - i - 1, 0)) if side == "c2p"   # (i + n − j − 1)
                 else (lambda b, h, i, j: (h, i + n - j - 1, 0)))
        second = ((lambda b, h, i, j: (h, j + n - i, 0)) if side == "c2p"
                  else (lambda b, h, i, j: (h, i + n - j, 0)))
        return tuple(ops.add(x, pl.BlockSpec((None, bq, x.shape[-1]), index))
                     for index in (first, second))

    far = None
    r_low, r_high = positions.clamped_offsets(by_offset, geo.lk_pad)
    starts = np.arange(geo.num_q)[:, None] * bq - np.arange(geo.num_k)[None, :] * bk
    if np.any((starts + bq - 1 <= r_low) | (starts - (bk - 1) >= r_high)):
        far = (int(r_low), int(r_high))
    return DisentangledTerm(table(t.rel_key, by_offset[::-1].copy(), "c2p"),
                            table(t.rel_query, by_offset, "p2c"), aligned, far,
                            float(t.scale))


def build_terms(terms: bl.BlockTerms, q_dtype: Any, ops: Operands) -> list[Any]:
    """Every term of ``terms`` (arrays in blocked's layout) -> its in-kernel description (its
    ``logits`` and gradients), in blocked's summation order (products, T5, ALiBi, DeBERTa)."""
    out: list[Any] = [build_product(p, ops) for p in terms.products]
    if terms.relative_bias is not None:
        out.append(build_bucket_bias(terms.relative_bias, ops))
    if terms.linear_bias is not None:
        out.append(build_linear_bias(terms.linear_bias, ops))
    if terms.disentangled is not None:
        out.append(build_disentangled(terms.disentangled, q_dtype, ops))
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the kernels find q, k, v and the masks among the operands, and the terms."""

    q: int
    k: int
    v: int
    query_mask: int
    key_mask: int
    terms: tuple[Any, ...]


def operands(plan: bl._Plan, qr, kr, vb, shared, km, qm) -> tuple[Operands, Layout]:
    """blocked.py's block layout (``blocked.prepare``) -> the kernels' operands: q, k, v as
    (B, h, L, d) rows, the masks as (B|1, L, 1) / (B|1, 1, L) int32, every term's inputs."""
    ops = Operands(plan)
    q_slot = ops.rows(to_heads_rows(qr[0]), "q")   # (B, h, L, d)
    k_slot = ops.rows(to_heads_rows(kr[0]), "k")
    v_slot = ops.rows(to_heads_rows(vb), "k")

    def mask(m: Array, side: str) -> int:   # (count, B|1, size) -> (B|1, L, 1) / (B|1, 1, L)
        m = jnp.swapaxes(m, 0, 1).reshape(m.shape[1], -1).astype(jnp.int32)
        per_batch = m.shape[0] > 1
        if side == "q":
            return ops.add(m[:, :, None], pl.BlockSpec(
                (None, plan.block_q, 1), lambda b, h, i, j: (b if per_batch else 0, i, 0)),
                "mask")
        return ops.add(m[:, None, :], pl.BlockSpec(
            (None, 1, plan.block_k), lambda b, h, i, j: (b if per_batch else 0, 0, j)), "mask")

    qm_slot, km_slot = mask(qm, "q"), mask(km, "k")
    it = {"q": iter(qr[1:]), "k": iter(kr[1:]), "s": iter(shared)}
    terms: bl.BlockTerms = jax.tree.unflatten(plan.treedef, [next(it[r]) for r in plan.roles])
    built = build_terms(terms, qr[0].dtype, ops)
    return ops, Layout(q_slot, k_slot, v_slot, qm_slot, km_slot, tuple(built))


def logits(ins, ctx: Context, layout: Layout) -> Array:
    """s = q·k·scale + Σ terms for the block, fp32 (bq, bk); the pairs it may not see: −inf."""
    s = nt(ctx.q, ctx.k) * ctx.geo.scale
    for term in layout.terms:
        s = s + term.logits(ins, ctx)
    visible = (ins[layout.query_mask][...] != 0) & (ins[layout.key_mask][...] != 0)
    return jnp.where(visible, s, -jnp.inf)


def context(ins, layout: Layout, geo: bl._Plan, h: Array, i: Array, j: Array) -> Context:
    """The block (i, j) of head h: its q, k and the pairs' global positions."""
    shape = (geo.block_q, geo.block_k)
    qpos = i * geo.block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    kpos = j * geo.block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return Context(ins[layout.q][...], ins[layout.k][...], qpos, kpos, h, i, j, geo)
