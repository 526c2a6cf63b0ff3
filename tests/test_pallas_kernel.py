"""The Pallas flash-attention kernel (posjax.kernels, issue #52) in interpret mode on CPU
equals blocked.blocked_attention and the materialised path for every position term, alone
and together: forward and gradients (the Pallas backward kernels; DeBERTa with
block_q != block_k: blocked.py's recomputing backward) within 1e-5, at
lengths below / at / above the T5 max distance and the DeBERTa span and log buckets, not
multiples of the blocks, with a padded example and a masked query row; the ViT grid terms;
bf16 inputs; and dropout is refused."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax.kernels import pallas_attention
from posjax.layers import blocked as bl
from posjax.layers import logit_terms, positions
from posjax.layers.attention import attention_weights
from test_blocked_attention import (B, BUCKETS, D, H, MAX_DISTANCE, SCALE, _close, _dense,
                                    _inputs, _terms)

RTOL = 1e-5


def _pallas(block_q: int, block_k: int):
    return lambda q, k, v, km, qm, t: pallas_attention(
        q, k, v, key_mask=km, query_mask=qm, scale=SCALE, block_q=block_q, block_k=block_k,
        block_terms=t, interpret=True)


def _blocked(block_q: int, block_k: int):
    return lambda q, k, v, km, qm, t: bl.blocked_attention(
        q, k, v, key_mask=km, query_mask=qm, scale=SCALE, block_q=block_q, block_k=block_k,
        block_terms=t)


def _value_and_grads(fn, q, k, v, km, qm, terms, g):
    """fn's output and the gradients of <out, g> w.r.t. q, k, v and every term array (one
    jit, so the three paths are compared on the same inputs)."""
    @jax.jit
    def run(q, k, v, terms):
        out, pull = jax.vjp(lambda q, k, v, t: fn(q, k, v, km, qm, t), q, k, v, terms)
        return out, pull(g)

    return run(q, k, v, terms)


def _check(q, k, v, km, qm, terms, block_q, block_k, dense=_dense) -> list[jax.Array]:
    """Pallas against blocked (same block layout) and the dense path: forward and gradients
    within RTOL; -> Pallas' output and gradients."""
    g = jax.random.normal(jax.random.key(1), q.shape[:3] + v.shape[-1:])
    got = _value_and_grads(_pallas(block_q, block_k), q, k, v, km, qm, terms, g)
    want = _value_and_grads(_blocked(block_q, block_k), q, k, v, km, qm, terms, g)
    ref = _value_and_grads(dense, q, k, v, km, qm, terms, g)
    got, want, ref = (_numeric(x) for x in (got, want, ref))
    _close(got, want, RTOL)
    _close(got, ref, RTOL)
    return got


def _numeric(tree) -> list[jax.Array]:
    """The leaves, less the float0 cotangents of integer / bool inputs (ALiBi's positioned)."""
    return [x for x in jax.tree.leaves(tree) if x.dtype != jax.dtypes.float0]


# 5: below every limit (one block); 37: above the T5 exact range, the DeBERTa log-bucket start
# (±8) and span (16), below T5's max distance 20·2; 130: beyond T5's max distance and
# DeBERTa's max position 40 (clamped offsets: the far-block shortcut). Blocks 16 × 32 and
# 32 × 16: the DeBERTa tables as one per-head window (pl.ds); 16 × 16: block-aligned halves;
# 200 in TPU-sized blocks of 128 (the lse written lane-dense, as rows).
@pytest.mark.parametrize("length,block_q,block_k", [
    (5, 16, 32), (37, 16, 32), (130, 32, 16), (130, 16, 16), (200, 128, 128)])
def test_every_term_together(length, block_q, block_k):
    q, k, v, km, qm, key = _inputs(length)
    out = _check(q, k, v, km, qm, _terms(key, length), block_q, block_k)[0]
    assert not np.any(np.asarray(out)[0, 1])            # the masked query row is all zeros


def _alone(term: str, key: jax.Array, length: int) -> bl.BlockTerms:
    every = _terms(key, length)
    if term == "content":
        return bl.BlockTerms()
    if term == "product":
        return bl.BlockTerms(products=every.products)
    if term == "t5":
        return bl.BlockTerms(relative_bias=every.relative_bias)
    if term == "alibi":
        return bl.BlockTerms(linear_bias=every.linear_bias)
    if term == "c2p":
        return bl.BlockTerms(disentangled=every.disentangled.replace(rel_query=None))
    return bl.BlockTerms(disentangled=every.disentangled)


