"""Blocked (memory-bounded) attention equals the materialised path for every scheme's terms:
forward and gradients, lengths not multiples of the blocks, padding and query masks, lengths
below/at/above the T5 max distance and the DeBERTa span; and its memory grows linearly."""
import contextlib
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
from bench import long_attention
from posjax.layers import blocked as bl
from posjax.layers import positions
from posjax.layers.attention import MultiHeadAttention, attention_weights
from posjax.layers.disentangled import DisentangledAttention
from posjax.layers.position_bias import T5RelativeBias, TupePositionBias

B, H, D = 2, 2, 8
BUCKETS, MAX_DISTANCE = 8, 20          # T5: exact below 2, log-spaced up to 20
SPAN, DEB_BUCKETS, DEB_MAX = 16, 16, 40   # DeBERTa: 2·16 rows, log buckets beyond ±8
SCALE = 0.3


def _terms(key: jax.Array, length: int, untie: bool = True) -> bl.BlockTerms:
    """Every kind of term at once (a TUPE-R + ALiBi + DeBERTa chimera: each term's own
    correctness is what is tested, their sum is linear)."""
    ks = jax.random.split(key, 7)
    n = lambda i, shape: jax.random.normal(ks[i], shape)   # noqa: E731
    return bl.BlockTerms(
        products=(bl.Product(n(0, (length, H, D)), n(1, (length, H, D)),
                             n(2, (H,)) if untie else None, n(3, (H,)) if untie else None,
                             scale=0.5),),
        relative_bias=bl.RelativeBucketBias(n(4, (1, BUCKETS + 1, H)), BUCKETS, MAX_DISTANCE,
                                            untie_cls=untie),
        linear_bias=bl.LinearBias(jnp.array([0.5, 0.125])),
        disentangled=bl.Disentangled(n(5, (2 * SPAN, H, D)), n(6, (2 * SPAN, H, D)), SPAN,
                                     DEB_BUCKETS, DEB_MAX, scale=0.25))


def _dense(q, k, v, key_mask, query_mask, terms: bl.BlockTerms, scale: float = SCALE):
    """The materialised path: every term as an (h, L, L) array, posjax's masked softmax."""
    length = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    i, j = np.indices((length, length))
    for p in terms.products:
        t = jnp.einsum("qhd,khd->hqk", p.query_side, p.key_side) * p.scale
        if p.first_col is not None:
            t = jnp.where(j == 0, p.first_col[:, None, None], t)
        if p.first_row is not None:
            t = jnp.where(i == 0, p.first_row[:, None, None], t)
        s = s + t
    rb = terms.relative_bias
    if rb is not None:
        buckets = positions.t5_bucket_matrix(length, rb.num_buckets, rb.max_distance,
                                             rb.untie_cls, rb.grid)
        s = s + sum(jnp.take(rb.table[a], b, axis=0)
                    for a, b in enumerate(buckets)).transpose(2, 0, 1)
    if terms.linear_bias is not None:
        s = s - terms.linear_bias.slopes[:, None, None] * np.abs(i - j)
    dt = terms.disentangled
    if dt is not None:
        idx = positions.deberta_relative_index(np.arange(length), np.arange(length), dt.span,
                                               dt.bucket_size, dt.max_position)
        s = s + (jnp.einsum("bqhd,qkhd->bhqk", q, dt.rel_key[idx])
                 + jnp.einsum("bkhd,qkhd->bhqk", k, dt.rel_query[idx])) * dt.scale
    mask = key_mask[:, None, None, :] & query_mask[:, None, :, None]
    return jnp.einsum("bhqk,bkhd->bqhd", attention_weights(s, mask), v)


