"""The attention core shared by every scheme, and standard multi-head attention.

Every scheme reduces to ``softmax(sum of additive logit terms, masked) @ V``: the schemes
differ only in which terms they add (docs/design.md §2). Logits, masking and softmax run in fp32.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from posjax import kernels
from posjax.layers import blocked, logit_terms
from posjax.layers.dropout import Dropout

Array = jax.Array


def gelu(x: Array) -> Array:
    """Exact GELU, x·Φ(x) = x·(1 + erf(x/√2))/2 (the form torch and the official code use).

    The same function as ``jax.nn.gelu(approximate=False)``, which evaluates it through erfc:
    on XLA:CPU (jaxlib 0.10) erf is a polynomial while erfc needs exp and range selects, so
    this form runs 4x faster forward (ViT-S/16 MLP, one core); the two differ by < 1e-6.
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * (2.0 ** -0.5)))


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": gelu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "identity": lambda x: x,
}

DEFAULT_INIT = nn.initializers.normal(stddev=0.02)


class Dense(nn.Module):
    """y = x·W + b contracting the trailing ``num_in`` axes of x; W has shape (in..., features...).

    Parameters are fp32 and created at their full shape with logical axis ``names`` (so they
    shard without reshapes); compute runs in ``dtype``.
    """

    features: tuple[int, ...]
    names: tuple[str | None, ...]
    num_in: int = 1
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    kernel_init: Callable = DEFAULT_INIT

    @nn.compact
    def __call__(self, x: Array) -> Array:
        in_shape = x.shape[x.ndim - self.num_in:]
        kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, self.names),
                            in_shape + self.features, jnp.float32)
        # One 2-D product (M, K)·(K, N) of free (row-major) reshapes: its gradients are 2-D
        # products XLA:CPU runs without copying a transposed kernel (contracting a rank-3
        # kernel over two axes made it materialise Wᵀ for dx in every step).
        k = math.prod(in_shape)
        y = jnp.dot(x.reshape(-1, k).astype(self.dtype),
                    kernel.reshape(k, -1).astype(self.dtype))
        y = y.reshape(x.shape[:x.ndim - self.num_in] + self.features)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(
                nn.initializers.zeros_init(), self.names[self.num_in:]), self.features, jnp.float32)
            y = y + bias.astype(self.dtype)
        return y


