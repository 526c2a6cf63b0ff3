"""ViT .npz import: files written here in exactly the official vit_jax naming load into the
posjax ViT with the same values, so applying our model to the loaded params equals applying it
to the params that were saved; the position table is resampled for a new resolution. Files in
big_vision's naming give what big_vision's model computes (a float64 numpy forward written here
from its code's order of operations)."""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
import scipy.ndimage

import ml_dtypes
import reference
from posjax.convert import load_pretrained, save_checkpoint
from posjax.convert.mapping import flatten
from posjax.convert.pretrained import Pretrained, resize_vit
from posjax.models.config import ViTConfig
from posjax.models.vit import ViT

SMALL = dict(hidden_size=32, num_heads=4, num_layers=2, mlp_dim=48, hidden_act="gelu_tanh",
             layer_norm_eps=1e-6)


def random_params(cfg: ViTConfig, seed: int) -> dict:
    """posjax ViT params with every leaf ~ N(0, 0.2) (no zero heads or unit scales)."""
    h, w = cfg.image_size
    shapes = jax.eval_shape(lambda: ViT(cfg).init(jax.random.PRNGKey(0),
                                                  np.zeros((1, h, w, cfg.num_channels))))
    leaves, treedef = jax.tree.flatten(nn.meta.unbox(shapes["params"]))
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [rng.normal(0, 0.2, x.shape).astype(np.float32)
                                        for x in leaves])


MLP_DENSE = {"fc1": "Dense_0", "fc2": "Dense_1"}   # both codes' MlpBlock


def module_path(module: str, leaf: list[str], modules: dict[str, str]) -> list[str]:
    """posjax ``module/leaf`` inside a block -> the official names (``modules``; MLP denses)."""
    return [modules[module], *([MLP_DENSE[leaf[0]], leaf[1]] if module == "mlp" else leaf)]


def official_arrays(params: dict) -> dict[str, np.ndarray]:
    """The same values under the official vision_transformer names (written out by hand)."""
    block = {"attention_norm": "LayerNorm_0", "mlp_norm": "LayerNorm_2",
             "attention": "MultiHeadDotProductAttention_1", "mlp": "MlpBlock_3"}
    out = {}
    for path, value in flatten(params).items():
        head, rest = path[0], list(path[1:])
        if head == "pos_embedding":
            name = "Transformer/posembed_input/pos_embedding"
        elif head == "encoder_norm":
            name = "Transformer/encoder_norm/" + rest[0]
        elif head == "encoder":
            layer, module, *leaf = rest
            name = "/".join([f"Transformer/encoderblock_{layer.split('_')[1]}",
                             *module_path(module, leaf, block)])
        elif head == "resnet":
            unit, *leaf = rest
            if unit.startswith("block"):   # posjax block{s}_unit{u} -> official block{s}/unit{u}
                unit = unit.replace("_", "/")
            name = "/".join([unit, *leaf])
        else:   # embedding, cls, pre_logits, head
            name = "/".join(path)
        out[name] = value
    return out


