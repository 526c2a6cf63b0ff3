"""RoPE, ALiBi, NoPE and the 2D sin-cos table beyond the float64 references: RoPE equals
transformers' Llama attention (half-split pairing), the ALiBi slopes are the paper's, the
FLOP count of the new schemes is the content attention's, and configs that cannot hold them
are refused with the field named."""
from __future__ import annotations

import numpy as np
import pytest

from posjax import TextConfig, ViTConfig
from posjax.layers import positions
from posjax.layers.attention import MultiHeadAttention
from posjax.models.schemes import SCHEMES, TEXT_SCHEMES, VIT_SCHEMES
from posjax.models.flops import encoder_forward_flops, position_flops


def llama_attention(hidden: int, heads: int, base: float, seed: int):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    config = transformers.LlamaConfig(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
        attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": base})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    attention = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_(0.0, 0.3)
    return attention, modeling_llama.LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("length,base", [(5, 10000.0), (64, 10000.0), (300, 500.0)])
def test_rope_equals_transformers_llama_attention(length, base):
    """Bidirectional (no causal mask), right-padded keys masked; fp32 max abs diff <= 1e-5.

    transformers computes the angle p·ω in float32, posjax in float64 (then cos, sin in
    float32): at p = 300 the two angles differ by up to ~300·2^-24 rad. So HF's own cos/sin are
    checked against ours to that bound, and the attention is compared with ours fed to both
    (in HF's layout, cos(θ) repeated over both halves), which tests the pairing exactly."""
    torch = pytest.importorskip("torch")
    hidden, heads = 32, 4
    attention, rotary = llama_attention(hidden, heads, base, seed=length)
    rng = np.random.default_rng(length)
    x = rng.normal(size=(2, length, hidden)).astype(np.float32)
    lengths = np.array([length, max(length // 2, 1)])
    keys = np.arange(length)[None] < lengths[:, None]                   # (B, L)
    additive = np.where(keys, 0.0, np.finfo(np.float32).min)[:, None, None, :]
    d = hidden // heads
    cos_ours, sin_ours = positions.rotary_angles([np.arange(length)], np.ones(length, bool), d,
                                                 base)
    with torch.no_grad():
        xt = torch.tensor(x)
        cos, sin = rotary(xt, torch.arange(length)[None])
        for theirs_table, ours_table in ((cos, cos_ours), (sin, sin_ours)):
            halves = np.concatenate([ours_table[:, 0]] * 2, axis=-1)     # (L, d)
            assert np.abs(theirs_table[0].numpy() - halves).max() <= 2 * length * 2.0 ** -24
        cos, sin = (torch.tensor(np.concatenate([t[:, 0]] * 2, axis=-1))[None]
                    for t in (cos_ours, sin_ours))
        theirs = attention(xt, (cos, sin), attention_mask=torch.tensor(additive,
                                                                       dtype=torch.float32))[0]
    w = {n: getattr(attention, f"{n}_proj") for n in ("q", "k", "v", "o")}

    def projection(linear) -> dict:
        return {"kernel": linear.weight.detach().numpy().T.reshape(hidden, heads, d),
                "bias": linear.bias.detach().numpy().reshape(heads, d)}

    params = {"query": projection(w["q"]), "key": projection(w["k"]),
              "value": projection(w["v"]),
              "out": {"kernel": w["o"].weight.detach().numpy().T.reshape(heads, d, hidden),
                      "bias": w["o"].bias.detach().numpy()}}
    ours = MultiHeadAttention(num_heads=heads, head_dim=d, logit_scale=d ** -0.5).apply(
        {"params": params}, x, x, mask=keys[:, None, None, :], rotary=(cos_ours, sin_ours))
    diff = np.abs(np.asarray(ours) - theirs.numpy())[keys].max()
    assert diff <= 1e-5, f"max abs diff {diff:.2e}"


def test_rope_is_a_rotation_by_the_position_difference():
    """q_i·k_j after RoPE depends on i − j only (the property RoPE is built for)."""
    d, length = 8, 12
    cos, sin = positions.rotary_angles([np.arange(length)], np.ones(length, bool), d, 100.0)
    from posjax.layers.attention import apply_rotary
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(1, 1, 1, d)), rng.normal(size=(1, 1, 1, d))
    qs = np.asarray(apply_rotary(np.repeat(q, length, 1).astype(np.float32), cos, sin))[0, :, 0]
    ks = np.asarray(apply_rotary(np.repeat(k, length, 1).astype(np.float32), cos, sin))[0, :, 0]
    dots = qs @ ks.T
    for offset in (-5, 0, 3):
        diagonal = np.diagonal(dots, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,slopes", [
    (8, [2.0 ** -k for k in range(1, 9)]),
    (4, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]),
    # 6 heads: the 4-head slopes, then slopes 1 and 3 of the 8-head sequence (Press et al.).
    (6, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]),
    (1, [2.0 ** -8]),
])
def test_alibi_slopes_are_the_papers(heads, slopes):
    np.testing.assert_allclose(positions.alibi_slopes(heads), slopes, rtol=1e-7)


