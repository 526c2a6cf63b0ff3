"""Position indices, bucketing and position tables shared by the schemes.

Index arithmetic is static (it depends only on sequence shapes) and is done in numpy at
trace time, so XLA sees constants; an (L, L) index of the plain path that would be a large
constant is computed by the program instead (``t5_bucket_matrix(on_device=True)``).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


def t5_relative_bucket(relative_position: np.ndarray, num_buckets: int = 32,
                       max_distance: int = 128) -> np.ndarray:
    """Bidirectional T5 bucket of ``relative_position = j - i`` (key minus query).

    Half the buckets hold keys before the query (n = i - j > 0), half keys after; within a half,
    distances below ``num_buckets/4`` are exact and the rest are log-spaced up to ``max_distance``.
    Bucket ``num_buckets/2`` (a key after the query at distance 0) is never produced.
    """
    n = -np.asarray(relative_position, dtype=np.int64)
    half = num_buckets // 2
    ret = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    max_exact = half // 2
    with np.errstate(divide="ignore"):
        large = max_exact + (np.log(np.maximum(n, 1).astype(np.float32) / max_exact)
                             / math.log(max_distance / max_exact) * (half - max_exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (ret + np.where(n < max_exact, n, large)).astype(np.int32)


def deberta_log_bucket(relative_position: np.ndarray, bucket_size: int,
                       max_position: int) -> np.ndarray:
    """DeBERTa-v2 log bucketing of ``r = i - j``, as transformers computes it (no clamp of r).

    With mid = bucket_size//2: |r| <= mid kept; larger |r| -> sign(r) * (ceil(log(|r|/mid) /
    log((max_position-1)/mid) * (mid-1)) + mid), for every r: distances beyond max_position
    keep growing past mid - 1 log steps (the final clamp to the 2·span table rows is
    ``deberta_relative_index``'s). transformers and the original official numpy code do not
    clamp r first (a later official version clamps it to ±(max_position-1); the two differ only
    for sequences longer than max_position, and imported checkpoints must reproduce
    transformers). Evaluated in float32 in transformers' order (its ``abs_pos / mid`` is a
    float32 tensor), so that ceil falls on the same side of an integer as in transformers: in
    float64, 19 of 1,331 (bucket_size, max_position) pairs tried differ from it somewhere within
    4·max_position, in float32 three, each a pair with max_position - 1 < 2·mid on an exact tie.
    """
    r = np.asarray(relative_position, dtype=np.int64)
    mid = bucket_size // 2
    abs_pos = np.where((r < mid) & (r > -mid), mid - 1, np.abs(r)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):   # mid = 1: log(0), unused by the where
        log_ratio = (np.log(abs_pos / np.float32(mid))
                     / np.log(np.float32((max_position - 1) / mid)))
        log_pos = np.ceil(log_ratio * np.float32(mid - 1)) + np.float32(mid)
        bucket = np.where(abs_pos <= mid, r, log_pos * np.sign(r))
    return bucket.astype(np.int64)


def deberta_relative_index(query_positions: np.ndarray, key_positions: np.ndarray, span: int,
                           bucket_size: int = 0, max_position: int = 0) -> np.ndarray:
    """Row of the 2*span relative table used by pair (i, j): clamp(bucket(i - j) + span, 0, 2span-1).

    Shapes: query_positions (..., Lq), key_positions (Lk,) -> (..., Lq, Lk) int32. The same index
    serves c2p (row of K_r for query i) and p2c (row of Q_r for key j), as in the official code.
    """
    r = np.asarray(query_positions)[..., :, None] - np.asarray(key_positions)[None, :]
    if bucket_size > 0:
        r = deberta_log_bucket(r, bucket_size, max_position)
    return np.clip(r + span, 0, 2 * span - 1).astype(np.int32)


def grid_coordinates(grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) coordinates of the tokens of a row-major patch grid, each (gh*gw,)."""
    gh, gw = grid
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    return rows.reshape(-1), cols.reshape(-1)


