"""Each additive position term's logits, defined once (docs/design.md §3).

Pure functions of position index arrays, called by both attention paths: the plain path
passes every position 0…L−1 (static numpy, so the index arithmetic is done at trace time and
XLA sees constants), the blocked path (``blocked``) one block's query and key positions
(traced int32). The index arithmetic they use (T5 buckets, DeBERTa's δ, the [CLS] reset) is
in ``positions``. Every result is fp32.

* ``product_logits`` + ``positions.reset_cls``: TUPE's untied positions (θ1, θ2 from
  ``tupe_cls_logits``) and BERT-A-d's mixed word/position terms.
* ``t5_logits``: Σ_axes table[a, bucket, h] for ``positions.t5_pair_buckets`` buckets.
* ``alibi_logits``: −slope_h · Σ_a |c_a[i] − c_a[j]|.
* ``disentangled_logits``: DeBERTa's c2p and p2c over a window of offsets
  (``positions.offset_window``), by the relative shift (``skew``).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posjax.layers.positions import Index, reset_cls

Array = jax.Array


def product_logits(query_side: Array, key_side: Array, scale: float = 1.0,
                   batch_first: bool = False) -> Array:
    """t[(b,) h, i, j] = query_side[i]·key_side[j] · scale -> fp32 (h, nq, nk), or
    (B, h, nq, nk) when a side has a batch axis.

    Each side is (n, h, d) (shared by the batch) or batched: (n, B, h, d) (rows first, the
    blocked path's layout) or, with ``batch_first``, (B, n, h, d)."""
    def spec(x: Array, rows: str) -> str:
        if x.ndim == 3:
            return rows + "hd"
        return ("b" + rows if batch_first else rows + "b") + "hd"

    out = "bhqk" if 4 in (query_side.ndim, key_side.ndim) else "hqk"
    t = jnp.einsum(f"{spec(query_side, 'q')},{spec(key_side, 'k')}->{out}", query_side,
                   key_side, preferred_element_type=jnp.float32)
    return t if scale == 1.0 else t * scale


def tupe_cls_logits(query_side: Array, key_side: Array) -> tuple[Array, Array]:
    """TUPE's untied [CLS] logits from the position sides of table rows 0 ([CLS]) and 1 (token
    0's own row), each (≥2, h, d): θ1 = A[0, 0] = q[0]·k[0] (the [CLS] row) and θ2 = A[1, 1] =
    q[1]·k[1] (the [CLS] column), (h,) each (Ke et al. 2021, §3.2)."""
    theta = jnp.einsum("nhd,nhd->nh", query_side[:2], key_side[:2],
                       preferred_element_type=jnp.float32)
    return theta[0], theta[1]


def untied_logits(query_side: Array, key_side: Array, query_positions: Index,
                  key_positions: Index, first_row: Array | None, first_col: Array | None,
                  scale: float = 1.0) -> Array:
    """TUPE's untied term for queries at ``query_positions`` (nq,) and keys at
    ``key_positions`` (nk,): ``product_logits`` of the rows-first sides, then column 0 → θ2
    (``first_col``, (h,)) and row 0 → θ1 (``first_row``), the row winning at [0, 0]
    (``positions.reset_cls``; None: that line kept) -> fp32 ([B,] h, nq, nk)."""
    def per_head(theta: Array | None) -> Array | None:
        return None if theta is None else theta.astype(jnp.float32)[:, None, None]

    return reset_cls(product_logits(query_side, key_side, scale), query_positions,
                     key_positions, per_head(first_row), per_head(first_col))


def t5_logits(table: Array, buckets: Sequence[Index]) -> Array:
    """T5 relative bias b[h, i, j] = Σ_a table[a, buckets[a][i, j], h] (not scaled): table
    (A, num_buckets [+1], h), buckets one (nq, nk) per axis (``positions.t5_pair_buckets``)
    -> fp32 (h, nq, nk)."""
    total = None
    for a, bucket in enumerate(buckets):
        term = jnp.take(table[a].astype(jnp.float32), bucket, axis=0)   # (nq, nk, h)
        total = term if total is None else total + term
    return jnp.transpose(total, (2, 0, 1))


def alibi_logits(slopes: Array, query_coords: Sequence[Index], key_coords: Sequence[Index],
                 query_positioned: Index | None = None,
                 key_positioned: Index | None = None) -> Array:
    """ALiBi for a bidirectional encoder: b[h, i, j] = −slopes[h] · Σ_a |cq_a[i] − ck_a[j]|
    -> fp32 (h, nq, nk), 0 for a pair with a token without a position ([CLS]; given by
    ``*_positioned`` (n,) bool, or None: all positioned). One (n,) coordinate array per axis
    (text: the token index; a grid: row and column, the Manhattan distance); slopes (h,)
    (``positions.alibi_slopes``)."""
    dist = None
    for cq, ck in zip(query_coords, key_coords):
        d = jnp.abs(jnp.asarray(cq, jnp.float32)[:, None] - jnp.asarray(ck, jnp.float32)[None])
        dist = d if dist is None else dist + d
    if query_positioned is not None:
        both = jnp.asarray(query_positioned)[:, None] & jnp.asarray(key_positioned)[None]
        dist = jnp.where(both, dist, 0.0)
    return -jnp.asarray(slopes, jnp.float32)[:, None, None] * dist[None]


def skew(s: Array, cols: int) -> Array:
    """The relative shift: (…, n, W) -> (…, n, cols) with out[r, c] = s[r, (n − 1 − r) + c]
    (needs W >= n − 1 + cols): in the flat (n·W) view that element sits at (n − 1) +
    r·(W − 1) + c, so one slice and a reshape to rows of W − 1 place it — no gather (its
    gradient is a pad)."""
    if s.shape[-1] - 1 < cols:   # a single row (n = 1): room for the reshape below
        s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, cols + 1 - s.shape[-1])])
    n, width = s.shape[-2:]
    flat = s.reshape(s.shape[:-2] + (n * width,))[..., n - 1: n - 1 + n * (width - 1)]
    return flat.reshape(s.shape[:-2] + (n, width - 1))[..., :cols]