def _dense_c2p(q, k, v, km, qm, t: bl.BlockTerms):
    """_dense for DeBERTa without p2c (rel_query None): a zero Q_r."""
    dt = t.disentangled
    return _dense(q, k, v, km, qm, t.replace(
        disentangled=dt.replace(rel_query=jnp.zeros_like(dt.rel_key))))


@pytest.mark.parametrize("term", ["content", "product", "t5", "alibi", "c2p", "deberta"])
def test_each_term_alone(term):
    """Each term by itself at L = 70 (beyond every limit) in blocks of 16: the products, the
    T5 buckets, ALiBi, DeBERTa (c2p only; c2p + p2c), and q·k alone."""
    q, k, v, km, qm, key = _inputs(70, seed=2)
    _check(q, k, v, km, qm, _alone(term, key, 70), 16, 16,
           dense=_dense_c2p if term == "c2p" else _dense)


def test_batched_products_and_no_masks():
    """BERT-A-d's mixed terms: two Products with batched (B, L, h, d) sides on one side each,
    no [CLS] reset; no masks given; against blocked and a dense einsum."""
    length = 45
    q, k, v, _, _, key = _inputs(length, seed=4)
    ks = jax.random.split(key, 4)
    word_q, word_k = (jax.random.normal(ks[i], (B, length, H, D)) for i in range(2))
    pos_q, pos_k = (jax.random.normal(ks[i], (length, H, D)) for i in range(2, 4))
    terms = bl.BlockTerms(products=(bl.Product(word_q, pos_k, scale=0.5),
                                    bl.Product(pos_q, word_k, scale=0.5)))
    ones = jnp.ones((1, length), bool)

    def dense(q, k, v, km, qm, t):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
        a, c = t.products
        s = s + (jnp.einsum("bqhd,khd->bhqk", a.query_side, a.key_side)
                 + jnp.einsum("qhd,bkhd->bhqk", c.query_side, c.key_side)) * 0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    _check(q, k, v, ones, ones, terms, 16, 16, dense=dense)
    got = pallas_attention(q, k, v, scale=SCALE, block_q=16, block_k=16, block_terms=terms,
                           interpret=True)
    _close(got, dense(q, k, v, None, None, terms), RTOL)


def test_vit_grid_terms():
    """ViT: a 4 × 5 grid + [CLS] (21 tokens, blocks 8): TUPE's untied [CLS] product, 2D T5
    buckets with the untied [CLS], 2D ALiBi (Manhattan distance, [CLS] without a position),
    against blocked and the materialised bias of each term."""
    grid, length = (4, 5), 21
    q, k, v, km, qm, key = _inputs(length, seed=5)
    ks = jax.random.split(key, 5)
    coords, positioned = positions.token_coordinates(length, grid, has_cls=True)
    terms = bl.BlockTerms(
        products=(bl.Product(jax.random.normal(ks[0], (length, H, D)),
                             jax.random.normal(ks[1], (length, H, D)),
                             jax.random.normal(ks[2], (H,)), jax.random.normal(ks[3], (H,)),
                             scale=0.5),),
        relative_bias=bl.RelativeBucketBias(jax.random.normal(ks[4], (2, BUCKETS + 1, H)),
                                            BUCKETS, MAX_DISTANCE, untie_cls=True, grid=grid),
        linear_bias=bl.LinearBias(jnp.asarray(positions.alibi_slopes(H)),
                                  jnp.asarray(np.stack(coords), jnp.int32),
                                  jnp.asarray(positioned)))

    def dense(q, k, v, km, qm, t):
        alibi = logit_terms.alibi_logits(t.linear_bias.slopes, list(t.linear_bias.coords),
                                         list(t.linear_bias.coords), t.linear_bias.positioned,
                                         t.linear_bias.positioned)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE + alibi
        s = s + _logits_without_alibi(q, k, t)
        mask = km[:, None, None, :] & qm[:, None, :, None]
        return jnp.einsum("bhqk,bkhd->bqhd", attention_weights(s, mask), v)

    _check(q, k, v, km, qm, terms, 8, 8, dense=dense)