# Position indices: static numpy (the plain path, all of 0…L−1) or traced (a block's rows).
Index = np.ndarray | jax.Array


def _xp(*arrays: object):
    """numpy when every array is numpy (static, at trace time), else jax.numpy."""
    return np if all(isinstance(a, (np.ndarray, np.generic, int)) for a in arrays) else jnp


def reset_cls(values: Index, query_positions: Index, key_positions: Index,
              row_value: int | Index | None, column_value: int | Index | None) -> Index:
    """The untied [CLS] (TUPE's θ1/θ2, T5's two extra buckets): values (..., nq, nk) with
    every pair of key position 0 set to ``column_value``, then every pair of query position 0
    to ``row_value`` (the row wins at [0, 0]); a None value leaves its line as it is.
    query_positions (nq,), key_positions (nk,): global token indices; the values broadcast
    against (..., nq, nk). numpy in, numpy out."""
    xp = _xp(values, query_positions, key_positions)
    if column_value is not None:
        values = xp.where(key_positions[None, :] == 0, column_value, values)
    if row_value is not None:
        values = xp.where(query_positions[:, None] == 0, row_value, values)
    return values


# One axis of the static T5 bucketing: (coords (n,) int32 or None = the token index,
# bucket per coordinate difference, offset of difference 0).
T5Axis = tuple[np.ndarray | None, np.ndarray, int]


@functools.lru_cache(maxsize=64)
def t5_axes(num_buckets: int, max_distance: int, untie_cls: bool,
            grid: tuple[int, int] | None, length: int) -> tuple[T5Axis, ...]:
    """The static part of the T5 bias for tokens 0…length−1, per position axis: (coords,
    by_diff, offset), so that bucket(c[j] − c[i]) = by_diff[c[j] − c[i] + offset] with
    by_diff = ``t5_relative_bucket`` of every coordinate difference. Text: one axis, coords
    None (c = the token index), differences −(length−1)…length−1. A grid: (row, col) of each
    patch after [CLS] (at (0, 0), present when ``untie_cls``), tokens past the grid (padding)
    at 0, differences −(g−1)…g−1 per axis."""
    if grid is None:
        diffs = np.arange(-(length - 1), length)
        return ((None, t5_relative_bucket(diffs, num_buckets, max_distance), length - 1),)
    out = []
    for coords, size in zip(grid_coordinates(grid), grid):
        c = np.concatenate([np.zeros(int(untie_cls), np.int64), coords])
        if len(c) > length:
            raise ValueError(f"length {length} is shorter than grid {grid[0]}x{grid[1]}'s "
                             f"{len(c)} tokens")
        c = np.pad(c, (0, length - len(c))).astype(np.int32)
        diffs = np.arange(-(size - 1), size)
        out.append((c, t5_relative_bucket(diffs, num_buckets, max_distance), size - 1))
    return tuple(out)


def t5_pair_buckets(axis: T5Axis, query_positions: Index, key_positions: Index,
                    num_buckets: int, untie_cls: bool) -> Index:
    """bucket[i, j] = T5 bucket of c[j] − c[i] on one axis of ``t5_axes``, (nq, nk) int32,
    for query positions (nq,) and key positions (nk,) (token indices: numpy for all of
    0…L−1 on the plain path, a block's traced rows on the blocked path); with ``untie_cls``
    column 0 takes bucket ``num_buckets`` and row 0 bucket ``num_buckets/2`` (``reset_cls``),
    a bucket the bucketing never produces."""
    coords, by_diff, offset = axis
    xp = _xp(query_positions, key_positions)
    ci = query_positions if coords is None else xp.asarray(coords)[query_positions]
    cj = key_positions if coords is None else xp.asarray(coords)[key_positions]
    bucket = xp.asarray(by_diff)[cj[None, :] - ci[:, None] + offset]
    if untie_cls:
        bucket = reset_cls(bucket, query_positions, key_positions, num_buckets // 2,
                           num_buckets)
    return bucket.astype(np.int32)