def _float64(q, k, v, key_mask, query_mask, terms: bl.BlockTerms, scale: float = SCALE):
    """Float64 numpy, per-pair index matrices from tests/reference.py."""
    f = lambda x: np.asarray(x, np.float64)   # noqa: E731
    q, k, v = f(q), f(k), f(v)
    length = q.shape[1]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    (p,) = terms.products
    t = np.einsum("qhd,khd->hqk", f(p.query_side), f(p.key_side)) * p.scale
    t[:, :, 0] = f(p.first_col)[:, None]
    t[:, 0, :] = f(p.first_row)[:, None]
    pos = np.arange(length)
    rb = terms.relative_bias
    t = t + ref.t5_bias(f(rb.table), [pos], rb.num_buckets, rb.max_distance, cls_first=True)
    t = t - f(terms.linear_bias.slopes)[:, None, None] * np.abs(pos[:, None] - pos[None, :])
    dt = terms.disentangled
    idx = ref.deberta_index(pos[None], pos, dt.span, dt.bucket_size, dt.max_position)[0]
    s = s + t + (np.einsum("bqhd,qkhd->bhqk", q, f(dt.rel_key)[idx])
                 + np.einsum("bkhd,qkhd->bhqk", k, f(dt.rel_query)[idx])) * dt.scale
    visible = np.asarray(key_mask)[:, None, None, :] & np.asarray(query_mask)[:, None, :, None]
    return np.einsum("bhqk,bkhd->bqhd", ref.masked_softmax(s, visible), v)


def _inputs(length: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(ks[i], (B, length, H, D)) for i in range(3))
    lengths = np.array([length, max(1, length - 3)])
    key_mask = np.arange(length)[None, :] < lengths[:, None]           # example 1 padded
    query_mask = key_mask.copy()
    query_mask[0, min(1, length - 1)] = False                          # one masked query row
    return q, k, v, jnp.asarray(key_mask), jnp.asarray(query_mask), ks[3]


def _close(got, want, rtol: float = 2e-5) -> None:
    """Leaf by leaf: max |got − want| <= rtol · max(max |want|, 0.1) (a leaf whose true
    gradient is 0, such as θ1 that shifts a whole softmax row, is compared absolutely)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        err, size = np.max(np.abs(g - w)), max(np.max(np.abs(w)), 0.1)
        assert err <= rtol * size, (err, size)


@pytest.mark.parametrize("length,block_q,block_k", [(5, 16, 32), (37, 16, 32), (130, 32, 16)])
def test_every_term_matches_the_materialised_path(length, block_q, block_k):
    """Forward and gradients (q, k, v and every term's arrays) against the dense path, and the
    forward against float64; 130 is beyond the T5 max distance and the DeBERTa span."""
    q, k, v, km, qm, key = _inputs(length)
    terms = _terms(key, length)
    g = jax.random.normal(jax.random.key(1), q.shape)

    def value_and_grads(fn):
        out, pull = jax.vjp(lambda *a: fn(*a[:3], km, qm, a[3]), q, k, v, terms)
        return out, pull(g)

    blocked = lambda q, k, v, km, qm, t: bl.blocked_attention(   # noqa: E731
        q, k, v, key_mask=km, query_mask=qm, scale=SCALE, block_q=block_q, block_k=block_k,
        block_terms=t)
    out, grads = jax.jit(lambda: value_and_grads(blocked))()
    out_dense, grads_dense = jax.jit(lambda: value_and_grads(_dense))()
    _close(out, out_dense)
    _close(grads, grads_dense)
    _close(out, _float64(q, k, v, km, qm, terms))
    assert not np.any(np.asarray(out)[0, 1])            # the masked query row is all zeros


def test_long_sequence_against_float64():
    """L = 300 (blocks 32 × 16, neither divides it): every term far beyond the T5 max
    distance and the DeBERTa span, against the float64 reference."""
    q, k, v, km, qm, key = _inputs(300, seed=3)
    terms = _terms(key, 300)
    out = jax.jit(lambda *a: bl.blocked_attention(
        *a[:3], key_mask=a[3], query_mask=a[4], scale=SCALE, block_q=32, block_k=16,
        block_terms=a[5]))(q, k, v, km, qm, terms)
    _close(out, _float64(q, k, v, km, qm, terms))


def test_grid_relative_bias_matches_t5_module():
    """ViT: 2D buckets (per-axis coordinates, [CLS] untied), a 4 × 5 grid + [CLS] = 21 tokens
    in blocks of 8, against T5RelativeBias's materialised (h, L, L) bias."""
    grid, length = (4, 5), 21
    module = T5RelativeBias(H, BUCKETS, MAX_DISTANCE, untie_cls=True, grid=grid)
    params = jax.jit(module.init, static_argnums=1)(jax.random.key(0), length)
    q, k, v, km, _, _ = _inputs(length)

    @jax.jit
    def both(params):
        bias = module.apply(params, length)
        terms = bl.BlockTerms(relative_bias=module.apply(params, length, method="block_terms"))
        want = jnp.einsum("bhqk,bkhd->bqhd", attention_weights(
            jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE + bias, km[:, None, None, :]), v)
        got = bl.blocked_attention(q, k, v, key_mask=km, scale=SCALE, block_q=8, block_k=8,
                                   block_terms=terms)
        return got, want

    _close(*both(params))


def test_rows_without_visible_keys_are_zero_with_finite_gradients():
    q, k, v, _, _, _ = _inputs(20)
    km = jnp.asarray(np.arange(20)[None, :] < np.array([[0], [20]]))   # example 0: no keys
    fn = lambda q, k, v: bl.blocked_attention(q, k, v, key_mask=km, scale=SCALE,  # noqa: E731
                                              block_q=8, block_k=8)
    out, pull = jax.vjp(fn, q, k, v)
    grads = pull(jnp.ones_like(out))
    assert not np.any(np.asarray(out[0]))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in grads)
    assert not np.any(np.asarray(grads[0][0]))


