"""Dropout from 8 or 16 random bits per element instead of 32.

    keep = bits >= t,   t = round(p · 2ⁿ),   out = keep · x · 2ⁿ / (2ⁿ − t)

with ``bits`` uniform n-bit integers (n = 16, or n = 8 when p · 256 is an integer, so the
rate is then exact). JAX's threefry (partitionable mode, the default) costs one hash per
32-bit word whatever dtype is requested, so the words are drawn for 1/2 (n = 16) or 1/4
(n = 8) of the elements and each is split into 32/n fields, laid side by side along the last
axis: half (a quarter of) the hashing of ``nn.Dropout``, which draws one word per element.
The realised drop probability is t / 2ⁿ, within 2⁻¹⁷ of p for n = 16 (p = 0.1 -> 0.100006),
and the kept values are scaled by 1 / P(keep) of that realised rate, so E[out] = x exactly.

The words are ``jax.random.bits``'s, bit for bit (``random_words``), but for a threefry key
they are hashed here with the 20 rounds written out: on CPU JAX lowers threefry as a 5-step
while loop, each step a pass over the whole array, which XLA:CPU runs ~2.3× slower than the
one fused elementwise loop of the unrolled hash (jaxlib 0.10, a (8, 12, 128, 64) mask).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))   # Threefry-2x32's, as in jax.random


def _threefry_data(key: Array) -> Array | None:
    """The (2,) uint32 data of a threefry key (typed or raw), None for other key kinds."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(jax.random.key_impl(key)) != "threefry2x32" or key.shape:
            return None
        return jax.random.key_data(key)
    if key.dtype == jnp.uint32 and key.shape == (2,) and (
            jax.config.jax_default_prng_impl == "threefry2x32"):
        return key
    return None


def random_words(key: Array, shape: tuple[int, ...]) -> Array:
    """``jax.random.bits(key, shape, jnp.uint32)``, the same words: for a threefry key
    (partitionable mode, JAX's default, fewer than 2³² words) the Threefry-2x32 hash of the
    element counters with its rounds unrolled, so that XLA fuses it into one loop; any other
    key through ``jax.random.bits``."""
    data = _threefry_data(key)
    size = math.prod(shape)
    if data is None or not jax.config.jax_threefry_partitionable or size >= 2 ** 32:
        return jax.random.bits(key, shape, jnp.uint32)
    k1, k2 = data[0], data[1]
    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
    # counters: the flat element index as (high, low) words; high is 0 below 2³² words
    x0 = jnp.broadcast_to(ks[0], shape)
    x1 = jax.lax.iota(jnp.uint32, size).reshape(shape) + ks[1]
    for step in range(5):
        for r in _ROTATIONS[step % 2]:
            x0 = x0 + x1
            x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
            x1 = x0 ^ x1
        x0 = x0 + ks[(step + 1) % 3]
        x1 = x1 + ks[(step + 2) % 3] + np.uint32(step + 1)
    return x0 ^ x1


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
    words = random_words(key, flat[:-1] + (-(-last // fields),))
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
