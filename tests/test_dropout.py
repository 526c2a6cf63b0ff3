"""posjax.layers.dropout: keep rate, scaling, determinism and rng dependence."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax.layers.dropout import (Dropout, bit_width, dropout, keep_threshold, random_words,
                                   uniform_fields)


@pytest.mark.parametrize("rate", [0.1, 0.25, 0.5, 0.9])
def test_keep_rate_within_binomial_tolerance_and_kept_values_scaled(rate):
    n = 200_000
    x = jnp.full((n,), 3.0, jnp.float32)
    y = np.asarray(dropout(x, rate, jax.random.key(7)))
    kept = y != 0
    bits = bit_width(rate)
    p_drop = keep_threshold(rate, bits) / 2 ** bits       # the realised rate
    assert abs(p_drop - rate) <= 2.0 ** -(bits + 1)
    sigma = math.sqrt(n * p_drop * (1 - p_drop))
    assert abs((~kept).sum() - n * p_drop) < 5 * sigma
    np.testing.assert_allclose(y[kept], 3.0 / (1 - p_drop), rtol=1e-6)
    # unbiased: the mean of the output is the input within the binomial spread
    assert abs(y.mean() - 3.0) < 5 * 3.0 * sigma / n / (1 - p_drop)


def test_bit_width_is_exact_for_multiples_of_1_256():
    assert bit_width(0.25) == 8 and keep_threshold(0.25, 8) == 64
    assert bit_width(0.1) == 16 and keep_threshold(0.1, 16) == 6554
    assert keep_threshold(0.99999999, 16) == 2 ** 16 - 1   # never drops everything


@pytest.mark.parametrize("bits, shape", [(16, (3, 1001)), (8, (2, 7, 999)), (16, ())])
def test_uniform_fields_cover_the_range_evenly(bits, shape):
    u = np.asarray(uniform_fields(jax.random.key(4), shape, bits))
    assert u.shape == shape and u.dtype == np.uint32 and u.max() < 2 ** bits
    if u.size > 1:   # every block of the last axis (one per field of a word) is uniform
        last = shape[-1]
        for block in np.array_split(u.reshape(-1, last), 32 // bits, axis=1):
            assert abs(block.mean() / (2 ** bits - 1) - 0.5) < 0.03


def test_deterministic_and_zero_rate_are_identity():
    x = jax.random.normal(jax.random.key(0), (4, 8))
    module = Dropout(0.3)
    assert module.apply({}, x, deterministic=True) is x
    out = Dropout(0.0).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert out is x


def test_masks_depend_on_the_rng_and_are_reproducible():
    x = jnp.ones((64, 64))
    module = Dropout(0.1)

    def run(seed):
        return module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(seed)})

    a, b, c = run(1), run(1), run(2)
    assert jnp.array_equal(a, b)
    assert not jnp.array_equal(a == 0, c == 0)
    # 8-bit and 16-bit draws both give masks that vary across elements (not one bit reused)
    for rate in (0.25, 0.1):
        m = np.asarray(dropout(x, rate, jax.random.key(3)) == 0)
        assert 0 < m.sum() < m.size and m.any(axis=0).sum() > 32 and m.any(axis=1).sum() > 32


def test_gradient_is_the_mask_times_the_scale():
    x = jax.random.normal(jax.random.key(0), (32, 32))
    key = jax.random.key(5)
    y, vjp = jax.vjp(lambda v: dropout(v, 0.1, key), x)
    (g,) = vjp(jnp.ones_like(x))
    scale = 2 ** 16 / (2 ** 16 - keep_threshold(0.1, 16))
    np.testing.assert_allclose(g, np.where(np.asarray(y) != 0, scale, 0.0), rtol=1e-6)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_bad_rate_is_rejected_with_the_value(rate):
    with pytest.raises(ValueError, match=rf"rate={rate!r}"):
        dropout(jnp.ones(3), rate, jax.random.key(0))


@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (8, 12, 128, 64), (2, 0, 3)])
@pytest.mark.parametrize("make_key", [lambda: jax.random.key(42),
                                      lambda: jax.random.fold_in(jax.random.key(3), 11),
                                      lambda: jax.random.PRNGKey(5),
                                      lambda: jax.random.key(1, impl="rbg")])
def test_random_words_are_jax_random_bits(make_key, shape):
    key = make_key()
    expected = jax.random.bits(key, shape, jnp.uint32)
    for fn in (random_words, jax.jit(random_words, static_argnums=1)):
        got = fn(key, shape)
        assert got.dtype == jnp.uint32 and got.shape == shape
        assert jnp.array_equal(got, expected)


def test_random_words_of_a_threefry_key_are_one_fused_loop():
    """The unrolled hash compiles without the while loop of JAX's CPU lowering."""
    text = jax.jit(random_words, static_argnums=1).lower(jax.random.key(0), (64, 64)).as_text()
    assert "while" not in text and "threefry" not in text
    assert "while" in jax.jit(lambda k: jax.random.bits(k, (64, 64), jnp.uint32)).lower(
        jax.random.key(0)).as_text()