def test_dropout_uses_the_same_per_block_masks_forward_and_backward():
    """Dropout on the blocked path: its output and gradients equal the dense path with the
    mask assembled from the per-block masks (fold_in(fold_in(rng, query block), key block))."""
    length, block, rate = 37, 16, 0.25
    q, k, v, km, qm, _ = _inputs(length)
    rng = jax.random.key(7)
    plan = bl._Plan(None, (), SCALE, block, block, 3, 3, rate)
    z = jnp.block([[bl._dropout_scale(plan, rng, qi, ki, (B, H, block, block))
                    for ki in range(3)] for qi in range(3)])[..., :length, :length]

    def dense(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
        w = attention_weights(s, km[:, None, None, :] & qm[:, None, :, None]) * z
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    def blocked(q, k, v):
        return bl.blocked_attention(q, k, v, key_mask=km, query_mask=qm, scale=SCALE,
                                    block_q=block, block_k=block, dropout_rate=rate,
                                    dropout_rng=rng)

    g = jax.random.normal(jax.random.key(2), q.shape)
    got = jax.jit(lambda: (lambda o, p: (o, p(g)))(*jax.vjp(blocked, q, k, v)))()
    want = jax.jit(lambda: (lambda o, p: (o, p(g)))(*jax.vjp(dense, q, k, v)))()
    _close(got, want)
    assert 0.15 < float(jnp.mean(z[0] == 0)) < 0.35


class _Tupe(nn.Module):
    """One TUPE-R (or BERT-A-d) attention layer with its shared terms, plain or blocked."""

    scheme: str
    block_size: int

    @nn.compact
    def __call__(self, x, key_mask):
        length = x.shape[1]
        mixed = self.scheme == "bert_abs_d"
        tupe = TupePositionBias(H, D, max_len=64, untie_cls=not mixed, mixed_terms=mixed,
                                logit_scale=(4 * D) ** -0.5 if mixed else None)
        t5 = T5RelativeBias(H, BUCKETS, MAX_DISTANCE, untie_cls=True)
        attention = MultiHeadAttention(H, D, logit_scale=(4 * D if mixed else 2 * D) ** -0.5,
                                       block_size=self.block_size)
        mask = key_mask[:, None, None, :]
        if self.block_size:
            terms = tupe.block_terms(length)
            block_terms = bl.BlockTerms(products=(terms["untied"],))
            if not mixed:
                block_terms = block_terms.replace(relative_bias=t5.block_terms(length))
            return attention(x, x, mask=mask, block_terms=block_terms,
                             position_query=terms.get("position_query"),
                             position_key=terms.get("position_key"))
        terms = tupe(length)
        bias = terms["bias"] if mixed else terms["bias"] + t5(length)
        return attention(x, x, mask=mask, bias=bias[None],
                         position_query=terms.get("position_query"),
                         position_key=terms.get("position_key"))


@pytest.mark.parametrize("scheme", ["tupe_r", "bert_abs_d"])
def test_attention_layer_blocked_equals_plain(scheme):
    """MultiHeadAttention(block_size=16) with TupePositionBias/T5RelativeBias.block_terms
    equals the plain layer with their materialised bias: same parameters (also when the
    blocked model is the one initialised), output, gradients of every parameter and x."""
    length = 37
    x = jax.random.normal(jax.random.key(0), (B, length, H * D))
    km = jnp.asarray(np.arange(length)[None, :] < np.array([[length], [30]]))
    plain, blocked = _Tupe(scheme, 0), _Tupe(scheme, 16)
    params = jax.jit(plain.init)(jax.random.key(1), x, km)
    shapes = jax.tree.map(jnp.shape, jax.eval_shape(blocked.init, jax.random.key(1), x, km))
    if scheme == "tupe_r":   # BERT-A-d's plain model has no T5 table
        assert shapes == jax.tree.map(jnp.shape, params)

    def run(model):
        return jax.jit(jax.value_and_grad(
            lambda p, x: jnp.sum(jnp.sin(model.apply(p, x, km))), argnums=(0, 1)))(params, x)

    _close(run(blocked), run(plain))


def test_rows_of_the_terms_equal_the_materialised_bias():
    """BlockTerms.rows (the plain path's few query rows, e.g. first_only's [CLS]) equals the
    first rows of TUPE-R's materialised bias (untied positions + T5)."""
    length = 37
    tupe = TupePositionBias(H, D, max_len=64)
    t5 = T5RelativeBias(H, BUCKETS, MAX_DISTANCE, untie_cls=True)
    pt = jax.jit(tupe.init, static_argnums=1)(jax.random.key(0), length)
    p5 = jax.jit(t5.init, static_argnums=1)(jax.random.key(1), length)

    @jax.jit
    def both(pt, p5):
        bias = tupe.apply(pt, length)["bias"] + t5.apply(p5, length)
        terms = bl.BlockTerms(
            products=(tupe.apply(pt, length, method="block_terms")["untied"],),
            relative_bias=t5.apply(p5, length, method="block_terms"))
        return terms.rows(3, length), bias[None, :, :3]

    _close(*both(pt, p5))


@pytest.mark.parametrize("v1", [True, False])
def test_disentangled_layer_blocked_equals_plain(v1):
    """DisentangledAttention(block_size=16): v1 (clamped distances, table centred on the
    rows used) and v2/v3 (log buckets, shared key) at L = 37 > span, with DeBERTa's masked
    queries, against the plain layer: output and gradients of parameters, x and the table."""
    length = 37
    common = dict(num_heads=H, head_dim=D, pos_att_type=("c2p", "p2c"), span=SPAN)
    if v1:
        kw = dict(common, max_relative_positions=SPAN, v1=True)
    else:
        kw = dict(common, max_relative_positions=DEB_MAX, position_buckets=DEB_BUCKETS,
                  share_att_key=True)
    plain, blocked = DisentangledAttention(**kw), DisentangledAttention(**kw, block_size=16)
    x = jax.random.normal(jax.random.key(0), (B, length, H * D))
    table = jax.random.normal(jax.random.key(1), (2 * SPAN, H * D))
    tokens = jnp.asarray(np.arange(length)[None, :] < np.array([[length], [30]]))
    params = jax.jit(lambda key: plain.init(key, x, x, rel_table=table))(jax.random.key(2))
    masks = {plain: dict(mask=tokens[:, None, None, :] & tokens[:, None, :, None]),
             blocked: dict(mask=tokens[:, None, None, :], query_mask=tokens)}

    def run(model):
        return jax.jit(jax.value_and_grad(lambda p, x, t: jnp.sum(jnp.sin(model.apply(
            p, x, x, rel_table=t, **masks[model]))), argnums=(0, 1, 2)))(params, x, table)

    _close(run(blocked), run(plain))


def test_memory_grows_linearly_with_length():
    """XLA's scratch for forward + backward (content + T5 + DeBERTa terms): doubling L from
    2048 to 4096 less than doubles it (the plain path's L² logits alone would be 4x)."""
    def scratch(length: int) -> int:
        x = jax.ShapeDtypeStruct((1, length, H, D), jnp.float32)
        terms = bl.BlockTerms(
            relative_bias=bl.RelativeBucketBias(jnp.zeros((1, BUCKETS + 1, H)), BUCKETS,
                                                MAX_DISTANCE, True),
            disentangled=bl.Disentangled(jnp.zeros((2 * SPAN, H, D)),
                                         jnp.zeros((2 * SPAN, H, D)), SPAN, DEB_BUCKETS,
                                         DEB_MAX))
        loss = lambda q, k, v, t: jnp.sum(bl.blocked_attention(   # noqa: E731
            q, k, v, scale=SCALE, block_q=128, block_k=128, block_terms=t))
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        return fn.lower(x, x, x, terms).compile().memory_analysis().temp_size_in_bytes

    small, large = scratch(2048), scratch(4096)
    assert large < 2.2 * small, (small, large)
    assert large < 4096 ** 2 * H * 4 / 4, large   # < a quarter of one (h, L, L) fp32 array


def test_blocked_path_refuses_what_it_cannot_bound():
    q = jnp.ones((1, 8, H, D))
    terms = _terms(jax.random.key(0), 8)
    with pytest.raises(ValueError, match="same tokens"):
        bl.blocked_attention(q[:, :4], q, q, scale=1.0, block_terms=terms)
    with pytest.raises(ValueError, match="dropout_rng"):
        bl.blocked_attention(q, q, q, scale=1.0, dropout_rate=0.1)
    with pytest.raises(ValueError, match="key_mask"):
        bl.blocked_attention(q, q, q, scale=1.0, key_mask=jnp.ones((1, 1, 8), bool))
    layer = MultiHeadAttention(H, D, logit_scale=1.0, block_size=4)
    x = jnp.ones((1, 8, H * D))
    with pytest.raises(ValueError, match="block_terms"):
        layer.init(jax.random.key(0), x, x, bias=jnp.zeros((1, H, 8, 8)))
    with pytest.raises(ValueError, match="query_mask"):
        layer.init(jax.random.key(0), x, x, mask=jnp.ones((1, 1, 8, 8), bool))


def test_bench_smoke_mode_prints_the_table():
    """bench/long_attention.py --smoke, kept quick: its first length, the two schemes whose
    layers cover the others' code (TUPE-R: T5 + untied; DeBERTa): a markdown row each,
    blocked scratch below plain."""
    schemes = ["tupe", "deberta"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert long_attention.main(["--smoke", "--runs", "1", "--lengths", "64",
                                    "--schemes", *schemes]) == 0
    rows = [ln for ln in out.getvalue().splitlines() if re.match(r"\| [a-z0-9]+ \| \d+ \|", ln)]
    assert [r.split("|")[1:3] for r in rows] == [[f" {s} ", " 64 "] for s in schemes]
    for row in rows:
        plain_ms, blocked_ms, plain_mib, blocked_mib = (
            float(c.replace(",", "")) for c in row.split("|")[3:7])
        assert plain_ms > 0 and blocked_ms > 0 and blocked_mib < plain_mib, row
