"""Properties of the models that hold whatever the weights: relative schemes are
shift-equivariant, TUPE's positional term is computed once and shared, [CLS] gets θ1/θ2,
masked keys get zero weight, padding never yields NaN, sharding does not change results,
every parameter is trained, and bf16 stays close to fp32.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import reference as ref
from model_inputs import abstract_variables, max_abs_error, padded_text_batch, random_params
from posjax import (TextConfig, TextEncoder, TextForMaskedLM, TextForSequenceClassification,
                    ViT, ViTConfig)
from posjax.layers import attention as attention_lib
from posjax.layers.attention import MultiHeadAttention
from posjax.layers.position_bias import T5RelativeBias, TupePositionBias

L = 24
LENGTHS = (24, 19, 5, 0)
VOCAB = 40


def text_config(scheme: str, **overrides) -> TextConfig:
    fields = dict(position_scheme=scheme, vocab_size=VOCAB, hidden_size=32, num_heads=4,
                  num_layers=2, mlp_dim=64, max_position_embeddings=L, dropout_rate=0.0,
                  attention_dropout_rate=0.0)
    return TextConfig(**{**fields, **overrides})


SCHEMES = {
    "bert_abs": text_config("bert_abs"),
    "bert_rel": text_config("bert_rel"),
    "tupe_a": text_config("tupe_a"),
    "tupe_r": text_config("tupe_r"),
    "bert_abs_d": text_config("bert_abs_d"),
    "deberta": text_config("deberta", max_relative_positions=8, position_biased_input=False,
                           use_emd=True),
    "deberta_v2": text_config("deberta_v2", position_buckets=8, max_relative_positions=16,
                              position_biased_input=False, share_att_key=True,
                              norm_rel_ebd=True, conv_kernel_size=3, use_emd=True),
    "rope": text_config("rope", max_position_embeddings=0),
    "alibi": text_config("alibi", max_position_embeddings=0),
    "nope": text_config("nope", max_position_embeddings=0),
}


@functools.lru_cache(maxsize=None)
def params_for(model_cls, cfg) -> dict:
    return random_params(model_cls(cfg), **padded_text_batch((L,), L, VOCAB))


def batch(lengths=LENGTHS, seed=0) -> dict[str, np.ndarray]:
    return padded_text_batch(lengths, L, VOCAB, seed)


# --- shift equivariance ------------------------------------------------------------------------

def _shifted(tokens: dict, shift: int) -> dict:
    """The same real tokens placed ``shift`` positions later (masked pads on both sides)."""
    return {k: np.roll(v, shift, axis=1) for k, v in tokens.items()}


@pytest.mark.parametrize("scheme", ["deberta", "deberta_v2", "rope", "alibi", "nope"])
def test_relative_only_schemes_are_shift_equivariant(scheme):
    """Without absolute positions, moving the real tokens by s moves the outputs by s."""
    cfg = text_config(scheme, max_relative_positions=8, max_position_embeddings=0,
                      position_biased_input=False,
                      **(dict(position_buckets=4, conv_kernel_size=3)
                         if scheme == "deberta_v2" else {}))
    params = params_for(TextEncoder, cfg)
    tokens = batch((14, 9, 11, 0))   # + shift <= L: no wrap-around
    out = np.asarray(TextEncoder(cfg).apply(params, **tokens))
    for shift in (3, 10):
        moved = np.asarray(TextEncoder(cfg).apply(params, **_shifted(tokens, shift)))
        real = tokens["attention_mask"][..., None].astype(bool)
        assert max_abs_error(np.roll(moved, -shift, axis=1), out, real) <= 1e-5


@pytest.mark.parametrize("scheme", ["bert_abs", "tupe_a", "bert_abs_d"])
def test_absolute_schemes_are_not_shift_equivariant(scheme):
    """Control for the test above: absolute positions do change with the shift."""
    cfg = SCHEMES[scheme]
    params = params_for(TextEncoder, cfg)
    tokens = batch((14, 9, 11, 0))
    out = np.asarray(TextEncoder(cfg).apply(params, **tokens))
    moved = np.asarray(TextEncoder(cfg).apply(params, **_shifted(tokens, 3)))
    real = tokens["attention_mask"][..., None].astype(bool)
    assert max_abs_error(np.roll(moved, -3, axis=1), out, real) > 1e-2


# --- TUPE: computed once, shared by every layer, [CLS] untied --------------------------------

@pytest.mark.parametrize("scheme", ["tupe_a", "tupe_r", "bert_rel", "bert_abs_d"])
def test_position_term_is_computed_once_and_shared_by_every_layer(scheme):
    cfg = text_config(scheme, num_layers=3)
    params = params_for(TextEncoder, cfg)
    calls = collections.Counter()
    layer_biases, layer_mixed = [], []

    def spy(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            if isinstance(context.module, (TupePositionBias, T5RelativeBias)):
                calls[type(context.module).__name__] += 1
            if isinstance(context.module, MultiHeadAttention):
                layer_biases.append(kwargs["bias"])
                layer_mixed.append((kwargs["position_query"], kwargs["position_key"]))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):
        TextEncoder(cfg).apply(params, **batch())
    expected_calls = {"TupePositionBias": int(scheme in ("tupe_a", "tupe_r", "bert_abs_d")),
                      "T5RelativeBias": int(scheme in ("tupe_r", "bert_rel"))}
    assert calls == +collections.Counter(expected_calls)
    assert len(layer_biases) == cfg.num_layers
    assert all(b is layer_biases[0] for b in layer_biases), "layers got different terms"
    p_enc = ref.to_float64(params["params"]["encoder"])
    expected = ref.position_terms(p_enc, cfg, L, [np.arange(L)], has_cls=True, is_grid=False)
    assert layer_biases[0].shape == (1, cfg.num_heads, L, L)   # broadcast over the batch
    assert max_abs_error(layer_biases[0][0], expected["bias"]) <= 1e-5
    if scheme != "bert_abs_d":
        assert all(m == (None, None) for m in layer_mixed)
        return
    # BERT-A-d's mixed terms: the position sides too are computed once, for the batch.
    assert all(m[0] is layer_mixed[0][0] and m[1] is layer_mixed[0][1] for m in layer_mixed)
    for name, value in zip(("position_query", "position_key"), layer_mixed[0]):
        assert value.shape == (L, cfg.num_heads, cfg.head_dim)
        assert max_abs_error(value, expected[name]) <= 1e-5


@pytest.mark.parametrize("tie_cls", [False, True])
def test_tupe_cls_row_and_column_are_theta(tie_cls):
    """Untied [CLS]: row 0 is θ1 = A[0, 0], column 0 (below it) θ2 = A[1, 1]; other pairs
    (i, j) read A[i + 1, j + 1]. tie_cls: no reset at all."""
    cfg = SCHEMES["tupe_a"]
    p = params_for(TextEncoder, cfg)["params"]["encoder"]["tupe_bias"]
    term = np.asarray(TupePositionBias(cfg.num_heads, cfg.head_dim, L, cfg.layer_norm_eps,
                                       untie_cls=not tie_cls).apply({"params": p}, L)["bias"])
    a = ref.tupe_table_correlation(ref.to_float64(p), L, cfg.num_heads, cfg.layer_norm_eps)
    if tie_cls:
        assert max_abs_error(term, a[:, 1:, 1:]) <= 1e-5
        return
    theta1, theta2 = a[:, 0, 0, None], a[:, 1, 1, None]     # (h, 1), broadcast over the row
    assert max_abs_error(term[:, 0, :], theta1) <= 1e-5
    assert max_abs_error(term[:, 1:, 0], theta2) <= 1e-5
    assert max_abs_error(term[:, 1:, 1:], a[:, 2:, 2:]) <= 1e-5


@pytest.mark.parametrize("grid", [None, (3, 4)])
def test_t5_cls_pairs_use_the_two_extra_buckets(grid):
    """[CLS] row -> bucket n/2 (never produced by j − i), column -> bucket n, per axis."""
    buckets, heads = 8, 2
    length = 12 + 1
    module = T5RelativeBias(heads, buckets, 8, untie_cls=True, grid=grid)
    variables = nn.meta.unbox(module.init(jax.random.key(0), length))
    table = np.asarray(variables["params"]["rel_bias"])
    bias = np.asarray(module.apply(variables, length))
    cls_row = table[:, buckets // 2].sum(0)[:, None]      # summed over the axes: (h, 1)
    cls_column = table[:, buckets].sum(0)[:, None]
    assert max_abs_error(bias[:, 0, :], cls_row) <= 1e-6
    assert max_abs_error(bias[:, 1:, 0], cls_column) <= 1e-6


# --- masking ----------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_masked_keys_get_zero_weight(scheme, monkeypatch):
    """Every attention map (each layer, and the EMD) gives pad keys exactly zero weight; rows
    with visible keys sum to 1, rows without any are all zero; pad ids do not matter."""
    cfg = SCHEMES[scheme]
    params = params_for(TextForMaskedLM, cfg)
    recorded = []

    def recording_weights(logits, mask):
        weights = attention_weights(logits, mask)
        recorded.append((np.asarray(weights), np.broadcast_to(np.asarray(mask), weights.shape)))
        return weights

    attention_weights = attention_lib.attention_weights
    monkeypatch.setattr(attention_lib, "attention_weights", recording_weights)
    tokens = batch()
    decode = np.tile(np.arange(3, dtype=np.int32), (len(LENGTHS), 1))
    logits = TextForMaskedLM(cfg).apply(params, **tokens, masked_positions=decode)
    assert len(recorded) == cfg.num_layers + (2 if cfg.use_emd else 0)
    pad_keys = ~tokens["attention_mask"].astype(bool)[:, None, None, :]
    for weights, mask in recorded:
        assert np.all(np.isfinite(weights))
        assert np.all(weights[np.broadcast_to(pad_keys, weights.shape)] == 0.0)
        assert np.all(weights[~mask] == 0.0)
        visible_rows = mask.any(-1)
        np.testing.assert_allclose(weights.sum(-1)[visible_rows], 1.0, atol=1e-6)
        assert np.all(weights.sum(-1)[~visible_rows] == 0.0)

    monkeypatch.undo()
    other_pads = dict(tokens)
    pads = tokens["attention_mask"] == 0
    other_pads["input_ids"] = np.where(pads, VOCAB - 1, tokens["input_ids"])
    other_pads["token_type_ids"] = np.where(pads, 1, tokens["token_type_ids"])
    relogits = TextForMaskedLM(cfg).apply(params, **other_pads, masked_positions=decode)
    rows = np.asarray(LENGTHS) >= 3   # rows whose decoded positions are all real tokens
    np.testing.assert_array_equal(np.asarray(relogits)[rows], np.asarray(logits)[rows])


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fully_padded_rows_give_no_nan(scheme):
    cfg = SCHEMES[scheme]
    tokens = batch((0, 0, 0, 0))
    logits = TextForMaskedLM(cfg).apply(params_for(TextForMaskedLM, cfg), **tokens)
    assert np.all(np.isfinite(np.asarray(logits)))
    classify = TextForSequenceClassification(cfg)
    out = classify.apply(random_params(classify, **tokens), **tokens)
    assert np.all(np.isfinite(np.asarray(out)))


# --- models used by the sharding, gradient and precision tests ---------------------------------

def _vit(**overrides) -> ViTConfig:
    fields = dict(image_size=(16, 12), patch_size=4, hidden_size=32, num_heads=4, num_layers=2,
                  mlp_dim=64, num_classes=5)
    return ViTConfig(**{**fields, **overrides})


MODELS = {
    # v2 with every option that adds parameters: separate position projections, table LN,
    # conv layer, EMD (absolute table) and the MLM head.
    "deberta_v2 EMD masked LM": (TextForMaskedLM, text_config(
        "deberta_v2", position_buckets=8, max_relative_positions=16, norm_rel_ebd=True,
        conv_kernel_size=3, use_emd=True, position_biased_input=False)),
    # TUPE table + T5 table, factorised embeddings, pooler and classifier.
    "tupe_r classification": (TextForSequenceClassification, text_config(
        "tupe_r", embedding_size=16)),
    # RoPE on queries and keys, the MLM head.
    "rope masked LM": (TextForMaskedLM, text_config("rope", max_position_embeddings=0)),
    # ALiBi's fixed per-head slopes on a grid, average pooling.
    "vit alibi gap": (ViT, _vit(position_scheme="alibi", pooling="gap", num_classes=4)),
    # Axial 2D RoPE with an unrotated [CLS]; the fixed 2D sin-cos table.
    "vit rope token": (ViT, _vit(position_scheme="rope", num_classes=4)),
    "vit sincos2d token": (ViT, _vit(position_scheme="sincos2d")),
    # ResNet stem (one stage: root conv, projected bottleneck unit), TUPE + 2D T5, MAP head.
    "vit hybrid tupe_r map pre_logits": (ViT, _vit(
        position_scheme="tupe_r", image_size=8, patch_size=1, resnet_layers=(1,),
        resnet_width=32, pooling="map", representation_size=8)),
}


def model_and_inputs(name: str) -> tuple[nn.Module, dict, dict]:
    """(model, inputs, random params) for a MODELS entry; text rows include a fully padded one."""
    model_cls, cfg = MODELS[name]
    if model_cls is ViT:
        rng = np.random.default_rng(0)
        inputs = {"images": rng.normal(size=(4, *cfg.image_size, 3)).astype(np.float32)}
    else:
        inputs = batch()
    model = model_cls(cfg)
    return model, inputs, random_params(model, **inputs)


# --- sharding ---------------------------------------------------------------------------------

RULES = (("batch", "data"), ("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"),
         ("vocab", "tensor"))


def sharded_apply(model: nn.Module, inputs: dict, params: dict):
    """jit(model.apply) on a (data 2, fsdp 2, tensor 2) mesh of 8 devices, parameters laid out
    by their logical axes, the batch split over data. -> (output, parameter shardings)."""
    devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 2)
    mesh = Mesh(devices, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    specs = nn.get_partition_spec(abstract_variables(model, **inputs))
    shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    placed = jax.device_put(params, shardings)
    data = jax.device_put(inputs, NamedSharding(mesh, PartitionSpec("data")))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        out = jax.jit(model.apply)(placed, **data)
    return out, shardings


@pytest.mark.parametrize("name", ["deberta_v2 EMD masked LM", "rope masked LM", "vit alibi gap",
                                  "vit rope token"])
def test_sharded_forward_equals_single_device(name):
    """DeBERTa: disentangled attention, conv, EMD gathers, tied head; RoPE, ALiBi: the new
    position terms under heads split over the tensor axis."""
    model, inputs, params = model_and_inputs(name)
    single = np.asarray(model.apply(params, **inputs))
    out, shardings = sharded_apply(model, inputs, params)
    encoder = shardings["params"]["encoder"]
    layer = encoder.get("encoder", encoder)["layer_0"]["attention"]
    assert layer["query"]["kernel"].spec == PartitionSpec("fsdp", "tensor", None)
    assert layer["out"]["kernel"].spec == PartitionSpec("tensor", None, "fsdp")
    assert len(out.sharding.device_set) == 8
    err = max_abs_error(out, single)
    print(f"[sharded] {name}: max abs error vs single device {err:.2e}")
    assert err <= 1e-5


# --- gradients and precision ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_every_parameter_receives_a_gradient(name):
    """A random projection of the output has a non-zero, finite gradient for every leaf."""
    model, inputs, params = model_and_inputs(name)
    out_shape = jax.eval_shape(lambda p: model.apply(p, **inputs), params).shape
    probe = np.random.default_rng(1).normal(size=out_shape).astype(np.float32)
    grads = jax.jit(jax.grad(lambda p: (model.apply(p, **inputs) * probe).sum()))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    dead = [jax.tree_util.keystr(k) for k, g in flat if not np.any(np.asarray(g) != 0)]
    assert not dead, f"parameters without gradient: {dead}"
    assert all(np.all(np.isfinite(np.asarray(g))) for _, g in flat)


@pytest.mark.parametrize("name", ["deberta_v2 EMD masked LM", "rope masked LM", "vit alibi gap",
                                  "vit rope token", "vit sincos2d token"])
def test_bf16_forward_is_close_to_fp32(name):
    model, inputs, params = model_and_inputs(name)
    fp32 = np.asarray(model.apply(params, **inputs))
    bf16_model = type(model)(dataclasses.replace(model.cfg, dtype="bfloat16"))
    bf16 = np.asarray(bf16_model.apply(params, **inputs), np.float32)
    assert np.all(np.isfinite(bf16))
    # bf16 keeps 8 mantissa bits (relative step 2^-8 ≈ 0.4%); two layers compound it to ~1-2%.
    relative = np.linalg.norm(bf16 - fp32) / np.linalg.norm(fp32)
    worst = np.abs(bf16 - fp32).max() / np.abs(fp32).max()
    print(f"[bf16] {name}: relative L2 error {relative:.3e}, max abs / max |fp32| {worst:.3e}")
    assert relative <= 0.03 and worst <= 0.1


@pytest.mark.parametrize("offset", [0.0, 10.0])
def test_layer_norm_equals_flax_in_values_and_gradients(offset):
    """posjax's LayerNorm (its backward written out) against nn.LayerNorm: same parameters,
    same outputs and gradients to fp32 rounding, also for inputs far from zero mean; bf16 in,
    bf16 out."""
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.standard_normal((3, 5, 48)) * 2.0 + offset, "float32")
    ours = attention_lib.layer_norm(1e-6, name="norm", dtype=jax.numpy.float32)
    flax_ln = nn.LayerNorm(epsilon=1e-6)
    params = nn.meta.unbox(ours.init(jax.random.key(0), x))
    assert jax.tree.map(np.shape, params) == jax.tree.map(
        np.shape, flax_ln.init(jax.random.key(0), x))
    params = jax.tree.map(lambda p: p + 0.3 * rng.standard_normal(p.shape), params)
    weights = jax.numpy.asarray(rng.standard_normal(x.shape), "float32")

    def loss(module, p, x):
        return (jax.numpy.tanh(module.apply(p, x)) * weights).sum()

    for a, b in zip(jax.tree.leaves(jax.value_and_grad(functools.partial(loss, ours),
                                                       argnums=(0, 1))(params, x)),
                    jax.tree.leaves(jax.value_and_grad(functools.partial(loss, flax_ln),
                                                       argnums=(0, 1))(params, x))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(np.abs(b).max()))
    half = attention_lib.layer_norm(1e-6, name="norm", dtype=jax.numpy.bfloat16)
    y = half.apply(params, x.astype(jax.numpy.bfloat16))
    assert y.dtype == jax.numpy.bfloat16
    np.testing.assert_allclose(y.astype("float32"), flax_ln.apply(params, x), atol=0.05)