def t5_bucket_matrix(length: int, num_buckets: int, max_distance: int, untie_cls: bool,
                     grid: tuple[int, int] | None = None, on_device: bool = False
                     ) -> tuple[Index, ...]:
    """T5 bucket indices, one (L, L) matrix per position axis (``t5_pair_buckets`` of every
    pair): numpy, or with ``on_device`` computed by the traced program from a (2L − 1)-entry
    lookup (inside jit an (L, L) numpy table is a constant of 4·L² bytes held in host memory
    and the executable: 4 GiB at 32k).

    Text: one matrix of bucket(j - i). Images (``grid``): one matrix per axis (rows, cols) over
    patches; the sum of the two per-axis biases is the 2D relative bias. With ``untie_cls`` token 0
    is [CLS]: its column uses bucket ``num_buckets`` and its row bucket ``num_buckets/2`` (row wins
    at [0, 0]); the table then has ``num_buckets + 1`` rows.
    """
    if grid is not None:
        token_coordinates(length, grid, untie_cls)   # ValueError unless L fits the grid
    pos = jnp.arange(length) if on_device else np.arange(length)
    return tuple(t5_pair_buckets(axis, pos, pos, num_buckets, untie_cls)
                 for axis in t5_axes(num_buckets, max_distance, untie_cls, grid, length))


@functools.lru_cache(maxsize=64)
def deberta_offset_rows(span: int, bucket_size: int, max_position: int, num_queries: int,
                        num_keys: int) -> np.ndarray:
    """δ(r) (``deberta_relative_index``) of every offset r = i − j = −(num_keys−1) …
    num_queries−1, at index r + num_keys − 1, (num_queries + num_keys − 1,) int32."""
    r = np.arange(-(num_keys - 1), num_queries)
    return deberta_relative_index(r, np.zeros(1, np.int64), span=span, bucket_size=bucket_size,
                                  max_position=max_position)[:, 0]


def clamped_offsets(by_offset: np.ndarray, num_keys: int) -> tuple[int, int]:
    """(r_low, r_high): every offset r ≤ r_low has ``by_offset``'s first row and every r ≥
    r_high its last (δ's clamp to the table), for ``deberta_offset_rows`` of ``num_keys``
    keys (index r + num_keys − 1). Static."""
    n = len(by_offset)
    differ_first, differ_last = by_offset != by_offset[0], by_offset != by_offset[-1]
    low = int(np.argmax(differ_first)) - 1 if differ_first.any() else n - 1
    high = n - int(np.argmax(differ_last[::-1])) if differ_last.any() else 0
    return low - (num_keys - 1), high - (num_keys - 1)


def offset_window(by_offset: np.ndarray, first_query: int | Index, first_key: int | Index,
                  num_queries: int, num_keys: int, total_keys: int) -> Index:
    """The rows of ``by_offset`` (``deberta_offset_rows`` for ``total_keys`` keys) for the
    W = num_queries + num_keys − 1 offsets r = r0 … r0 + W − 1, r0 = first_query − first_key −
    (num_keys − 1), that a block of queries first_query… and keys first_key… spans: pair
    (a, c) has offset r0 + (a − c + num_keys − 1). (W,): a static slice for int positions, a
    dynamic slice for traced ones."""
    width = num_queries + num_keys - 1
    start = first_query - first_key - (num_keys - 1) + (total_keys - 1)
    if _xp(first_query, first_key) is np:
        return by_offset[start: start + width]
    return jax.lax.dynamic_slice(jnp.asarray(by_offset), (start,), (width,))