CASES = {
    # ViT-B/16-like: [CLS] pooling, pre_logits (as the i21k checkpoints), classifier head.
    "token_prelogits": (dict(image_size=32, patch_size=8, pooling="token", num_classes=7,
                             representation_size=24), False),
    # Global average pooling, no pre_logits, no [CLS]; saved with the optimizer (opt/target/).
    "gap_opt_target": (dict(image_size=24, patch_size=4, pooling="gap", num_classes=3), True),
    # R50+ViT hybrid: ResNet-v2 stem (2 units, then 1; width 32), 1x1 patches.
    "r50_hybrid": (dict(image_size=16, patch_size=1, pooling="token", num_classes=4,
                        resnet_layers=(2, 1), resnet_width=32), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_official_npz_round_trip(case, tmp_path):
    kw, with_optimizer = CASES[case]
    cfg = ViTConfig(**SMALL, **kw)
    params = random_params(cfg, seed=len(case))
    arrays = official_arrays(params)
    if case == "r50_hybrid":
        assert {"conv_root/kernel", "gn_root/scale", "block1/unit2/conv3/kernel",
                "block2/unit1/gn_proj/bias"} <= set(arrays)
    assert "Transformer/encoderblock_1/MultiHeadDotProductAttention_1/out/kernel" in arrays
    if with_optimizer:
        arrays = {**{"opt/target/" + k: v for k, v in arrays.items()},
                  "opt/state/step": np.zeros((), np.float32),
                  "opt/state/param_states/head/kernel/grad_ema": arrays["head/kernel"] * 0}
    np.savez(tmp_path / "vit.npz", **arrays)

    pre = load_pretrained(tmp_path / "vit.npz")
    assert pre.kind == "vit" and pre.task == "classification"
    assert pre.config == cfg
    jax.tree.map(np.testing.assert_array_equal, pre.params, params)
    images = np.random.default_rng(0).normal(size=(2, *cfg.image_size, 3)).astype(np.float32)
    apply = jax.jit(ViT(cfg).apply)   # pre.config == cfg: one compilation serves both
    ours = apply({"params": pre.params}, images)
    saved = apply({"params": params}, images)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(saved))

    encoder = load_pretrained(tmp_path / "vit.npz", task="encoder")
    assert encoder.config.num_classes == 0 and "head" not in encoder.params


def test_npz_resampled_to_new_resolution(tmp_path):
    """Fine-tuning at a higher resolution: grid rows resized like vit_jax (scipy zoom order 1),
    the [CLS] row kept, and the model runs at the new size."""
    cfg = ViTConfig(**SMALL, image_size=32, patch_size=8, num_classes=5)
    params = random_params(cfg, seed=1)
    np.savez(tmp_path / "vit.npz", **official_arrays(params))
    pre = load_pretrained(tmp_path / "vit.npz", image_size=56)
    assert pre.config.image_size == (56, 56) and pre.config.grid_size == (7, 7)
    old = params["pos_embedding"][0]
    grid = old[1:].reshape(4, 4, -1)
    want = scipy.ndimage.zoom(grid, (7 / 4, 7 / 4, 1), order=1)
    new = pre.params["pos_embedding"][0]
    np.testing.assert_array_equal(new[0], old[0])
    np.testing.assert_allclose(new[1:].reshape(7, 7, -1), want, atol=1e-6)
    out = jax.eval_shape(ViT(pre.config).apply, {"params": pre.params},
                         np.zeros((1, 56, 56, 3), np.float32))
    assert out.shape == (1, 5)


def test_npz_not_a_vit(tmp_path):
    np.savez(tmp_path / "other.npz", weights=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"other\.npz: no Transformer/encoderblock_0/.*not a ViT "
                                         r"checkpoint of the official vit_jax or big_vision"):
        load_pretrained(tmp_path / "other.npz")


# --- big_vision ------------------------------------------------------------------------------

def big_vision_arrays(params: dict) -> dict[str, np.ndarray]:
    """posjax-shaped random values under big_vision's ViT names (models/vit.py), written out by
    hand: blocks number their modules from 0, the table sits at the top with no [CLS] row."""
    block = {"attention_norm": "LayerNorm_0", "mlp_norm": "LayerNorm_1",
             "attention": "MultiHeadDotProductAttention_0", "mlp": "MlpBlock_0"}
    head = {"attention": "MultiHeadDotProductAttention_0", "norm": "LayerNorm_0",
            "mlp": "MlpBlock_0", "probe": "probe"}
    out = {}
    for path, value in flatten(params).items():
        top, rest = path[0], list(path[1:])
        if top == "pos_embedding":
            out["pos_embedding"] = value[:, 1:] if "cls" in params else value
            continue
        if top == "encoder_norm":
            name = ["Transformer/encoder_norm", *rest]
        elif top == "encoder":
            layer, module, *leaf = rest
            name = [f"Transformer/encoderblock_{layer.split('_')[1]}",
                    *module_path(module, leaf, block)]
        elif top == "map_head":
            module, *leaf = rest
            name = ["MAPHead_0", *module_path(module, leaf, head)]
        else:   # embedding, cls, pre_logits, head
            name = list(path)
        out["/".join(name)] = value
    return out


def big_vision_forward(arrays: dict, images: np.ndarray, num_heads: int,
                       pool_type: str = "") -> np.ndarray:
    """big_vision's ViT in float64, in its order: patches + table, then [CLS] (when there is
    one), pre-LN blocks, encoder_norm, pooling ([CLS], MAP head, the first row for
    ``pool_type='0'``, else the mean), tanh pre_logits, head."""
    a = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
    gelu = reference.ACTIVATIONS["gelu_tanh"]

    def norm(x, name):
        return reference.layer_norm(x, {"scale": a[f"{name}/scale"], "bias": a[f"{name}/bias"]},
                                    1e-6)

    def dense(x, name, contract=1):
        return reference.linear(x, {"kernel": a[f"{name}/kernel"], "bias": a[f"{name}/bias"]},
                                contract)

    def attention(name, x_q, x_kv):
        q, k, v = (dense(x, f"{name}/{n}") for x, n in ((x_q, "query"), (x_kv, "key"),
                                                        (x_kv, "value")))
        logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        return dense(np.einsum("bhqk,bkhd->bqhd", weights, v), f"{name}/out", contract=2)

    def mlp(x, name):
        return dense(gelu(dense(x, f"{name}/Dense_0")), f"{name}/Dense_1")

    x, _ = reference.patch_embed(images.astype(np.float64),
                                 {"kernel": a["embedding/kernel"], "bias": a["embedding/bias"]})
    x = x + a["pos_embedding"]
    if "cls" in a:
        x = np.concatenate([np.broadcast_to(a["cls"], (x.shape[0], 1, x.shape[2])), x], 1)
    for i in range(sum(k.endswith("LayerNorm_0/scale") and k.startswith("Transformer/")
                       for k in a)):
        b = f"Transformer/encoderblock_{i}/"
        y = norm(x, b + "LayerNorm_0")
        x = x + attention(b + "MultiHeadDotProductAttention_0", y, y)
        x = x + mlp(norm(x, b + "LayerNorm_1"), b + "MlpBlock_0")
    x = norm(x, "Transformer/encoder_norm")
    if "cls" in a:
        x = x[:, 0]
    elif "MAPHead_0/probe" in a:
        probe = np.broadcast_to(a["MAPHead_0/probe"], (x.shape[0], 1, x.shape[2]))
        y = attention("MAPHead_0/MultiHeadDotProductAttention_0", probe, x)
        x = (y + mlp(norm(y, "MAPHead_0/LayerNorm_0"), "MAPHead_0/MlpBlock_0"))[:, 0]
    elif pool_type == "0":
        x = x[:, 0]
    else:
        x = x.mean(1)
    if "pre_logits/kernel" in a:
        x = np.tanh(dense(x, "pre_logits"))
    return dense(x, "head")


BIG_VISION_CASES = {
    # pool_type='tok' with rep_size, saved with its optax state (params/ + opt/), one bf16 array.
    "tok_prelogits_params_bf16": dict(image_size=32, patch_size=8, pooling="token",
                                      num_classes=7, representation_size=24),
    # pool_type='map' (the SigLIP / So400m image towers), as one tower of a two-tower file.
    "map_tower": dict(image_size=24, patch_size=4, pooling="map", num_classes=16),
    "gap": dict(image_size=16, patch_size=4, pooling="gap", num_classes=3),
    # pool_type='0': the first patch's row; the arrays are those of 'gap' (pooling='first').
    "pool_type_0": dict(image_size=16, patch_size=4, pooling="first", num_classes=3),
    # scan=True: the blocks stacked as one Transformer/encoderblock with a leading layer axis.
    "gap_scanned": dict(image_size=16, patch_size=4, pooling="gap", num_classes=3),
}


@pytest.mark.parametrize("case", sorted(BIG_VISION_CASES))
def test_big_vision_npz_computes_what_big_vision_does(case, tmp_path):
    cfg = ViTConfig(**SMALL, **BIG_VISION_CASES[case])
    arrays = big_vision_arrays(random_params(cfg, seed=len(case)))
    path = tmp_path / "bv.npz"
    if case.startswith("tok"):
        bf16 = arrays["Transformer/encoderblock_1/MlpBlock_0/Dense_1/kernel"].astype(
            ml_dtypes.bfloat16)
        arrays["Transformer/encoderblock_1/MlpBlock_0/Dense_1/kernel"] = bf16
        saved = {**{f"params/{k}": v for k, v in arrays.items()},
                 "opt/1/mu/head/kernel": np.zeros_like(arrays["head/kernel"])}
    elif case == "map_tower":
        saved = {**{f"params/img/{k}": v for k, v in arrays.items()},
                 "params/txt/Embed_0/embedding": np.zeros((5, 8), np.float32), "params/t": 1.0}
        with pytest.raises(ValueError, match=r"several models \(img, t, txt\): choose the ViT "
                                             r"with .*bv\.npz:img"):
            np.savez(path, **saved)
            load_pretrained(path)
        path = f"{path}:img"
    elif case == "gap_scanned":
        blocks = sorted({k.split("/")[1] for k in arrays if k.startswith("Transformer/encoderb")})
        inner = {k.split("/", 2)[2] for k in arrays if k.startswith("Transformer/encoderblock_0/")}
        saved = {k: v for k, v in arrays.items() if not k.startswith("Transformer/encoderb")}
        saved |= {f"Transformer/encoderblock/{k}": np.stack([arrays[f"Transformer/{b}/{k}"]
                                                             for b in blocks]) for k in inner}
    else:
        saved = arrays
    np.savez(str(path).split(":")[0], **saved)

    pre = load_pretrained(path, pooling="first" if case == "pool_type_0" else None)
    assert pre.config == cfg and pre.task == "classification"
    images = np.random.default_rng(0).normal(size=(2, *cfg.image_size, 3)).astype(np.float32)
    ours = ViT(pre.config).apply({"params": pre.params}, images)
    want = big_vision_forward({k: np.asarray(v, np.float32) for k, v in arrays.items()},
                              images, cfg.num_heads, "0" if case == "pool_type_0" else "")
    np.testing.assert_allclose(np.asarray(ours, np.float64), want, rtol=1e-5, atol=1e-5)


def test_pooling_first_is_only_for_npz_that_look_like_gap(tmp_path):
    """Without ``pooling`` a pool_type='0' file loads as GAP (its arrays are GAP's); 'first'
    is refused where the arrays say [CLS] or MAP, and for sources that are not .npz."""
    gap = ViTConfig(**SMALL, image_size=16, patch_size=4, pooling="gap", num_classes=3)
    np.savez(tmp_path / "gap.npz", **big_vision_arrays(random_params(gap, seed=1)))
    assert load_pretrained(tmp_path / "gap.npz").config.pooling == "gap"
    assert load_pretrained(tmp_path / "gap.npz", pooling="gap").config.pooling == "gap"
    tok = dataclasses.replace(gap, pooling="token")
    np.savez(tmp_path / "tok.npz", **big_vision_arrays(random_params(tok, seed=2)))
    with pytest.raises(ValueError, match=r"tok\.npz: pooling='first' does not fit the "
                                         r"checkpoint, whose arrays say 'token' \(it has a "
                                         r"'cls' token\)"):
        load_pretrained(tmp_path / "tok.npz", pooling="first")
    save_checkpoint(load_pretrained(tmp_path / "gap.npz"), tmp_path / "posjax")
    with pytest.raises(ValueError, match=r"pooling='first' applies to ViT \.npz files only"):
        load_pretrained(tmp_path / "posjax", pooling="first")


def test_old_big_vision_table_with_a_cls_row(tmp_path):
    """big_vision's older vit.py kept the table in the encoder and prepended [CLS] before
    adding it (g² + 1 rows, as vit_jax): such a file loads with its table as saved."""
    cfg = ViTConfig(**SMALL, image_size=16, patch_size=4, pooling="token", num_classes=3)
    params = random_params(cfg, seed=5)
    arrays = big_vision_arrays(params)
    del arrays["pos_embedding"]
    for where in ("Transformer/pos_embedding", "Transformer/posembed_input/pos_embedding"):
        # (1, 1 + 16, H), in the encoder as the checkpoints before 2022 kept it
        np.savez(tmp_path / "bv.npz", **arrays, **{where: params["pos_embedding"]})
        pre = load_pretrained(tmp_path / "bv.npz")
        assert pre.config == cfg
        np.testing.assert_array_equal(pre.params["pos_embedding"], params["pos_embedding"])


def test_big_vision_sincos_positions_are_refused(tmp_path):
    cfg = ViTConfig(**SMALL, image_size=16, patch_size=4, pooling="gap", num_classes=3)
    arrays = big_vision_arrays(random_params(cfg, seed=3))
    del arrays["pos_embedding"]
    np.savez(tmp_path / "bv.npz", **arrays)
    with pytest.raises(ValueError, match=r"bv\.npz: no pos_embedding: a big_vision ViT with "
                                         r"fixed sin-cos position embeddings"):
        load_pretrained(tmp_path / "bv.npz")


@pytest.mark.parametrize("pooling", ["token", "gap"])
def test_tupe_vit_resized_to_new_resolution(pooling):
    """TUPE's absolute table (reset row, [CLS] if any, then the grid) follows the new grid like
    pos_embedding does: rows before the grid kept, grid rows zoomed, and the model runs."""
    cfg = ViTConfig(**{**SMALL, "position_scheme": "tupe_r"}, image_size=32, patch_size=8,
                    num_classes=5, pooling=pooling)
    pre = Pretrained(cfg, random_params(cfg, seed=2), "vit", "classification")
    big = resize_vit(pre, 56)
    prefix = 2 if pooling == "token" else 1
    old = pre.params["encoder"]["tupe_bias"]["position_embeddings"]
    new = big.params["encoder"]["tupe_bias"]["position_embeddings"]
    assert new.shape == (prefix + 49, old.shape[1])
    np.testing.assert_array_equal(new[:prefix], old[:prefix])
    want = scipy.ndimage.zoom(old[prefix:].reshape(4, 4, -1), (7 / 4, 7 / 4, 1), order=1)
    np.testing.assert_allclose(new[prefix:].reshape(7, 7, -1), want, atol=1e-6)
    out = ViT(big.config).apply({"params": big.params}, np.zeros((1, 56, 56, 3), np.float32))
    assert out.shape == (1, 5) and np.all(np.isfinite(np.asarray(out)))
