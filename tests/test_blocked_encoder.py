"""The encoder's memory-bounded attention path (config ``blocked_attention_from``) computes
what the plain path computes, for every text scheme: hidden states, MLM / EMD logits,
[CLS]-only classification and every parameter's gradient, at lengths that are not multiples
of the block, with padded rows, scanned and rematerialised stacks; for every ViT scheme on a
patch grid but DeBERTa's 2D one (which keeps the plain path); and it is the default from
``blocked_attention_from`` tokens on, while captured attention maps keep the plain path."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from model_inputs import max_abs_error, padded_text_batch, random_params
from posjax import TextConfig, TextForMaskedLM, TextForSequenceClassification, ViT, ViTConfig
from posjax.models.schemes import TEXT_SCHEMES, VIT_SCHEMES

TOL = 2e-5
LENGTHS = (45, 38, 6, 0)   # L = 45: not a multiple of the 16-token blocks; a fully padded row


def config(scheme: str, **overrides) -> TextConfig:
    fields = dict(position_scheme=scheme, vocab_size=40, hidden_size=32, num_heads=4,
                  num_layers=2, mlp_dim=48, max_position_embeddings=48, dropout_rate=0.0,
                  attention_dropout_rate=0.0, relative_buckets=8, relative_max_distance=20,
                  attention_block_size=16, blocked_attention_from=0)
    if scheme.startswith("deberta"):
        fields.update(max_relative_positions=12, position_biased_input=False, use_emd=True,
                      position_buckets=6 if scheme == "deberta_v2" else 0)
    return TextConfig(**{**fields, **overrides})


CASES = {s: config(s) for s in TEXT_SCHEMES}
CASES.update({
    "tupe_r scan remat": config("tupe_r", num_layers=3, scan_layers=True, remat=True),
    "deberta_v2 share_att_key norm conv": config("deberta_v2", share_att_key=True,
                                                 norm_rel_ebd=True, conv_kernel_size=3),
    "rope scan": config("rope", num_layers=3, scan_layers=True),
})


@functools.lru_cache(maxsize=None)
def params(model_cls, cfg: TextConfig):
    return random_params(model_cls(cfg), **padded_text_batch((LENGTHS[0],), LENGTHS[0], 40))


def both_paths(model_cls, cfg: TextConfig, fn):
    """fn(model, params) with the plain path and with the blocked path from 8 tokens on."""
    p = params(model_cls, cfg)
    plain = fn(model_cls(cfg), p)
    blocked = fn(model_cls(dataclasses.replace(cfg, blocked_attention_from=8)), p)
    return plain, blocked


@pytest.mark.parametrize("name", list(CASES))
def test_blocked_path_equals_plain_path(name):
    cfg = CASES[name]
    batch = padded_text_batch(LENGTHS, LENGTHS[0], 40)
    real = batch["attention_mask"].astype(bool)
    decode = np.array([[1, 20, 44], [0, 9, 37], [0, 2, 5], [0, 1, 2]], np.int32)

    def mlm(model, p):
        def loss(p):
            logits = model.apply(p, **batch, masked_positions=decode)
            return (logits[:3] ** 2).mean(), logits
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
        hidden = jax.jit(lambda p: model.apply(p, **batch, method=lambda m, *a, **k:
                                               m.encoder(*a, **k)))(p)
        return np.asarray(logits), grads, np.asarray(hidden)

    (logits, grads, hidden), (b_logits, b_grads, b_hidden) = both_paths(TextForMaskedLM, cfg, mlm)
    assert max_abs_error(b_hidden, hidden, real[..., None]) <= TOL
    assert np.all(np.isfinite(b_hidden))
    assert max_abs_error(b_logits[:3], logits[:3]) <= TOL
    flat, b_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(b_grads)
    # Relative to the leaf, with a floor of the largest gradient: the key bias's gradient is
    # 0 in exact arithmetic (softmax ignores a per-row constant), so both paths give round-off.
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
    for (path, g), bg in zip(flat, b_flat):
        scale = max(float(np.abs(g).max()), 1e-3 * largest)
        err = float(np.abs(np.asarray(bg) - np.asarray(g)).max()) / scale
        assert err <= 1e-4, f"{name}: gradient of {jax.tree_util.keystr(path)} off by {err:.2e}"


@pytest.mark.parametrize("scheme", ["bert_abs", "bert_abs_d", "tupe_r", "deberta", "alibi", "rope"])
def test_blocked_path_cls_classifier(scheme):
    """first_only: the last layer's [CLS] row alone reads the blocked terms' first row."""
    cfg = CASES[scheme]
    batch = padded_text_batch(LENGTHS, LENGTHS[0], 40)
    out, b_out = both_paths(TextForSequenceClassification, cfg,
                            lambda m, p: np.asarray(jax.jit(lambda p: m.apply(p, **batch))(p)))
    assert max_abs_error(b_out[:3], out[:3]) <= TOL


def test_blocked_path_is_the_default_for_long_inputs_and_not_while_capturing():
    cfg = TextConfig(position_scheme="tupe_r", vocab_size=40, hidden_size=32, num_heads=4,
                     num_layers=1, mlp_dim=48, max_position_embeddings=64,
                     blocked_attention_from=40, attention_block_size=16)
    model = TextForMaskedLM(cfg)
    p = params(TextForMaskedLM, dataclasses.replace(cfg, blocked_attention_from=0))
    assert TextConfig().blocked_attention_from == 2048
    for length, blocked in ((39, False), (40, True)):
        batch = padded_text_batch((length,), length, 40)
        hlo = jax.jit(lambda p: model.apply(p, **batch)).lower(p).as_text()
        square = f"x4x{length}x{length}xf32"   # (B, heads, L, L) logits or weights
        assert (square in hlo) != blocked, (length, blocked)
        # Captured attention maps need the L × L weights: the plain path runs.
        _, state = model.apply(p, **batch, capture_intermediates=False,
                               mutable=["intermediates"])
        maps = jax.tree.leaves(state)
        assert any(m.shape[-2:] == (length, length) for m in maps)


def vit_config(scheme: str, **overrides) -> ViTConfig:
    """A 5 × 7 patch grid: 36 tokens with [CLS] (not a multiple of the 16-token blocks)."""
    fields = dict(position_scheme=scheme, image_size=(20, 28), patch_size=4, num_channels=3,
                  hidden_size=32, num_heads=4, num_layers=2, mlp_dim=48, num_classes=5,
                  relative_buckets=8, relative_max_distance=5, attention_block_size=16,
                  blocked_attention_from=0)
    if scheme.startswith("deberta"):
        fields.update(pooling="gap", max_relative_positions=4, position_buckets=4)
    return ViTConfig(**{**fields, **overrides})


VIT_CASES = {s: vit_config(s) for s in VIT_SCHEMES}
VIT_CASES.update({"tupe_r tie_cls": vit_config("tupe_r", tie_cls=True),
                  "bert_rel gap": vit_config("bert_rel", pooling="gap"),
                  "rope scan remat": vit_config("rope", num_layers=3, scan_layers=True,
                                                remat=True)})


@pytest.mark.parametrize("name", list(VIT_CASES))
def test_blocked_path_on_patch_grids(name):
    """Logits and every gradient on both paths; the blocked one has no (h, L, L) array, and
    DeBERTa's 2D relative terms keep the plain path."""
    cfg = VIT_CASES[name]
    images = np.random.default_rng(1).normal(size=(3, 20, 28, 3)).astype(np.float32)
    p = random_params(ViT(cfg), images)
    blocked_cfg = dataclasses.replace(cfg, blocked_attention_from=8)

    def run(c):
        def loss(p):
            logits = ViT(c).apply(p, images)
            return (logits ** 2).mean(), logits
        fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (_, logits), grads = fn(p)
        return np.asarray(logits), grads, fn.lower(p).as_text()

    logits, grads, _ = run(cfg)
    b_logits, b_grads, hlo = run(blocked_cfg)
    tokens = 35 + (cfg.pooling == "token")
    square = f"x4x{tokens}x{tokens}xf32"   # (B, heads, L, L) logits or weights
    assert (square in hlo) == (cfg.position_scheme in ("deberta", "deberta_v2")), name
    assert max_abs_error(b_logits, logits) <= TOL
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
    for (path, g), bg in zip(jax.tree_util.tree_leaves_with_path(grads),
                             jax.tree.leaves(b_grads)):
        scale = max(float(np.abs(g).max()), 1e-3 * largest)
        err = float(np.abs(np.asarray(bg) - np.asarray(g)).max()) / scale
        assert err <= 1e-4, f"{name}: gradient of {jax.tree_util.keystr(path)} off by {err:.2e}"