def resample_position_table(table: jax.Array | np.ndarray, old_grid: tuple[int, int],
                            new_grid: tuple[int, int], num_prefix_tokens: int = 1,
                            method: str = "bilinear") -> jax.Array:
    """Resample a learned ViT position table (1, P + gh*gw, H) to a new patch grid.

    The first ``num_prefix_tokens`` rows ([CLS]) are kept; the grid rows are reshaped to
    (gh, gw, H) and resized. ``bilinear``: corner-aligned linear interpolation, identical to
    ``scipy.ndimage.zoom(order=1)`` used by the official vit_jax; ``bicubic``: half-pixel Keys
    cubic with a = -0.75, edge-clamped, no antialiasing, i.e. torch's
    ``F.interpolate(mode="bicubic", align_corners=False)`` used by HF ``interpolate_pos_encoding``
    and timm (``jax.image.resize`` differs: a = -0.5 and antialiased when shrinking).
    """
    table = jnp.asarray(table)
    squeeze = table.ndim == 2
    if squeeze:
        table = table[None]
    gh, gw = old_grid
    nh, nw = new_grid
    prefix, grid_rows = table[:, :num_prefix_tokens], table[:, num_prefix_tokens:]
    if grid_rows.shape[1] != gh * gw:
        raise ValueError(f"position table has {grid_rows.shape[1]} grid rows after "
                         f"{num_prefix_tokens} prefix row(s); old_grid={old_grid} needs {gh * gw}")
    g = grid_rows[0].reshape(gh, gw, -1)
    if method == "bilinear":
        g = _zoom_linear(g, 0, nh)
        g = _zoom_linear(g, 1, nw)
    elif method == "bicubic":
        g = _zoom_cubic(g, 0, nh)
        g = _zoom_cubic(g, 1, nw)
    else:
        raise ValueError(f"method={method!r} is not valid: choose 'bilinear' or 'bicubic'")
    out = jnp.concatenate([prefix, g.reshape(1, nh * nw, -1).astype(table.dtype)], axis=1)
    return out[0] if squeeze else out


def interpolate_position_rows(table: jax.Array | np.ndarray, rows: int,
                              num_prefix_rows: int = 0) -> jax.Array:
    """A learned 1D position table (P + R, H) stretched to (P + ``rows``, H): the first
    ``num_prefix_rows`` P rows (TUPE's [CLS] row) kept, the R position rows resampled by
    corner-aligned linear interpolation (``resample_position_table``'s bilinear, on one axis):
    new row j is old position j·(R − 1)/(rows − 1), so the first and last rows are the old
    first and last, and every row between is a mix of two neighbours."""
    table = jnp.asarray(table)
    prefix, body = table[:num_prefix_rows], table[num_prefix_rows:]
    return jnp.concatenate([prefix, _zoom_linear(body, 0, rows).astype(table.dtype)], axis=0)


def _zoom_linear(x: jax.Array, axis: int, new: int) -> jax.Array:
    """Corner-aligned linear resize along ``axis`` (scipy.ndimage.zoom order=1 sampling)."""
    old = x.shape[axis]
    if new == 1 or old == 1:
        coords = np.zeros(new)
    else:
        coords = np.arange(new) * (old - 1) / (new - 1)
    lo = np.clip(np.floor(coords).astype(np.int64), 0, old - 1)
    hi = np.clip(lo + 1, 0, old - 1)
    w = coords - lo
    return _weighted_taps(x, axis, [(lo, 1 - w), (hi, w)])


def _keys_cubic(t: np.ndarray, a: float = -0.75) -> np.ndarray:
    """Keys' cubic convolution kernel at distances t (|t| < 2; a = -0.75 as in torch)."""
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, far)


def _zoom_cubic(x: jax.Array, axis: int, new: int) -> jax.Array:
    """Half-pixel bicubic resize along ``axis``: source s = (o + 0.5)·old/new − 0.5, taps
    floor(s) − 1 … floor(s) + 2 clamped to the edge, Keys weights (a = -0.75)."""
    old = x.shape[axis]
    src = (np.arange(new) + 0.5) * old / new - 0.5
    base = np.floor(src).astype(np.int64)
    return _weighted_taps(x, axis, [(np.clip(base + tap, 0, old - 1),
                                     _keys_cubic(src - base - tap)) for tap in range(-1, 3)])