def _logits_without_alibi(q, k, t: bl.BlockTerms) -> jax.Array:
    """The product and T5-grid terms materialised (h, L, L), as tests/test_blocked_attention's
    _dense builds them."""
    length = q.shape[1]
    i, j = np.indices((length, length))
    (p,) = t.products
    s = jnp.einsum("qhd,khd->hqk", p.query_side, p.key_side) * p.scale
    s = jnp.where(j == 0, p.first_col[:, None, None], s)
    s = jnp.where(i == 0, p.first_row[:, None, None], s)
    rb = t.relative_bias
    buckets = positions.t5_bucket_matrix(length, rb.num_buckets, rb.max_distance, rb.untie_cls,
                                         rb.grid)
    return s + sum(jnp.take(rb.table[a], b, axis=0)
                   for a, b in enumerate(buckets)).transpose(2, 0, 1)


def test_bf16_inputs():
    """bf16 q, k, v and term arrays (L = 37, every term): the output (bf16) is within bf16
    rounding of blocked's and of the float32 dense path on the same rounded inputs."""
    length = 37
    q, k, v, km, qm, key = _inputs(length, seed=6)
    terms = _terms(key, length)
    half = lambda x: x.astype(jnp.bfloat16)   # noqa: E731
    q16, k16, v16, t16 = half(q), half(k), half(v), jax.tree.map(half, terms)
    got = jax.jit(_pallas(16, 16))(q16, k16, v16, km, qm, t16)
    assert got.dtype == jnp.bfloat16
    want = jax.jit(_blocked(16, 16))(q16, k16, v16, km, qm, t16)
    f32 = lambda x: x.astype(jnp.float32)   # noqa: E731
    ref = jax.jit(_dense)(f32(q16), f32(k16), f32(v16), km, qm, jax.tree.map(f32, t16))
    _close(got, want, 1e-2)
    _close(got, ref, 2e-2)


def test_rows_without_visible_keys_are_zero_with_finite_gradients():
    q, k, v, _, _, _ = _inputs(20)
    km = jnp.asarray(np.arange(20)[None, :] < np.array([[0], [20]]))   # example 0: no keys
    fn = lambda q, k, v: pallas_attention(q, k, v, key_mask=km, scale=SCALE,  # noqa: E731
                                          block_q=8, block_k=8, interpret=True)
    out, pull = jax.vjp(fn, q, k, v)
    grads = pull(jnp.ones_like(out))
    assert not np.any(np.asarray(out[0]))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in grads)
    assert not np.any(np.asarray(grads[0][0]))


def test_dropout_is_refused():
    q = jnp.ones((1, 8, H, D))
    with pytest.raises(ValueError, match="attention dropout is not supported by the Pallas "
                                         "kernel.*attention_impl='blocked'.*dropout 0"):
        pallas_attention(q, q, q, scale=1.0, dropout_rate=0.1,
                         dropout_rng=jax.random.key(0), interpret=True)
    with pytest.raises(ValueError, match="same tokens"):
        pallas_attention(q[:, :4], q, q, scale=1.0, block_terms=_terms(jax.random.key(0), 8),
                         interpret=True)


def _kernels_in_gradient(block_q: int, block_k: int, terms: bl.BlockTerms, length: int
                         ) -> set[str]:
    q, k, v, km, qm, _ = _inputs(length)
    fn = lambda q, k, v, t: jnp.sum(_pallas(block_q, block_k)(q, k, v, km, qm, t))  # noqa: E731
    text = str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2, 3)))(q, k, v, terms))
    return {name for name in ("posjax_flash_forward", "posjax_flash_dq", "posjax_flash_dkv",
                              "posjax_flash_deberta_tables") if name in text}


def test_the_backward_runs_as_pallas_kernels():
    """Gradients come from the Pallas backward kernels (dq; dk and dv; DeBERTa's tables by
    block diagonal), not from blocked.py's scan; DeBERTa with block_q != block_k (no common
    block diagonal) takes the scan's backward."""
    terms = _terms(jax.random.key(0), 40)
    every = {"posjax_flash_forward", "posjax_flash_dq", "posjax_flash_dkv",
             "posjax_flash_deberta_tables"}
    assert _kernels_in_gradient(16, 16, terms, 40) == every
    assert _kernels_in_gradient(16, 16, terms.replace(disentangled=None), 40) == every - {
        "posjax_flash_deberta_tables"}
    assert _kernels_in_gradient(16, 32, terms, 40) == {"posjax_flash_forward"}
    assert _kernels_in_gradient(16, 32, terms.replace(disentangled=None), 40) == every - {
        "posjax_flash_deberta_tables"}