def test_sincos_table_first_rows():
    """Patch (0, 0): sin 0 = 0, cos 0 = 1 in each half; patch (0, 1): x = 1, ω_0 = 1."""
    table = positions.sincos_2d_table((2, 3), 8)
    np.testing.assert_allclose(table[0], [0, 0, 1, 1, 0, 0, 1, 1], atol=1e-7)
    np.testing.assert_allclose(table[1, :4], [np.sin(1), np.sin(1e-4), np.cos(1), np.cos(1e-4)],
                               rtol=1e-6)
    np.testing.assert_allclose(table[3, 4:], [np.sin(1), np.sin(1e-4), np.cos(1), np.cos(1e-4)],
                               rtol=1e-6)


@pytest.mark.parametrize("scheme", ["rope", "alibi", "nope"])
def test_new_schemes_add_no_matmul_flops(scheme):
    base = TextConfig(position_scheme="bert_abs", hidden_size=64, num_heads=4, num_layers=2,
                      mlp_dim=128, max_position_embeddings=64)
    cfg = TextConfig(position_scheme=scheme, hidden_size=64, num_heads=4, num_layers=2,
                     mlp_dim=128, max_position_embeddings=0)
    assert position_flops(cfg, 64) == position_flops(base, 64)
    assert encoder_forward_flops(cfg, 64) == encoder_forward_flops(base, 64)


def test_scheme_table_is_the_list_of_schemes():
    assert set(TEXT_SCHEMES) >= {"rope", "alibi", "nope", "bert_abs", "deberta_v2"}
    assert {"sincos2d", "vit", "rope"} <= set(VIT_SCHEMES) and "sincos2d" not in TEXT_SCHEMES
    for name, scheme in SCHEMES.items():
        for f in scheme.fields:
            assert f in {f.name for f in __import__("dataclasses").fields(TextConfig)} | {
                f.name for f in __import__("dataclasses").fields(ViTConfig)}, (name, f)


@pytest.mark.parametrize("make,fields,message", [
    (TextConfig, dict(position_scheme="rope", hidden_size=36, num_heads=4),
     ["hidden_size=36", "divisible by 2"]),
    (ViTConfig, dict(position_scheme="rope", hidden_size=24, num_heads=4, image_size=32,
                     patch_size=8, mlp_dim=8), ["hidden_size=24", "per grid axis",
                                                "divisible by 4"]),
    (TextConfig, dict(position_scheme="rope", rope_base=1.0), ["rope_base=1.0", "> 1"]),
    (ViTConfig, dict(position_scheme="sincos2d", hidden_size=4, num_heads=1, image_size=32,
                     patch_size=8, mlp_dim=8), ["hidden_size=4", "at least 8"]),
    (ViTConfig, dict(position_scheme="sincos2d", hidden_size=30, num_heads=3, image_size=32,
                     patch_size=8, mlp_dim=8), ["hidden_size=30", "multiple of 4"]),
    (TextConfig, dict(position_scheme="sincos2d"), ["position_scheme='sincos2d'", "rope"]),
    (TextConfig, dict(position_scheme="rotary"), ["position_scheme='rotary'", "alibi"]),
])
def test_configs_the_schemes_cannot_hold_are_refused(make, fields, message):
    with pytest.raises(ValueError) as raised:
        make(**fields)
    for part in message:
        assert part in str(raised.value), (part, str(raised.value))
