"""DeBERTa disentangled attention (He et al. 2021, Eq. 4; official-code conventions).

    logits[i, j] = (Q_c[i]·K_c[j] + Q_c[i]·K_r[δ(i,j)] + K_c[j]·Q_r[δ(i,j)]) / √(d·(1 + #terms))

with δ(i, j) = clamp(bucket(i − j) + k, 0, 2k − 1), the SAME index for c2p and p2c. The
position terms are computed as Q_c K_rᵀ (L × 2k) and K_c Q_rᵀ (L × 2k) and then gathered (or,
with ``gather='shift'`` or ``'skew'``, from the 2L − 1 table rows of the distances and then
skewed), never as an L × L × d tensor.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax import kernels
from posjax.layers import blocked, logit_terms, positions
from posjax.layers.attention import (attend_and_project, check_attention_inputs, content_logits,
                                    dense)
from posjax.layers.dropout import Dropout

Array = jax.Array


def position_logits(content: Array, table: Array, index: tuple[Array | np.ndarray, ...],
                    method: str = "take") -> Array:
    """Σ over position axes of out[b, h, a, c] = content[b, a, h] · table[index[(b,) a, c], h].

    content: (B, La, h, d) content queries (c2p) or keys (p2c); table: (R, h, d) projected
    relative table; index: per axis (La, Lc) or (B, La, Lc) -> fp32 (B, h, La, Lc).
    The product with the whole table, (B, h, La, R), is gathered by ``relative_gather``
    (``shift`` and ``skew`` gather like ``take`` here: text at queries = keys takes the
    relative shift in ``DisentangledAttention`` instead, ``takes_relative_shift``); a single
    static row or column of pairs multiplies only the table rows it reads.
    """
    total, full = None, None
    for idx in index:
        if isinstance(idx, np.ndarray) and idx.ndim == 2 and 1 in idx.shape:
            term = _thin_position_logits(content, table, idx)
        else:
            if full is None:
                full = jnp.einsum("bqhd,rhd->bhqr", content, table,
                                  preferred_element_type=jnp.float32)
            term = relative_gather(full, idx, method)
        total = term if total is None else total + term
    return total


def takes_relative_shift(method: str, distances: int, rows: int) -> bool:
    """Whether text (queries = keys) with ``distances`` = 2L − 1 distances and an R-row table
    (``rows``) takes the relative shift (``logit_terms.disentangled_logits``: gather the
    table rows of the 2L − 1 distances, a small (2L−1, h, d) row gather, multiply them with
    the content and skew the (B, h, L, 2L−1) product into place — no gather of an L × L
    array): ``skew`` always, ``shift`` when 2L − 1 <= R, where it also costs fewer FLOPs than
    the product with the whole table (``skew`` beyond costs (2L−1)/R times that product's
    FLOPs, for hardware where gathers are slow)."""
    return method == "skew" or (method == "shift" and distances <= rows)


def _thin_position_logits(content: Array, table: Array, index: np.ndarray) -> Array:
    """``position_logits`` for one static row (1, Lc) or column (La, 1) of pairs, e.g. the
    [CLS] query alone (``Encoder(first_only=True)``): gather the n table rows it names and
    multiply them directly, O(n·d) per head instead of the O(n·R·d) product with the table."""
    rows = table[index.reshape(-1)]                               # (n, h, d)
    if index.shape[0] == 1:                                       # out[., ., 0, c]
        return jnp.einsum("bahd,chd->bhac", content, rows, preferred_element_type=jnp.float32)
    return jnp.einsum("bahd,ahd->bha", content, rows,            # out[., ., a, 0]
                      preferred_element_type=jnp.float32)[..., None]


def relative_gather(full: Array, index: Array | np.ndarray, method: str = "take") -> Array:
    """out[b, h, i, j] = full[b, h, i, index[(b,) i, j]].

    full: (B, h, Lq, R); index: (Lq, Lk) or (B, Lq, Lk) -> (B, h, Lq, Lk).
    ``onehot``: einsum with a one-hot (Lq, Lk, R) tensor. Otherwise a gather: a static (Lq, Lk)
    index is applied to the flattened (Lq·R) axis, shared by every batch row and head, so no
    (B, h, Lq, Lk) index tensor is built (``take_along_axis`` with a broadcast index built one,
    3.5x slower forward + backward on CPU at L = 1024); a per-example index uses take_along_axis.
    A static index's values must lie in 0 … R − 1 (ValueError otherwise); while its one-hot
    has at most ``ONEHOT_GRADIENT_MAX`` elements its gradient is a product with that one-hot
    rather than a scatter-add (``_gather_onehot_gradient``).
    """
    if method == "onehot":
        onehot = jax.nn.one_hot(index, full.shape[-1], dtype=full.dtype)
        spec = "bhqr,qkr->bhqk" if onehot.ndim == 3 else "bhqr,bqkr->bhqk"
        return jnp.einsum(spec, full, onehot)
    if isinstance(index, np.ndarray) and index.ndim == 2:
        if index.size and (index.min() < 0 or index.max() >= full.shape[-1]):
            raise ValueError(f"relative index values {index.min()}…{index.max()} are outside "
                             f"the {full.shape[-1]} table rows")
        if index.size * full.shape[-1] <= ONEHOT_GRADIENT_MAX:
            return _gather_onehot_gradient(full, _StaticIndex(index, full.shape[-1]))
    if index.ndim == 2:   # static, or the traced index of every pair (shared_index)
        return _static_take(full, index)
    index = jnp.asarray(index)
    index = index[None, None] if index.ndim == 2 else index[:, None]
    index = jnp.broadcast_to(index, full.shape[:2] + index.shape[2:])
    return jnp.take_along_axis(full, index, axis=-1)


# A static gather's gradient goes through its one-hot (Lq, Lk, R) tensor up to this many
# elements (16 MiB in fp32; the study's L = 64, R = 64: 2^18), through XLA's scatter-add beyond.
ONEHOT_GRADIENT_MAX = 1 << 22


def _static_take(full: Array, index: np.ndarray | Array) -> Array:
    """The (Lq, Lk) index shared by every batch row and head (static numpy, or traced)
    applied to the flattened (Lq·R) axis of ``full``."""
    lq, rows = full.shape[-2:]
    xp = np if isinstance(index, np.ndarray) else jnp
    flat = (xp.arange(lq)[:, None] * rows + index).reshape(-1)
    out = jnp.take(full.reshape(full.shape[:-2] + (lq * rows,)), flat, axis=-1, mode="clip")
    return out.reshape(full.shape[:-2] + index.shape)


class _StaticIndex:
    """A numpy (Lq, Lk) index into R rows as a hashable static argument (compared by value)."""

    def __init__(self, index: np.ndarray, rows: int) -> None:
        self.index, self.rows = index, rows
        self._key = (index.shape, rows, index.tobytes())

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StaticIndex) and self._key == other._key


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_onehot_gradient(full: Array, index: _StaticIndex) -> Array:
    """``_static_take`` forward; its gradient Σ_j g[…, i, j]·[index[i, j] = r] as one einsum
    with the constant one-hot instead of a scatter-add: XLA:CPU's scatter-add took ~17 ns per
    element, 15% of the study's DeBERTa step (L = 64, R = 64), the einsum a fraction of it."""
    return _static_take(full, index.index)


