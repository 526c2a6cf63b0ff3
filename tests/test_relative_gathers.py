"""What DeBERTa's relative-position strategies compile to (their values against the float64
reference: test_reference_text.py). ``skew`` must never gather or scatter an L × L index, the
slow operation on accelerators, at any length; ``take`` and ``shift`` beyond 2L − 1 = R do."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_inputs import every_eqn
from posjax.layers.disentangled import DisentangledAttention

LENGTH, SPAN = 40, 16          # 2L − 1 = 79 distances > R = 2k = 32 table rows


def _index_sizes(jaxpr) -> list[int]:
    """Index counts of every gather and scatter in a jaxpr and its sub-jaxprs."""
    return [int(np.prod(eqn.invars[1].aval.shape[:-1])) for eqn in every_eqn(jaxpr)
            if eqn.primitive.name == "gather" or eqn.primitive.name.startswith("scatter")]


def _layer(gather: str, share_att_key: bool = True) -> DisentangledAttention:
    """DeBERTa-v3-like: log buckets, c2p + p2c, R = 2·SPAN table rows."""
    return DisentangledAttention(num_heads=4, head_dim=8, pos_att_type=("c2p", "p2c"),
                                 span=SPAN, max_relative_positions=64, position_buckets=SPAN,
                                 share_att_key=share_att_key, gather=gather)


def _forward_backward_index_sizes(gather: str, length: int) -> list[int]:
    layer = _layer(gather)
    x = jnp.ones((2, length, 32))
    table = jnp.ones((2 * SPAN, 32))
    params = layer.init(jax.random.key(0), x, x, rel_table=table)

    def loss(p, x, t):
        return jnp.sum(layer.apply(p, x, x, rel_table=t))
    return _index_sizes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(params, x, table).jaxpr)


@pytest.mark.parametrize("length", [LENGTH, 12])
def test_skew_gathers_only_table_rows(length):
    sizes = _forward_backward_index_sizes("skew", length)
    assert sizes and max(sizes) == 2 * length - 1        # the distance rows of the table


@pytest.mark.parametrize("gather", ["take", "shift"])
def test_take_and_long_shift_gather_every_pair(gather):
    """The control: beyond 2L − 1 = R both gather an (L, L) index (forward and backward)."""
    sizes = _forward_backward_index_sizes(gather, LENGTH)
    assert sizes.count(LENGTH * LENGTH) >= 2


def test_skew_and_take_agree_beyond_the_table():
    layer = {g: _layer(g, share_att_key=False) for g in ("take", "skew")}
    kx, kt = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (2, LENGTH, 32))
    table = jax.random.normal(kt, (2 * SPAN, 32))
    params = nn.meta.unbox(layer["take"].init(jax.random.key(0), x, x, rel_table=table))
    out = {g: m.apply(params, x, x, rel_table=table) for g, m in layer.items()}
    np.testing.assert_allclose(out["skew"], out["take"], atol=2e-5)


def _gather_gradient(full, index, g):
    from posjax.layers.disentangled import relative_gather
    return jax.vjp(lambda f: relative_gather(f, index), full)[1](g)[0]


def test_small_static_gather_gradient_is_a_product_not_a_scatter(monkeypatch):
    """Up to ONEHOT_GRADIENT_MAX one-hot elements the gradient is an einsum with the constant
    one-hot, equal to the scatter-add's; beyond it XLA's scatter-add (the control)."""
    from posjax.layers import disentangled
    rng = np.random.default_rng(0)
    full = jnp.asarray(rng.normal(size=(2, 3, 9, 7)), jnp.float32)
    index = rng.integers(0, 7, (9, 11))
    g = jnp.asarray(rng.normal(size=(2, 3, 9, 11)), jnp.float32)
    expected = jax.vjp(lambda f: disentangled._static_take(f, index), full)[1](g)[0]
    got = _gather_gradient(full, index, g)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert jnp.array_equal(disentangled.relative_gather(full, index),
                           disentangled._static_take(full, index))

    def scatters(fn):
        return [e for e in every_eqn(jax.make_jaxpr(fn)(full, g).jaxpr)
                if e.primitive.name.startswith("scatter")]
    assert not scatters(lambda f, g: _gather_gradient(f, index, g))
    monkeypatch.setattr(disentangled, "ONEHOT_GRADIENT_MAX", 0)
    assert scatters(lambda f, g: _gather_gradient(f, index, g))


def test_static_gather_refuses_rows_outside_the_table():
    from posjax.layers.disentangled import relative_gather
    with pytest.raises(ValueError, match="outside the 4 table rows"):
        relative_gather(jnp.ones((1, 1, 3, 4)), np.full((3, 3), 4))


def _largest_constant(fn, *args) -> int:
    """Elements of the largest array constant the traced program of ``fn`` carries."""
    closed = jax.make_jaxpr(fn)(*args)
    return max([int(np.size(c)) for c in closed.consts] + [0])


def test_long_plain_paths_compute_their_pair_index_on_device(monkeypatch):
    """Beyond ONEHOT_GRADIENT_MAX, DeBERTa's (L, L) gather index and T5's (L, L) buckets are
    computed by the program from the 2L − 1 offsets, not carried as numpy constants (at L = 32k
    such a constant is 4 GiB in host memory and in the executable); the values and gradients
    equal the static index's (the control: below the limit, an (L, L) constant)."""
    from posjax.layers import disentangled
    from posjax.layers.position_bias import T5RelativeBias
    layer = _layer("take", share_att_key=False)
    kx, kt = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (2, LENGTH, 32))
    table = jax.random.normal(kt, (2 * SPAN, 32))
    params = nn.meta.unbox(layer.init(jax.random.key(0), x, x, rel_table=table))

    def value_and_grads():   # a new function each time: nothing reuses the other's trace
        return jax.value_and_grad(lambda p, x, t: jnp.sum(jnp.sin(
            layer.apply(p, x, x, rel_table=t))), argnums=(0, 1, 2))
    static = value_and_grads()(params, x, table)
    assert _largest_constant(value_and_grads(), params, x, table) >= LENGTH * LENGTH
    monkeypatch.setattr(disentangled, "ONEHOT_GRADIENT_MAX", 0)
    on_device = value_and_grads()(params, x, table)
    assert _largest_constant(value_and_grads(), params, x, table) < 2 * LENGTH
    for a, b in zip(jax.tree.leaves(static), jax.tree.leaves(on_device)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    bias = T5RelativeBias(num_heads=4, num_buckets=32, max_distance=128)
    bias_params = bias.init(jax.random.key(0), LENGTH)
    assert _largest_constant(lambda p: bias.apply(p, LENGTH), bias_params) < 2 * LENGTH
