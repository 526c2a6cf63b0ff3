"""Encoder(first_only=True): the last layer computes token 0 alone, for [CLS] classifiers.

Equal to row 0 of the full output (values and gradients) for every scheme, remat and
DeBERTa-v2's conv, in both layer layouts where they split the stack differently; it must remove the last layer's per-query work (checked on XLA's
FLOP count), and fall back to the full computation while attention maps are captured.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_inputs import padded_text_batch, random_params
from posjax import TextConfig, ViTConfig
from posjax.models.encoder import Encoder
from posjax.models.layout import to_layout
from posjax.models.text import TextEncoder

TOL = 1e-5
LENGTHS = (24, 17, 6, 0)   # full, padded, short, fully padded


def text(scheme: str, **kw) -> TextConfig:
    fields = dict(position_scheme=scheme, vocab_size=40, hidden_size=32, num_heads=4,
                  num_layers=3, mlp_dim=64, max_position_embeddings=24)
    if scheme.startswith("deberta"):
        fields.update(max_relative_positions=32, position_buckets=8 if scheme == "deberta_v2"
                      else 0)
    return TextConfig(**{**fields, **kw})


def vit(scheme: str, **kw) -> ViTConfig:
    return ViTConfig(**{**dict(position_scheme=scheme, image_size=(16, 12), patch_size=4,
                               hidden_size=32, num_heads=4, num_layers=2, mlp_dim=64,
                               num_classes=5, relative_buckets=8, relative_max_distance=8),
                        **kw})


TEXT_CASES = {
    "bert_abs": text("bert_abs"),
    "tupe_r untied cls": text("tupe_r"),
    "deberta v1": text("deberta"),
    "deberta_v2 conv": text("deberta_v2", conv_kernel_size=3, share_att_key=True),
    "deberta_v2 conv 2 layers": text("deberta_v2", conv_kernel_size=3, num_layers=2),
    "deberta_v2 conv 1 layer (full)": text("deberta_v2", conv_kernel_size=3, num_layers=1),
    "bert_abs 1 layer": text("bert_abs", num_layers=1),
    "tupe_r remat": text("tupe_r", remat=True),
    "bert_abs_d": text("bert_abs_d"),
    "rope": text("rope"),
    "rope remat": text("rope", remat=True),
    "alibi": text("alibi"),
    "nope": text("nope"),
}
VIT_CASES = {
    "vit": vit("vit"),
    "vit tupe_r": vit("tupe_r"),
    "vit bert_rel": vit("bert_rel"),
    "vit tupe_a": vit("tupe_a"),
    "vit bert_abs_d": vit("bert_abs_d"),
    "vit rope": vit("rope"),
    "vit alibi": vit("alibi"),
    "vit sincos2d": vit("sincos2d"),
}


# Both layouts cut token 0's query with the same ``Encoder._first_query``; the scanned one
# differs in how it splits the stack (the conv's layer 0, one layer, remat), so the text cases
# whose only difference is the scheme run unrolled alone.
SCHEME_ONLY = {"bert_abs", "tupe_r untied cls", "deberta v1"}


def _layouts(cfg, scanned: bool = True):
    yield "unrolled", cfg
    if scanned:
        yield "scanned", dataclasses.replace(cfg, scan_layers=True)


@pytest.mark.parametrize("name", TEXT_CASES)
def test_text_first_row_equals_full(name):
    batch = padded_text_batch(LENGTHS, 24, 40)
    args = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    params = random_params(TextEncoder(TEXT_CASES[name]), *args)
    probe = np.random.default_rng(1).normal(size=(len(LENGTHS), 32)).astype(np.float32)
    for layout, cfg in _layouts(TEXT_CASES[name], scanned=name not in SCHEME_ONLY):
        model = TextEncoder(cfg)
        p = to_layout(params, cfg.scan_layers)

        @functools.partial(jax.jit, static_argnums=1)
        @functools.partial(jax.value_and_grad, has_aux=True)
        def row0(p, first_only):
            out = model.apply(p, *args, first_only=first_only)
            assert out.shape[1] == (1 if first_only else 24), (layout, out.shape)
            return jnp.sum(out[:, 0] * probe), out[:, 0]

        (_, full), g_full = row0(p, False)
        (_, first), g_first = row0(p, True)
        np.testing.assert_allclose(first, full, atol=TOL, rtol=TOL, err_msg=layout)
        # Relative to the largest gradient: some are exactly 0 in exact arithmetic (the key
        # bias: a per-query constant under the softmax) and only rounding noise here.
        scale = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(g_full))
        for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_first)):
            assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) <= TOL * scale, layout


def _vit_encoder_inputs(cfg: ViTConfig):
    gh, gw = cfg.grid_size
    x = np.random.default_rng(2).normal(size=(2, gh * gw + 1, cfg.hidden_size))
    return Encoder(cfg, pre_ln=True, grid=(gh, gw), has_cls=True), (
        x.astype(np.float32), np.ones(x.shape[:2], bool))


@pytest.mark.parametrize("name", VIT_CASES)
def test_vit_first_row_equals_full(name):
    encoder, args = _vit_encoder_inputs(VIT_CASES[name])
    params = random_params(encoder, *args)
    for layout, cfg in _layouts(VIT_CASES[name]):
        encoder, _ = _vit_encoder_inputs(cfg)
        p = to_layout(params, cfg.scan_layers)
        full = encoder.apply(p, *args)[:, 0]
        first = encoder.apply(p, *args, first_only=True)
        assert first.shape == (2, 1, cfg.hidden_size)
        np.testing.assert_allclose(first[:, 0], full, atol=TOL, rtol=TOL, err_msg=layout)


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def test_first_only_removes_the_last_layers_per_query_work():
    """2 layers, L = 24: the last layer's queries, MLP and output projection run on 1 row of
    24, so the forward has fewer than (1 + 0.4) / 2 of the full forward's FLOPs."""
    cfg = text("bert_abs", num_layers=2, hidden_size=64, mlp_dim=256)
    batch = padded_text_batch((24, 24), 24, 40)
    args = (batch["input_ids"], batch["attention_mask"])
    model = TextEncoder(cfg)
    params = random_params(model, *args)
    full = _flops(lambda p: model.apply(p, *args)[:, 0], params)
    first = _flops(lambda p: model.apply(p, *args, first_only=True)[:, 0], params)
    assert first < 0.7 * full, (first, full)


