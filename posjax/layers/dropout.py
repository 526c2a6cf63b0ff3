"""Dropout from 8 or 16 random bits per element instead of 32.

    keep = bits >= t,   t = round(p · 2ⁿ),   out = keep · x · 2ⁿ / (2ⁿ − t)

with ``bits`` uniform n-bit integers (n = 16, or n = 8 when p · 256 is an integer, so the
rate is then exact). JAX's threefry (partitionable mode, the default) costs one hash per
32-bit word whatever dtype is requested, so the words are drawn for 1/2 (n = 16) or 1/4
(n = 8) of the elements and each is split into 32/n fields, laid side by side along the last
axis: half (a quarter of) the hashing of ``nn.Dropout``, which draws one word per element.
The realised drop probability is t / 2ⁿ, within 2⁻¹⁷ of p for n = 16 (p = 0.1 -> 0.100006),
and the kept values are scaled by 1 / P(keep) of that realised rate, so E[out] = x exactly.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def bit_width(rate: float) -> int:
    """8 when ``rate`` is a multiple of 1/256 (exact with 8 bits), else 16."""
    return 8 if float(rate * 256).is_integer() else 16


def keep_threshold(rate: float, bits: int) -> int:
    """t = round(rate · 2^bits), at most 2^bits − 1: kept when the random integer is >= t."""
    return min(int(round(rate * (1 << bits))), (1 << bits) - 1)


def uniform_fields(key: Array, shape: tuple[int, ...], bits: int) -> Array:
    """Uniform integers in [0, 2^bits) of ``shape`` (uint32): ceil(last / f) random 32-bit
    words per row, f = 32 / bits fields each, field i of all words forming block i of the
    last axis (then cut to length)."""
    fields = 32 // bits
    flat = shape if shape else (1,)
    last = flat[-1]
    words = jax.random.bits(key, flat[:-1] + (-(-last // fields),), jnp.uint32)
    mask = jnp.uint32((1 << bits) - 1)
    parts = [(words >> jnp.uint32(bits * i)) & mask for i in range(fields)]
    return jnp.concatenate(parts, axis=-1)[..., :last].reshape(shape)


def dropout(x: Array, rate: float, key: Array) -> Array:
    """x with each element zeroed with probability ≈ ``rate`` (module docstring), kept ones
    scaled so that E[out] = x. 0 <= rate < 1."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate={rate!r} is outside [0, 1): use 0 to disable dropout")
    n = bit_width(rate)
    t = keep_threshold(rate, n)
    if t == 0:
        return x
    keep = uniform_fields(key, x.shape, n) >= jnp.uint32(t)
    scale = jnp.asarray((1 << n) / ((1 << n) - t), x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """``nn.Dropout`` with fewer random bits: same call signature, same rng collection
    ('dropout'), a different (cheaper) mask for the same key."""

    rate: float

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"))