def relative_shift(content: Array, rows: Array, cols: int, batch_first: bool) -> Array:
    """out[b, h, a, c] = content[a]·rows[(n − 1 − a) + c] -> fp32 (B, h, n, cols): content
    (n, B, h, d) (or (B, n, h, d) with ``batch_first``), rows (W, h, d), W = n + cols − 1;
    one (n, W) product per head, then ``skew``."""
    spec = "bqhd,whd->bhqw" if batch_first else "qbhd,whd->bhqw"
    return skew(jnp.einsum(spec, content, rows, preferred_element_type=jnp.float32), cols)


def disentangled_logits(query: Array, key: Array, rel_key: Array | None,
                        rel_query: Array | None, window: Index, batch_first: bool = False
                        ) -> tuple[Array | None, Array | None]:
    """DeBERTa's position terms for a block of nq queries and nk keys, not scaled:

        c2p[a, c] = Q_c[a]·K_r[δ(i_a − j_c)],  p2c[a, c] = K_c[c]·Q_r[δ(i_a − j_c)]

    (the same δ for both, as the official code), each fp32 (B, h, nq, nk), or None for a
    missing table. query (nq, B, h, d) and key (nk, B, h, d) (or (B, n, h, d) with
    ``batch_first``): the content projections; rel_key K_r, rel_query Q_r: (2·span, h, d)
    projected relative tables; window: the δ rows of the W = nq + nk − 1 offsets the block
    spans, increasing (``positions.offset_window``). Pair (a, c) has offset index
    w = a − c + nk − 1: c2p is ``relative_shift`` against the window reversed, p2c the
    transposed ``relative_shift`` of the keys against it.
    """
    n_axis = 1 if batch_first else 0
    nq, nk = query.shape[n_axis], key.shape[n_axis]
    c2p = p2c = None
    if rel_key is not None:   # c2p[a, c] = s[a, (nq − 1 − a) + c] for s against δ reversed
        c2p = relative_shift(query, rel_key[window[::-1]], nk, batch_first)
    if rel_query is not None:   # p2c[a, c] = s[c, (nk − 1 − c) + a], s against δ
        p2c = jnp.swapaxes(relative_shift(key, rel_query[window], nq, batch_first), -1, -2)
    return c2p, p2c