def _gather_onehot_fwd(full: Array, index: _StaticIndex) -> tuple[Array, None]:
    return _static_take(full, index.index), None


def _gather_onehot_bwd(index: _StaticIndex, _: None, g: Array) -> tuple[Array]:
    onehot = np.zeros(index.index.shape + (index.rows,), np.float32)
    np.put_along_axis(onehot, index.index[..., None], 1.0, axis=-1)
    return (jnp.einsum("...qk,qkr->...qr", g, jnp.asarray(onehot, g.dtype)),)


_gather_onehot_gradient.defvjp(_gather_onehot_fwd, _gather_onehot_bwd)


class DisentangledAttention(nn.Module):
    """Multi-head disentangled self-attention with the output projection.

    ``v1``: key projection without bias and ``pos_key`` without bias (HF ``pos_proj``);
    otherwise all biased. ``share_att_key`` (v2) reuses query/key projections on the table.
    ``grid`` (images): one relative table block per axis; the per-axis terms are summed.
    """

    num_heads: int
    head_dim: int
    pos_att_type: tuple[str, ...]
    span: int                       # k: table has 2k rows per axis
    max_relative_positions: int
    position_buckets: int = 0       # v2 log buckets (0: none)
    v1: bool = False
    share_att_key: bool = False
    grid: tuple[int, int] | None = None
    gather: str = "take"
    dtype: jnp.dtype = jnp.float32
    attention_dropout_rate: float = 0.0
    dropout_rate: float = 0.0
    block_size: int = 0   # > 0: memory-bounded blocks (posjax.layers.blocked.layer_attention)
    kernel: str = "blocked"   # what runs the blocks (posjax.kernels.attention_fn)

    def relative_index(self, num_queries: int, num_keys: int,
                       query_positions: Array | None) -> tuple[Array | np.ndarray, ...]:
        """Rows of the (A·2k, H) table per pair and axis: each (Lq, Lk), or (B, Lq, Lk) for
        explicit ``query_positions`` (B, Lq) such as the EMD's masked positions; static numpy
        positions (1, Lq) shared by every example (the [CLS] query) give a static (Lq, Lk)."""
        span = self.effective_span(num_keys)
        rel = functools.partial(positions.deberta_relative_index, span=span,
                                bucket_size=self.position_buckets,
                                max_position=self.max_relative_positions)
        if self.grid is None:
            axes = [np.arange(num_keys)]
        else:
            axes = list(positions.grid_coordinates(self.grid))
        if (query_positions is None and self.grid is None
                and num_keys * num_keys * 2 * span > ONEHOT_GRADIENT_MAX):
            # Computed on device from the 2L − 1 offsets: as numpy, the (L, L) index would be
            # a constant of the program held in host memory (4 GiB at L = 32k).
            by_offset = jnp.asarray(positions.deberta_offset_rows(
                span, self.position_buckets, self.max_relative_positions, num_keys, num_keys))
            i = jnp.arange(num_keys)
            return (by_offset[i[:, None] - i[None, :] + num_keys - 1],)
        out = []
        for a, coord in enumerate(axes):
            full = rel(coord, coord) + a * 2 * span
            if query_positions is None:
                assert num_queries == num_keys
                out.append(full)
            elif isinstance(query_positions, np.ndarray) and query_positions.shape[0] == 1:
                out.append(full[query_positions[0]])   # static rows shared by the batch
            else:
                out.append(jnp.take(jnp.asarray(full), query_positions, axis=0))
        return tuple(out)

    def effective_span(self, length: int) -> int:
        """v1 uses only min(L, k) rows each side of the centre (same result, less work)."""
        if self.v1 and self.grid is None:
            return min(length, self.span)
        return self.span

    @nn.compact
    def __call__(self, x_q: Array, x_kv: Array, *, rel_table: Array, mask: Array | None = None,
                 query_positions: Array | None = None, train: bool = False,
                 query_mask: Array | None = None) -> Array:
        """x_q: (B, Lq, H); x_kv: (B, Lk, H); rel_table: (A·2k, H) with A = 1 (text) or 2
        (grid axes); mask bool (B, 1|h, Lq|1, Lk); query_positions (B or 1, Lq), required when
        Lq != Lk (the key index of each query); query_mask bool (B, Lq): False rows attend to
        nothing (DeBERTa's padded queries, as the blocked path takes them) -> (B, Lq, H).

        ``block_size`` > 0 (text, no ``query_positions``): the memory-bounded blocked path
        (``posjax.layers.blocked``) with mask (B, 1, 1, Lk) and ``query_mask``; no attention
        weights are sown. With ``query_positions`` (EMD, first_only) the plain path runs."""
        check_attention_inputs(x_q, x_kv, mask)
        axes = 1 if self.grid is None else 2
        if rel_table.ndim != 2 or rel_table.shape[0] != axes * 2 * self.span:
            raise ValueError(f"rel_table {tuple(rel_table.shape)} must have {axes}·2·span = "
                             f"{axes * 2 * self.span} rows (span={self.span}, {axes} position "
                             "axis(es))")
        if query_positions is None and x_q.shape[1] != x_kv.shape[1]:
            raise ValueError(f"x_q has {x_q.shape[1]} queries and x_kv {x_kv.shape[1]} keys: "
                             "give query_positions (B or 1, Lq), each query's key index")
        hd = (self.num_heads, self.head_dim)
        names = ("embed", "heads", "kv")
        query = dense(hd, names, name="query", dtype=self.dtype)
        key = dense(hd, names, name="key", dtype=self.dtype, use_bias=not self.v1)
        q, k = query(x_q), key(x_kv)
        v = dense(hd, names, name="value", dtype=self.dtype)(x_kv)
        scale = float(self.head_dim * (1 + len(self.pos_att_type))) ** -0.5
        logits = content_logits(q, k, scale)

        num_keys = x_kv.shape[1]
        span = self.effective_span(num_keys)
        if self.v1 and self.grid is None:   # centre the table on the rows actually used
            rel_table = rel_table[self.span - span: self.span + span]
        rel_table = Dropout(self.dropout_rate)(rel_table, deterministic=not train)
        if self.block_size and self.grid is not None:
            raise ValueError("the blocked path (block_size > 0) covers text only, not a grid")
        pos_key = pos_query = None   # K_r = pos_key(table), Q_r = pos_query(table)
        if "c2p" in self.pos_att_type:
            pos_key = key if self.share_att_key else dense(
                hd, names, name="pos_key", dtype=self.dtype, use_bias=not self.v1)
        if "p2c" in self.pos_att_type:
            pos_query = query if self.share_att_key else dense(
                hd, names, name="pos_query", dtype=self.dtype)
        if self.block_size and query_positions is None:   # masks: (B, 1, 1, L), query_mask (B, L)
            rel = blocked.Disentangled(
                None if pos_key is None else pos_key(rel_table),
                None if pos_query is None else pos_query(rel_table),
                span=span, bucket_size=self.position_buckets,
                max_position=self.max_relative_positions, scale=scale)
            out = blocked.layer_attention(
                self, q, k, v, block_size=self.block_size, scale=scale, mask=mask,
                query_mask=query_mask, block_terms=blocked.BlockTerms(disentangled=rel),
                dropout_rate=self.attention_dropout_rate if train else 0.0,
                attention_fn=kernels.attention_fn(self.kernel))
            return dense(x_q.shape[-1], ("heads", "kv", "embed"), name="out", dtype=self.dtype,
                         axis=(-2, -1))(out)
        if query_mask is not None:   # (B, Lq): as on the blocked path, masked rows get zeros
            rows = query_mask[:, None, :, None]
            mask = rows if mask is None else mask & rows
        if (self.grid is None and query_positions is None
                and takes_relative_shift(self.gather, 2 * num_keys - 1, rel_table.shape[0])):
            # The relative shift over the window of every offset, as the blocked path's blocks.
            window = positions.offset_window(
                positions.deberta_offset_rows(span, self.position_buckets,
                                              self.max_relative_positions, num_keys, num_keys),
                0, 0, num_keys, num_keys, num_keys)
            c2p, p2c = logit_terms.disentangled_logits(
                q, k, None if pos_key is None else pos_key(rel_table),
                None if pos_query is None else pos_query(rel_table), window, batch_first=True)
            for term in (c2p, p2c):
                if term is not None:
                    logits = logits + term * scale
        else:
            index = self.relative_index(x_q.shape[1], num_keys, query_positions)
            logits = self._gathered_logits(logits, q, k, pos_key, pos_query, rel_table, index,
                                           scale)
        return attend_and_project(self, logits, mask, v, self.attention_dropout_rate, train,
                                  x_q.shape[-1], self.dtype)

    def _gathered_logits(self, logits: Array, q: Array, k: Array, pos_key: nn.Module | None,
                         pos_query: nn.Module | None, rel_table: Array,
                         index: tuple[Array | np.ndarray, ...], scale: float) -> Array:
        """logits + (c2p + p2c)·scale by gathers at the per-pair ``index`` (grids, explicit
        query positions, ``take``/``onehot``)."""
        if pos_key is not None:
            logits = logits + position_logits(q, pos_key(rel_table), index, self.gather) * scale
        if pos_query is not None:
            query_rows = pos_query(rel_table)                       # (A·2k, h, d)
            if all(idx.ndim == 2 for idx in index):   # shared by the batch
                # p2c[i, j] = K_c[j]·Q_r[δ(i, j)]: gather by δᵀ
                p2c = position_logits(k, query_rows, tuple(idx.T for idx in index), self.gather)
                logits = logits + jnp.swapaxes(p2c, -1, -2) * scale
            else:
                p2c = jnp.einsum("bkhd,rhd->bhkr", k, query_rows,
                                 preferred_element_type=jnp.float32)
                for idx in index:
                    logits = logits + _p2c_dynamic(p2c, idx) * scale
        return logits


def _p2c_dynamic(p2c: Array, index: Array) -> Array:
    """p2c: (B, h, Lk, R); index (B, Lq, Lk) -> (B, h, Lq, Lk) with out[i, j] = p2c[j, index[i, j]]."""
    b = jnp.arange(p2c.shape[0])[:, None, None]
    j = jnp.arange(p2c.shape[2])[None, None, :]
    # gather -> (B, Lq, Lk, h)
    out = p2c.transpose(0, 2, 3, 1)[b, j, index]
    return out.transpose(0, 3, 1, 2)
