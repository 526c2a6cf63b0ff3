"""Additive position terms computed once per forward and shared by every layer.

* ``T5RelativeBias``: b[h, i, j] = table[bucket(j − i), h] (BERT-R, TUPE-R; not scaled).
* ``alibi_bias``: b[h, i, j] = −slope_h · |i − j| (ALiBi, symmetric; no parameters).
* ``TupePositionBias``: TUPE's untied absolute correlation (Ke et al. 2021, Eq. 6 and §3.2):
  A = (LN(P) U_Q)(LN(P) U_K)ᵀ / √(2d), with the [CLS] row/column reset to θ1/θ2; for the
  BERT-A-d ablation also the position sides of its two mixed word/position terms.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax.layers import blocked, positions
from posjax.layers.attention import DEFAULT_INIT, Dense, LayerNorm, dense, layer_norm

Array = jax.Array


class T5RelativeBias(nn.Module):
    """(h, L, L) bias from a (axes, buckets [+1], h) table; one axis for text, two for a grid."""

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    untie_cls: bool = False
    grid: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, length: int) -> Array:
        buckets = positions.t5_bucket_matrix(length, self.num_buckets, self.max_distance,
                                             self.untie_cls, self.grid)
        rows = self.num_buckets + (1 if self.untie_cls else 0)
        table = self.param("rel_bias", nn.with_logical_partitioning(
            DEFAULT_INIT, (None, None, "heads")), (len(buckets), rows, self.num_heads), jnp.float32)
        bias = sum(jnp.take(table[a], b, axis=0) for a, b in enumerate(buckets))   # (L, L, h)
        return jnp.transpose(bias, (2, 0, 1))

    def block_terms(self, length: int) -> blocked.RelativeBucketBias:
        """``__call__(length)`` un-materialised, for the blocked path: the (axes, buckets [+1],
        h) table and the static bucketing; bias[h, i, j] is formed per block."""
        if not self.has_variable("params", "rel_bias"):   # init: __call__ creates the table
            self(1 if self.grid is None else length)
        return blocked.RelativeBucketBias(
            nn.unbox(self.get_variable("params", "rel_bias")), self.num_buckets,
            self.max_distance, self.untie_cls, self.grid)


def alibi_bias(num_heads: int, coords: list[np.ndarray], positioned: np.ndarray) -> Array:
    """ALiBi for a bidirectional encoder: b[h, i, j] = −slope_h · Σ_a |c_a[i] − c_a[j]|, (h, L, L)
    fp32 (text: |i − j|; a grid: the Manhattan distance between patches), 0 for pairs with a
    token without a position ([CLS]). Slopes: ``positions.alibi_slopes``. Built from (L,)
    coordinates at run time, so no L × L constant is embedded in the program."""
    distance = sum(jnp.abs(jnp.asarray(c, jnp.float32)[:, None] - jnp.asarray(c, jnp.float32)[None])
                   for c in coords)
    if not positioned.all():
        both = jnp.asarray(positioned)[:, None] & jnp.asarray(positioned)[None]
        distance = jnp.where(both, distance, 0.0)
    slopes = jnp.asarray(positions.alibi_slopes(num_heads))
    return -slopes[:, None, None] * distance[None]


class TupePositionBias(nn.Module):
    """TUPE positional correlation from a (max_len + 1, H) table -> {'bias': (h, L, L)}.

    P = LN(table[:L+1]); A = (P U_Q + b_Q)(P U_K + b_K)ᵀ · ``logit_scale`` per head,
    (h, L+1, L+1), 1/√(2d) by default. Token i uses table row i + 1; with ``untie_cls`` the
    result's row 0 is θ1 = A[0, 0] and its column 0 is θ2 = A[1, 1] (row wins at [0, 0]).

    ``mixed_terms`` (BERT-A-d): also the position sides of the word-to-position and
    position-to-word terms, shared by every layer like A: 'position_query' P Ũ_Q + b and
    'position_key' P Ũ_K + b, each (L, h, d) for tokens 0…L−1 (rows 1…L), not scaled.
    """

    num_heads: int
    head_dim: int
    max_len: int
    eps: float = 1e-5
    untie_cls: bool = True
    logit_scale: float | None = None
    mixed_terms: bool = False

    @nn.compact
    def __call__(self, length: int) -> dict[str, Array]:
        if length > self.max_len:
            raise ValueError(f"length {length} exceeds max_len={self.max_len} positions of the "
                             "table: truncate the inputs or enlarge the table")
        hidden = self.num_heads * self.head_dim
        table = self.param("position_embeddings", nn.with_logical_partitioning(
            DEFAULT_INIT, ("pos", "embed")), (self.max_len + 1, hidden), jnp.float32)
        p = layer_norm(self.eps, name="norm", dtype=jnp.float32)(table[: length + 1])
        hd = (self.num_heads, self.head_dim)

        def project(name: str, rows: Array = p) -> Array:
            return dense(hd, ("embed", "heads", "kv"), name=name, dtype=jnp.float32)(rows)

        scale = (2 * self.head_dim) ** -0.5 if self.logit_scale is None else self.logit_scale
        a = jnp.einsum("qhd,khd->hqk", project("query") * scale, project("key"))
        b = a[:, 1:, 1:]
        if self.untie_cls:
            first = np.arange(length) == 0
            b = jnp.where(first[None, None, :], a[:, 1, 1][:, None, None], b)   # column 0: θ2
            b = jnp.where(first[None, :, None], a[:, 0, 0][:, None, None], b)   # row 0: θ1
        terms = {"bias": b}
        if self.mixed_terms:
            terms["position_query"] = project("query_for_words", p[1:])
            terms["position_key"] = project("key_for_words", p[1:])
        return terms

    def block_terms(self, length: int) -> dict[str, Any]:
        """``__call__(length)`` un-materialised, for the blocked path: {'untied':
        ``blocked.Product``(Pq, Pk, θ1, θ2)} with Pq = (P U_Q + b)·scale and Pk = P U_K + b
        for tokens 0…L−1 (table rows 1…L), (L, h, d) each, and θ1 = A[0, 0], θ2 = A[1, 1]
        per head (None with a tied [CLS]); with ``mixed_terms`` also 'position_query' and
        'position_key' as ``__call__``. The same parameters, read through ``__call__``'s
        submodules' parameter names."""
        if length > self.max_len:
            raise ValueError(f"length {length} exceeds max_len={self.max_len} positions of the "
                             "table: truncate the inputs or enlarge the table")
        if not self.has_variable("params", "position_embeddings"):   # init: __call__ creates
            self(1)
        params = nn.unbox(self.variables["params"])
        p = LayerNorm(self.eps, jnp.float32, parent=None).apply(
            {"params": params["norm"]}, params["position_embeddings"][: length + 1])
        hd = (self.num_heads, self.head_dim)

        def project(name: str, rows: Array = p) -> Array:
            return Dense(hd, ("embed", "heads", "kv"), dtype=jnp.float32, parent=None).apply(
                {"params": params[name]}, rows)

        scale = (2 * self.head_dim) ** -0.5 if self.logit_scale is None else self.logit_scale
        pq, pk = project("query") * scale, project("key")
        first_row = first_col = None
        if self.untie_cls:
            first_row = jnp.einsum("hd,hd->h", pq[0], pk[0])   # θ1 = A[0, 0]
            first_col = jnp.einsum("hd,hd->h", pq[1], pk[1])   # θ2 = A[1, 1]
        terms: dict[str, Any] = {"untied": blocked.Product(pq[1:], pk[1:], first_row, first_col)}
        if self.mixed_terms:
            terms["position_query"] = project("query_for_words", p[1:])
            terms["position_key"] = project("key_for_words", p[1:])
        return terms