def _weighted_taps(x: jax.Array, axis: int, taps: list[tuple[np.ndarray, np.ndarray]]
                   ) -> jax.Array:
    """Σ over taps of x[..., index, ...] · weight along ``axis`` (index, weight: (new,))."""
    shape = [1] * x.ndim
    shape[axis] = -1
    out = 0.0
    for index, weight in taps:
        out = out + jnp.take(x, index, axis=axis) * jnp.asarray(
            weight.astype(np.float32)).reshape(shape)
    return out


def token_coordinates(length: int, grid: tuple[int, int] | None, has_cls: bool
                      ) -> tuple[list[np.ndarray], np.ndarray]:
    """Per position axis each token's coordinate (L,), and which tokens have a position (L,).

    Text: one axis, token i at i. A grid: (row, col) of each patch, row-major, after [CLS]
    (``has_cls``), which has no position (coordinate 0, ``positioned`` False)."""
    if grid is None:
        return [np.arange(length)], np.ones(length, bool)
    offset = int(has_cls)
    rows, cols = grid_coordinates(grid)
    if rows.size + offset != length:
        raise ValueError(f"length {length} does not fit grid {grid[0]}x{grid[1]}: it needs "
                         f"{rows.size + offset} tokens ({offset} [CLS] + {rows.size} patches)")
    pad = np.zeros(offset, np.int64)
    positioned = np.concatenate([np.zeros(offset, bool), np.ones(rows.size, bool)])
    return [np.concatenate([pad, rows]), np.concatenate([pad, cols])], positioned


def rotary_angles(coords: list[np.ndarray], positioned: np.ndarray, head_dim: int,
                  base: float) -> tuple[np.ndarray, np.ndarray]:
    """RoPE (Su et al. 2021) cos and sin, each (L, A, m/2) float32, for A position axes.

    Each head's d features split into A chunks of m = d/A (axial RoPE on grids: the first half
    rotated by the row, the second by the column); within a chunk, feature i is paired with
    i + m/2 (the half-split pairing of GPT-NeoX / Llama, transformers' ``rotate_half``) and
    rotated by the angle p · base^(−2i/m), p the token's coordinate on that axis. Tokens
    without a position ([CLS]) get angle 0: they are not rotated.
    """
    axes = len(coords)
    half = head_dim // axes // 2
    inv_freq = 1.0 / base ** (np.arange(half, dtype=np.float64) * 2 / (head_dim // axes))
    angles = np.stack([c[:, None] * inv_freq[None] for c in coords], axis=1)   # (L, A, m/2)
    angles = angles * positioned[:, None, None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes (Press et al. 2022): for n a power of two the geometric sequence
    2^(−8/n), 2^(−16/n), …, 2^(−8); otherwise those of the largest power of two p < n, then
    every other slope of 2p, (num_heads,) float32."""
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(p) + geometric(2 * p)[0::2][:num_heads - p]
    return np.asarray(slopes, np.float32)


def sincos_2d_table(grid: tuple[int, int], width: int, temperature: float = 10_000.0
                    ) -> np.ndarray:
    """big_vision's fixed 2D sin-cos position table, (gh·gw, width) float32, patches row-major:
    ω_i = temperature^(−i/(width/4 − 1)), i < width/4; a patch at (row y, column x) gets
    [sin(x·ω), cos(x·ω), sin(y·ω), cos(y·ω)]."""
    quarter = width // 4
    omega = 1.0 / temperature ** (np.arange(quarter) / (quarter - 1))
    y, x = grid_coordinates(grid)
    xw, yw = x[:, None] * omega[None], y[:, None] * omega[None]
    return np.concatenate([np.sin(xw), np.cos(xw), np.sin(yw), np.cos(yw)], 1).astype(np.float32)
