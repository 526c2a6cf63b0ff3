"""Additive position terms computed once per forward and shared by every layer.

* ``T5RelativeBias``: b[h, i, j] = table[bucket(j − i), h] (BERT-R, TUPE-R; not scaled).
* ``alibi_bias``: b[h, i, j] = −slope_h · |i − j| (ALiBi, symmetric; no parameters).
* ``TupePositionBias``: TUPE's untied absolute correlation (Ke et al. 2021, Eq. 6 and §3.2):
  A = (LN(P) U_Q)(LN(P) U_K)ᵀ / √(2d), with the [CLS] row/column reset to θ1/θ2; for the
  BERT-A-d ablation also the position sides of its two mixed word/position terms.

Each module computes its parameters' sides once and hands them either to the term's
function in ``logit_terms`` for every position 0…L−1 (the plain path: an (h, L, L) array) or,
un-materialised, to a ``blocked`` term that calls the same function per block
(``block_terms``).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax.layers import blocked, logit_terms, positions
from posjax.layers.attention import DEFAULT_INIT, dense, layer_norm

Array = jax.Array


class T5RelativeBias(nn.Module):
    """(h, L, L) bias from a (axes, buckets [+1], h) table; one axis for text, two for a grid:
    ``logit_terms.t5_logits`` of ``positions.t5_bucket_matrix``."""

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    untie_cls: bool = False
    grid: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, length: int, blocked_path: bool = False
                 ) -> Array | blocked.RelativeBucketBias:
        buckets = None
        if not blocked_path:
            buckets = positions.t5_bucket_matrix(length, self.num_buckets, self.max_distance,
                                                 self.untie_cls, self.grid, on_device=True)
        rows = self.num_buckets + (1 if self.untie_cls else 0)
        axes = 1 if self.grid is None else 2
        table = self.param("rel_bias", nn.with_logical_partitioning(
            DEFAULT_INIT, (None, None, "heads")), (axes, rows, self.num_heads), jnp.float32)
        if blocked_path:
            return blocked.RelativeBucketBias(table, self.num_buckets, self.max_distance,
                                              self.untie_cls, self.grid)
        return logit_terms.t5_logits(table, buckets)

    def block_terms(self, length: int) -> blocked.RelativeBucketBias:
        """``__call__(length)`` un-materialised, for the blocked path: the (axes, buckets [+1],
        h) table and the static bucketing; bias[h, i, j] is formed per block."""
        return self(length, blocked_path=True)


def alibi_bias(num_heads: int, coords: list[np.ndarray], positioned: np.ndarray) -> Array:
    """ALiBi for a bidirectional encoder: b[h, i, j] = −slope_h · Σ_a |c_a[i] − c_a[j]|, (h, L, L)
    fp32 (text: |i − j|; a grid: the Manhattan distance between patches), 0 for pairs with a
    token without a position ([CLS]): ``logit_terms.alibi_logits`` of every token. Slopes:
    ``positions.alibi_slopes``. Built from (L,) coordinates at run time, so no L × L constant
    is embedded in the program."""
    coords_f32 = [jnp.asarray(c, jnp.float32) for c in coords]
    unpositioned = None if positioned.all() else positioned
    return logit_terms.alibi_logits(positions.alibi_slopes(num_heads), coords_f32, coords_f32,
                                    unpositioned, unpositioned)


class TupePositionBias(nn.Module):
    """TUPE positional correlation from a (max_len + 1, H) table -> {'bias': (h, L, L)}.

    P = LN(table[:L+1]); A = (P U_Q + b_Q)(P U_K + b_K)ᵀ · ``logit_scale`` per head,
    (h, L+1, L+1), 1/√(2d) by default. Token i uses table row i + 1; with ``untie_cls`` the
    result's row 0 is θ1 = A[0, 0] and its column 0 is θ2 = A[1, 1] (row wins at [0, 0]):
    ``logit_terms.untied_logits`` with ``logit_terms.tupe_cls_logits``.

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
    def __call__(self, length: int, blocked_path: bool = False) -> dict[str, Any]:
        """-> {'bias': (h, L, L)} (plain path) or, with ``blocked_path``, {'untied':
        ``blocked.Product``(Pq, Pk, θ1, θ2)}, Pq = (P U_Q + b)·scale and Pk = P U_K + b for
        tokens 0…L−1 (table rows 1…L), (L, h, d) each, θ1, θ2 (h,) (None with a tied [CLS]);
        with ``mixed_terms`` also 'position_query' and 'position_key'."""
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
        pq, pk = project("query") * scale, project("key")            # (L+1, h, d), row 0 [CLS]
        first_row = first_col = None
        if self.untie_cls:
            first_row, first_col = logit_terms.tupe_cls_logits(pq, pk)
        if blocked_path:
            terms: dict[str, Any] = {
                "untied": blocked.Product(pq[1:], pk[1:], first_row, first_col)}
        else:
            tokens = np.arange(length)
            terms = {"bias": logit_terms.untied_logits(pq[1:], pk[1:], tokens, tokens,
                                                       first_row, first_col)}
        if self.mixed_terms:
            terms["position_query"] = project("query_for_words", p[1:])
            terms["position_key"] = project("key_for_words", p[1:])
        return terms

    def block_terms(self, length: int) -> dict[str, Any]:
        """``__call__(length)`` un-materialised, for the blocked path: {'untied':
        ``blocked.Product``} (and the mixed sides), the same parameters."""
        return self(length, blocked_path=True)