def test_captured_attention_maps_stay_whole():
    cfg = text("deberta_v2", num_layers=2)
    batch = padded_text_batch(LENGTHS, 24, 40)
    args = (batch["input_ids"], batch["attention_mask"])
    model = TextEncoder(cfg)
    params = random_params(model, *args)
    out, state = model.apply(params, *args, first_only=True, mutable=["intermediates"])
    maps = jax.tree.leaves(state["intermediates"])
    assert len(maps) == cfg.num_layers
    assert all(m.shape == (4, cfg.num_heads, 24, 24) for m in maps)
    # Captured, the hidden states stay whole too; row 0 is what first_only gives otherwise.
    assert out.shape == (4, 24, cfg.hidden_size)
    np.testing.assert_allclose(out[:, :1], model.apply(params, *args, first_only=True),
                               atol=TOL)


def test_first_only_with_return_all_is_refused():
    cfg = text("bert_abs", num_layers=1)
    encoder = Encoder(cfg, pre_ln=False)
    x, mask = np.zeros((1, 4, 32), np.float32), np.ones((1, 4), bool)
    with pytest.raises(ValueError, match="first_only=False"):
        encoder.init(jax.random.key(0), x, mask, return_all=True, first_only=True)


def test_deberta_cls_row_uses_thin_gathers():
    """DeBERTa's [CLS] row takes the static path: no (B, h, L, 2k) product with the table."""
    cfg = text("deberta_v2", num_layers=1, position_buckets=16, max_relative_positions=64)
    batch = padded_text_batch((24, 24), 24, 40)
    args = (batch["input_ids"], batch["attention_mask"])
    model = TextEncoder(cfg)
    params = random_params(model, *args)
    hlo = jax.jit(lambda p: model.apply(p, *args, first_only=True)).lower(params).as_text()
    assert "2x4x1x32" not in hlo and "2x4x24x32" not in hlo     # (B, h, Lq, 2k) products


@pytest.mark.parametrize("scheme", ["deberta_v2", "deberta"])
def test_remat_keeps_the_last_layers_single_query(scheme):
    """Unrolled remat layers trace their arguments: token 0's query must stay a static choice
    there, else DeBERTa's last layer reads its relative products for every table row (a
    (B, h, L, 2k) p2c product instead of (B, h, L, 1)). Its forward costs what it does
    without remat, and gives the same row."""
    batch = padded_text_batch((24, 17), 24, 40)
    args = (batch["input_ids"], batch["attention_mask"])
    params = random_params(TextEncoder(text(scheme)), *args)
    costs, rows = [], []
    for remat in (False, True):
        model = TextEncoder(text(scheme, remat=remat))
        costs.append(_flops(lambda p: model.apply(p, *args, first_only=True), params))
        rows.append(model.apply(params, *args, first_only=True))
    assert costs[1] <= 1.001 * costs[0], costs
    np.testing.assert_allclose(rows[1], rows[0], atol=TOL, rtol=TOL)


def test_remat_computes_a_pre_ln_layers_norm_once():
    """Pre-LN (ViT) self-attention normalises its input once per layer, with or without
    remat (remat's traced arguments made ``x_kv is x_q`` false: a second LayerNorm)."""
    from model_inputs import every_eqn
    counts = []
    for remat in (False, True):
        encoder, args = _vit_encoder_inputs(vit("vit", remat=remat))
        params = random_params(encoder, *args)
        jaxpr = jax.make_jaxpr(lambda p: encoder.apply(p, *args))(params)
        counts.append(sum(e.primitive.name == "rsqrt" for e in every_eqn(jaxpr.jaxpr)))
    assert counts[0] == counts[1] == 2 * 2, counts   # 2 layers x (attention_norm, mlp_norm)
