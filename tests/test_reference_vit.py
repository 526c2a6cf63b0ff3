"""ViT against the float64 numpy reference (tests/reference.py), position-table resampling
against scipy.ndimage.zoom(order=1), and the R50+ViT-B/16 hybrid's shapes.

The images give a non-square 4 × 3 patch grid, so a row/column mix-up in the 2D relative
schemes cannot cancel out.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

import reference as ref
from model_inputs import abstract_variables, max_abs_error, random_params
from posjax import ViT, ViTConfig
from posjax.layers.positions import resample_position_table
from posjax.models.layout import to_layout

TOL = 1e-5
IMAGE = (16, 12)


def vit_config(scheme: str = "vit", **overrides) -> ViTConfig:
    fields = dict(position_scheme=scheme, image_size=IMAGE, patch_size=4, hidden_size=32,
                  num_heads=4, num_layers=2, mlp_dim=64, num_classes=5, relative_buckets=8,
                  relative_max_distance=8)
    return ViTConfig(**{**fields, **overrides})


def images(cfg: ViTConfig, batch: int = 2, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, *cfg.image_size, cfg.num_channels)).astype(np.float32)


VIT_CASES = {
    "vit token pre_logits": vit_config(representation_size=8),
    "vit gap features": vit_config(pooling="gap", num_classes=0),
    "vit first (patch 0, no [CLS])": vit_config(pooling="first"),
    "vit map exact-gelu eps1e-12": vit_config(pooling="map", hidden_act="gelu",
                                              layer_norm_eps=1e-12),
    "bert_rel token (2D T5, [CLS] buckets)": vit_config("bert_rel"),
    "bert_rel gap (2D T5)": vit_config("bert_rel", pooling="gap"),
    "tupe_a token": vit_config("tupe_a"),
    "tupe_a token tie_cls": vit_config("tupe_a", tie_cls=True),
    "tupe_a gap": vit_config("tupe_a", pooling="gap"),
    "tupe_r token": vit_config("tupe_r"),
    "tupe_r token tie_cls": vit_config("tupe_r", tie_cls=True),
    "bert_abs_d token": vit_config("bert_abs_d"),
    "bert_abs_d gap": vit_config("bert_abs_d", pooling="gap"),
    "deberta gap k=2 take": vit_config("deberta", pooling="gap", max_relative_positions=2),
    "deberta gap k=2 onehot": vit_config("deberta", pooling="gap", max_relative_positions=2,
                                         gather="onehot"),
    "deberta first k=2 take": vit_config("deberta", pooling="first", max_relative_positions=2,
                                         gather="take"),
    "deberta gap k=4 shift c2p": vit_config("deberta", pooling="gap", gather="shift",
                                            pos_att_type=("c2p",)),
    "deberta_v2 map share_att_key norm_rel_ebd": vit_config(
        "deberta_v2", pooling="map", position_buckets=4, max_relative_positions=6,
        share_att_key=True, norm_rel_ebd=True),
    # Grids past every relative limit (8 x 6 patches: distances up to 7 per axis).
    "bert_rel token grid 8x6 past max_distance 3": vit_config(
        "bert_rel", image_size=(32, 24), relative_buckets=4, relative_max_distance=3),
    "tupe_r gap grid 8x6 past max_distance 3": vit_config(
        "tupe_r", pooling="gap", image_size=(32, 24), relative_buckets=4,
        relative_max_distance=3),
    "deberta_v2 gap grid 8x6 past buckets 4 and max_relative_positions 6": vit_config(
        "deberta_v2", pooling="gap", image_size=(32, 24), position_buckets=4,
        max_relative_positions=6, share_att_key=True),
    "deberta gap grid 8x6 at k=7 (one side) and past it (other)": vit_config(
        "deberta", pooling="gap", image_size=(32, 20), max_relative_positions=7),
    "sincos2d token": vit_config("sincos2d"),
    "sincos2d gap": vit_config("sincos2d", pooling="gap"),
    "rope token (axial 2D, [CLS] unrotated)": vit_config("rope"),
    "rope map base 50": vit_config("rope", pooling="map", rope_base=50.0),
    "alibi token (Manhattan distance, [CLS] unbiased)": vit_config("alibi"),
    "alibi gap 6 heads": vit_config("alibi", pooling="gap", hidden_size=48, num_heads=6),
    "nope gap": vit_config("nope", pooling="gap"),
    "scan_layers rope first": vit_config("rope", pooling="first", num_layers=3,
                                         scan_layers=True),
    "scan_layers tupe_r token": vit_config("tupe_r", num_layers=3, scan_layers=True),
    "scan_layers bert_rel first": vit_config("bert_rel", pooling="first", num_layers=3,
                                             scan_layers=True),
    "scan_layers deberta gap remat": vit_config("deberta", pooling="gap", num_layers=3,
                                                max_relative_positions=2, scan_layers=True,
                                                remat=True),
}


@pytest.mark.parametrize("name", list(VIT_CASES))
def test_vit_matches_reference(name):
    cfg = VIT_CASES[name]
    x = images(cfg)
    params = random_params(ViT(dataclasses.replace(cfg, scan_layers=False)), x)
    out = ViT(cfg).apply({"params": to_layout(params["params"], cfg.scan_layers)}, x)
    assert np.all(np.isfinite(np.asarray(out)))
    err = max_abs_error(out, ref.vit(ref.to_float64(params["params"]), cfg, x.astype(np.float64)))
    print(f"[reference] ViT {name}: max abs error {err:.2e}")
    assert err <= TOL, f"{name}: max abs error {err:.3e} > {TOL}"


# --- resampling ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_resampling_is_exact_at_the_same_size(method):
    table = np.random.default_rng(0).normal(size=(1, 1 + 4 * 3, 8)).astype(np.float32)
    out = resample_position_table(table, (4, 3), (4, 3), method=method)
    np.testing.assert_array_equal(np.asarray(out), table)


@pytest.mark.parametrize("old,new", [((4, 3), (7, 5)), ((6, 6), (4, 4)), ((2, 5), (5, 2)),
                                     ((4, 3), (1, 3)), ((1, 3), (3, 3))])
def test_bilinear_resampling_equals_scipy_zoom(old, new):
    table = np.random.default_rng(1).normal(size=(1, 1 + old[0] * old[1], 8))
    out = resample_position_table(table.astype(np.float32), old, new, method="bilinear")
    expected = ref.resample_grid_table(table, old, new)
    assert out.shape == expected.shape
    assert max_abs_error(out, expected) <= 1e-6


def test_vit_with_resampled_table_matches_reference():
    """Fine-tune at a larger image: the resampled table is what the reference zooms."""
    cfg = vit_config(pooling="token")
    params = random_params(ViT(cfg), images(cfg))
    big = vit_config(pooling="token", image_size=(24, 20))            # grid 4x3 -> 6x5
    p = jax.tree.map(lambda v: v, params)
    p["params"]["pos_embedding"] = np.asarray(resample_position_table(
        params["params"]["pos_embedding"], cfg.grid_size, big.grid_size))
    x = images(big)
    expected_params = ref.to_float64(params["params"])
    expected_params["pos_embedding"] = ref.resample_grid_table(
        expected_params["pos_embedding"], cfg.grid_size, big.grid_size)
    err = max_abs_error(ViT(big).apply(p, x), ref.vit(expected_params, big, x.astype(np.float64)))
    assert err <= TOL


# --- hybrid stem -----------------------------------------------------------------------------

R50_UNITS = (3, 4, 9)


def _r50_vit_b16(image_size: int) -> ViTConfig:
    return ViTConfig(image_size=image_size, patch_size=1, resnet_layers=R50_UNITS,
                     hidden_size=768, num_heads=12, num_layers=12, mlp_dim=3072, num_classes=1000)


def test_hybrid_stem_shapes_match_r50_vit_b16():
    """vit_jax R50+ViT-B/16: root conv 7×7/2 (64) + max-pool, stages of (3, 4, 9) bottleneck
    units of width 64·2^s (×4 out), a 1×1 "patch" projection of the 14 × 14 × 1024 map."""
    cfg = _r50_vit_b16(224)
    x = jax.ShapeDtypeStruct((2, 224, 224, 3), np.float32)
    variables = abstract_variables(ViT(cfg), x)
    shapes = jax.tree.map(lambda s: s.shape, nn.meta.unbox(variables))["params"]
    stem = shapes["resnet"]
    assert stem["conv_root"]["kernel"] == (7, 7, 3, 64)
    assert stem["gn_root"]["scale"] == (64,)
    expected_units = set()
    in_features = 64
    for s, units in enumerate(R50_UNITS):
        width = 64 * 2 ** s
        for u in range(1, units + 1):
            name = f"block{s + 1}_unit{u}"
            expected_units.add(name)
            unit = stem[name]
            assert unit["conv1"]["kernel"] == (1, 1, in_features, width), name
            assert unit["conv2"]["kernel"] == (3, 3, width, width), name
            assert unit["conv3"]["kernel"] == (1, 1, width, 4 * width), name
            assert unit["gn3"]["scale"] == (4 * width,), name
            assert ("conv_proj" in unit) == (u == 1), name
            if u == 1:
                assert unit["conv_proj"]["kernel"] == (1, 1, in_features, 4 * width), name
            in_features = 4 * width
    assert set(stem) - {"conv_root", "gn_root"} == expected_units
    assert shapes["embedding"]["kernel"] == (1, 1, 1024, 768)
    assert shapes["pos_embedding"] == (1, 197, 768)
    assert shapes["head"]["kernel"] == (768, 1000)

    params = nn.meta.unbox(variables)
    _, state = jax.eval_shape(lambda p, im: ViT(cfg).apply(
        p, im, capture_intermediates=lambda mdl, _: mdl.name == "resnet", mutable=True),
        params, x)
    assert state["intermediates"]["resnet"]["__call__"][0].shape == (2, 14, 14, 1024)
    assert _r50_vit_b16(384).num_tokens == 577