def dense(features: int | Sequence[int], names: tuple[str | None, ...], *, name: str,
          dtype: jnp.dtype, use_bias: bool = True, axis: int | tuple[int, ...] = -1,
          kernel_init: Callable = DEFAULT_INIT) -> Dense:
    """A ``Dense`` over input axes ``axis`` (-1, or (-2, -1) for the heads' output projection)."""
    features_t = (features,) if isinstance(features, int) else tuple(features)
    num_in = 1 if isinstance(axis, int) else len(axis)
    return Dense(features_t, tuple(names), num_in=num_in, use_bias=use_bias, dtype=dtype,
                 kernel_init=kernel_init, name=name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def normalize(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    """LayerNorm over the last axis, fp32: (x − μ)/√(σ² + ε)·scale + bias, σ² = E[x²] − μ²
    (Flax's fast variance). x (..., H) fp32; scale, bias (H,)."""
    return _normalize_fwd(x, scale, bias, eps)[0]


def _normalize_fwd(x: Array, scale: Array, bias: Array, eps: float
                   ) -> tuple[Array, tuple[Array, Array, Array]]:
    mean = x.mean(-1, keepdims=True)
    var = jnp.maximum((x * x).mean(-1, keepdims=True) - mean * mean, 0.0)
    inv = jax.lax.rsqrt(var + eps)
    xhat = (x - mean) * inv
    return xhat * scale + bias, (xhat, inv, scale)


def _normalize_bwd(eps: float, res: tuple[Array, Array, Array], g: Array
                   ) -> tuple[Array, Array, Array]:
    """dx = (ĝ − mean(ĝ) − x̂·mean(ĝ·x̂))/σ with ĝ = g·scale; dscale = Σ g·x̂, dbias = Σ g."""
    del eps
    xhat, inv, scale = res
    gs = g * scale
    dx = inv * (gs - gs.mean(-1, keepdims=True) - xhat * (gs * xhat).mean(-1, keepdims=True))
    rows = tuple(range(g.ndim - 1))
    return dx, (g * xhat).sum(rows), g.sum(rows)


normalize.defvjp(_normalize_fwd, _normalize_bwd)


class LayerNorm(nn.Module):
    """LayerNorm with Flax's parameters (``scale``, ``bias``) and statistics, its backward
    written out (``normalize``). x (..., H) -> (..., H) in ``dtype``."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        h = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(
            nn.initializers.ones_init(), ("norm",)), (h,), jnp.float32)
        bias = self.param("bias", nn.with_logical_partitioning(
            nn.initializers.zeros_init(), ("norm",)), (h,), jnp.float32)
        return normalize(x.astype(jnp.float32), scale, bias, self.eps).astype(self.dtype)


def layer_norm(eps: float, *, name: str, dtype: jnp.dtype) -> LayerNorm:
    return LayerNorm(eps, dtype, name=name)


def attention_weights(logits: Array, mask: Array | None) -> Array:
    """Masked fp32 softmax over the last axis; rows with no visible key get all-zero weights.

    logits: (B, h, Lq, Lk); mask: bool, broadcastable to logits (True = may attend).
    """
    logits = logits.astype(jnp.float32)
    if mask is None:
        return jax.nn.softmax(logits, axis=-1)
    visible = jnp.any(mask, axis=-1, keepdims=True)   # on the mask's own (small) shape
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.where(visible, weights, 0.0)


def check_attention_inputs(x_q: Array, x_kv: Array, mask: Array | None) -> None:
    """One ValueError, naming the argument, for inputs an attention block cannot take: x_q
    (B, Lq, H), x_kv (B, Lk, H), mask bool (B, 1|h, Lq|1, Lk). A (B, L) token mask would
    broadcast silently wrong when B == L, so it is refused."""
    if x_q.ndim != 3 or x_kv.ndim != 3 or x_q.shape[0] != x_kv.shape[0]:
        raise ValueError(f"x_q {tuple(x_q.shape)} and x_kv {tuple(x_kv.shape)} must be "
                         "(B, Lq, H) and (B, Lk, H) with the same batch B")
    if mask is not None and (mask.ndim != 4 or mask.shape[-1] != x_kv.shape[1]):
        raise ValueError(f"mask {tuple(mask.shape)} must be (B, 1 or heads, Lq or 1, "
                         f"Lk={x_kv.shape[1]}); a (B, L) token mask m is m[:, None, None, :]")


def combine_heads(weights: Array, value: Array, dtype: jnp.dtype) -> Array:
    """(B, h, Lq, Lk) x (B, Lk, h, d) -> (B, Lq, h, d)."""
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(dtype), value.astype(dtype))


@jax.custom_vjp
def add_shared_bias(logits: Array, bias: Array) -> Array:
    """logits (B, h, Lq, Lk) + bias (1, h, Lq, Lk), both fp32: one term shared by every example.

    Same values as the broadcasting add; the bias gradient Σ_b g[b] is a contraction with a
    vector of ones instead of a reduce: XLA:CPU (jaxlib 0.10) fused the per-layer reduces over
    the batch axis into one YNNPACK kernel ~40x slower than adds (~15% of a TUPE-R step).
    """
    return logits + bias


def _add_shared_bias_fwd(logits: Array, bias: Array) -> tuple[Array, None]:
    return logits + bias, None


def _add_shared_bias_bwd(_: None, g: Array) -> tuple[Array, Array]:
    return g, jnp.einsum("bhqk,b->hqk", g, jnp.ones(g.shape[0], g.dtype))[None]


add_shared_bias.defvjp(_add_shared_bias_fwd, _add_shared_bias_bwd)


def content_logits(query: Array, key: Array, scale: float) -> Array:
    """q·k * scale: (B, Lq, h, d), (B, Lk, h, d) -> fp32 (B, h, Lq, Lk)."""
    return jnp.einsum("bqhd,bkhd->bhqk", query, key,
                      preferred_element_type=jnp.float32) * scale


def apply_rotary(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate each token's per-head features by its position (RoPE, half-split pairing).

    x: (B, L, h, d); cos, sin: (L', A, m/2) with L' >= L (rows 0…L−1 are used), A·m = d
    (``positions.rotary_angles``). Per chunk a: out[i] = x[i]·cos − x[i + m/2]·sin and
    out[i + m/2] = x[i + m/2]·cos + x[i]·sin.
    """
    b, length, h, d = x.shape
    axes, half = cos.shape[1], cos.shape[2]
    pairs = x.reshape(b, length, h, axes, 2, half)
    first, second = pairs[..., 0, :], pairs[..., 1, :]            # (B, L, h, A, m/2)
    c = cos[None, :length, None].astype(x.dtype)
    s = sin[None, :length, None].astype(x.dtype)
    out = jnp.stack([first * c - second * s, second * c + first * s], axis=-2)
    return out.reshape(x.shape)


def mixed_logits(word: Array, positions: Array, scale: float, word_is_query: bool) -> Array:
    """A word/position correlation term * scale -> fp32 (B, h, Lq, Lk): word (B, L, h, d) against
    positions (L', h, d), one table shared by the whole batch. word_is_query: (x_i W)(p_j U)ᵀ,
    else (p_i U)(x_j W)ᵀ (``logit_terms.product_logits``, as the blocked path's ``Product``)."""
    sides = (word, positions.astype(word.dtype))
    return logit_terms.product_logits(*(sides if word_is_query else sides[::-1]), scale,
                                      batch_first=True)


def attend_and_project(module: nn.Module, logits: Array, mask: Array | None, value: Array,
                       dropout_rate: float, train: bool, width: int, dtype: jnp.dtype) -> Array:
    """The end of every attention layer: softmax(logits, mask) (sown into ``module``'s
    'intermediates' as 'attention_weights', (B, h, Lq, Lk), for plots), attention dropout,
    the weighted sum of ``value`` (B, Lk, h, d) and the output projection 'out' -> (B, Lq,
    width). Called inside ``module``'s compact ``__call__``."""
    weights = attention_weights(logits, mask)
    module.sow("intermediates", "attention_weights", weights)
    weights = Dropout(dropout_rate)(weights, deterministic=not train)
    out = combine_heads(weights, value, dtype)
    return dense(width, ("heads", "kv", "embed"), name="out", dtype=dtype, axis=(-2, -1))(out)


class MultiHeadAttention(nn.Module):
    """softmax(q·k * logit_scale + bias, mask) v, then the output projection.

    ``bias``: any additive term broadcastable to (B, h, Lq, Lk) — T5 buckets, TUPE's positional
    correlation — computed once by the encoder and shared by all layers.

    ``rotary`` (cos, sin), each (L, A, m/2): RoPE on queries and keys (``apply_rotary``), rows
    0…Lq−1 for the queries and 0…Lk−1 for the keys.

    ``position_key`` (Lk, h, d) / ``position_query`` (Lq, h, d), both or neither: BERT-A-d's
    mixed terms (x_i W̃_Q)(p_j Ũ_K)ᵀ + (p_i Ũ_Q)(x_j W̃_K)ᵀ, scaled like q·k. The position
    sides are shared by every layer; W̃_Q (``query_for_positions``) and W̃_K
    (``key_for_positions``) belong to this layer.

    ``block_size`` > 0 (self-attention, Lq = Lk): the memory-bounded blocked path, with the
    shared terms given un-materialised as ``block_terms`` (``posjax.layers.blocked``) instead
    of ``bias`` and a key mask (B, 1, 1, Lk); no attention weights are sown. With fewer
    queries than keys (``first_only``'s row) the plain path runs, on the rows of
    ``block_terms`` it needs.
    """

    num_heads: int
    head_dim: int
    logit_scale: float
    dtype: jnp.dtype = jnp.float32
    attention_dropout_rate: float = 0.0
    qkv_bias: bool = True
    block_size: int = 0   # > 0: memory-bounded blocks (posjax.layers.blocked.layer_attention)
    kernel: str = "blocked"   # what runs the blocks (posjax.kernels.attention_fn)

    @nn.compact
    def __call__(self, x_q: Array, x_kv: Array, *, mask: Array | None = None,
                 bias: Array | None = None, position_query: Array | None = None,
                 position_key: Array | None = None,
                 rotary: tuple[Array, Array] | None = None, train: bool = False,
                 block_terms: blocked.BlockTerms | None = None) -> Array:
        """x_q (B, Lq, H), x_kv (B, Lk, H), mask bool (B, 1|h, Lq|1, Lk) -> (B, Lq, H)."""
        check_attention_inputs(x_q, x_kv, mask)
        if (position_query is None) != (position_key is None):
            raise ValueError("give position_query and position_key together (BERT-A-d's two "
                             "mixed terms), or neither")
        hd = (self.num_heads, self.head_dim)
        for name, table, x in (("position_query", position_query, x_q),
                               ("position_key", position_key, x_kv)):
            if table is not None and tuple(table.shape) != (x.shape[1],) + hd:
                raise ValueError(f"{name} {tuple(table.shape)} must be (L={x.shape[1]}, "
                                 f"heads={hd[0]}, head_dim={hd[1]}): one row per token")
        names = ("embed", "heads", "kv")

        def project(name: str, x: Array) -> Array:
            return dense(hd, names, name=name, dtype=self.dtype, use_bias=self.qkv_bias)(x)

        q, k, v = project("query", x_q), project("key", x_kv), project("value", x_kv)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.block_size and x_q.shape[1] == x_kv.shape[1]:   # ``bias`` as ``block_terms``
            mixed = None if position_key is None else (
                project("query_for_positions", x_q), position_key, position_query,
                project("key_for_positions", x_kv))
            out = blocked.layer_attention(
                self, q, k, v, block_size=self.block_size, scale=self.logit_scale, mask=mask,
                bias=bias, block_terms=block_terms, mixed=mixed,
                dropout_rate=self.attention_dropout_rate if train else 0.0,
                attention_fn=kernels.attention_fn(self.kernel))
            return dense(x_q.shape[-1], ("heads", "kv", "embed"), name="out", dtype=self.dtype,
                         axis=(-2, -1))(out)
        if block_terms is not None and block_terms.needs_positions():
            # A few query rows (first_only): their rows of the terms.
            rows = block_terms.rows(x_q.shape[1], x_kv.shape[1])
            bias = rows if bias is None else bias + rows
        logits = content_logits(q, k, self.logit_scale)
        if position_key is not None:
            logits = logits + mixed_logits(project("query_for_positions", x_q), position_key,
                                           self.logit_scale, word_is_query=True)
            logits = logits + mixed_logits(project("key_for_positions", x_kv), position_query,
                                           self.logit_scale, word_is_query=False)
        if bias is not None and bias.ndim == 4 and bias.shape[0] == 1:
            logits = add_shared_bias(logits, bias.astype(jnp.float32))
        elif bias is not None:
            logits = logits + bias.astype(jnp.float32)
        return attend_and_project(self, logits, mask, v, self.attention_dropout_rate, train,
                                  x_q.shape[-1], self.dtype)


class Mlp(nn.Module):
    """dense -> act -> dense (dropout after the activation only when ``inner_dropout``)."""

    mlp_dim: int
    act: str
    dtype: jnp.dtype = jnp.float32
    dropout_rate: float = 0.0
    inner_dropout: bool = False
    kernel_init: Callable = DEFAULT_INIT

    @nn.compact
    def __call__(self, x: Array, *, train: bool = False) -> Array:
        h = dense(self.mlp_dim, ("embed", "mlp"), name="fc1", dtype=self.dtype,
                  kernel_init=self.kernel_init)(x)
        h = ACTIVATIONS[self.act](h)
        if self.inner_dropout:
            h = Dropout(self.dropout_rate)(h, deterministic=not train)
        return dense(x.shape[-1], ("mlp", "embed"), name="fc2", dtype=self.dtype,
                     kernel_init=self.kernel_init)(h)
