"""Bad model input fails with one ValueError naming the field, its value and what is allowed,
when the config is built (or, for input shapes, when the call is traced), never as an XLA
shape error.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from model_inputs import padded_text_batch, random_params
from posjax import TextConfig, TextEncoder, TextForMaskedLM, ViT, ViTConfig

TINY = dict(hidden_size=16, num_heads=2, num_layers=2, mlp_dim=32, vocab_size=20)
TINY_VIT = dict(hidden_size=16, num_heads=2, num_layers=1, mlp_dim=32, num_classes=2)

# (config class, fields, substrings the message must contain: field=value and the rule)
BAD_CONFIGS = {
    "unknown text scheme": (TextConfig, dict(position_scheme="xpos"),
                            ["position_scheme='xpos'", "bert_abs", "deberta_v2"]),
    "unknown vit scheme": (ViTConfig, dict(position_scheme="kerple"),
                           ["position_scheme='kerple'", "vit", "tupe_r"]),
    "hidden not divisible by heads": (TextConfig, dict(hidden_size=30, num_heads=4),
                                      ["hidden_size=30", "divisible by num_heads=4"]),
    "vit hidden not divisible by heads": (ViTConfig, dict(hidden_size=100, num_heads=12),
                                          ["hidden_size=100", "num_heads=12"]),
    "image not divisible by patch": (ViTConfig, dict(image_size=30, patch_size=16),
                                     ["image_size=(30, 30)", "30", "patch_size 16"]),
    "image width not divisible by patch": (ViTConfig, dict(image_size=(32, 40), patch_size=16),
                                           ["image_size=(32, 40)", "side 40"]),
    "image not divisible by the hybrid stem": (
        ViTConfig, dict(image_size=72, patch_size=1, resnet_layers=(3, 4, 9)),
        ["image_size=(72, 72)", "stem stride 16"]),
    "EMD without absolute positions": (
        TextConfig, dict(position_scheme="deberta", use_emd=True, position_biased_input=False,
                         max_position_embeddings=0),
        ["max_position_embeddings=0", "must be > 0", "with use_emd=True reads an absolute table"]),
    "EMD outside DeBERTa": (TextConfig, dict(position_scheme="tupe_a", use_emd=True),
                            ["use_emd=True", "deberta"]),
    "a string for a number": (TextConfig, dict(dropout_rate="0.1"),
                              ["dropout_rate='0.1'", "must be a number"]),
    "a float for an integer": (TextConfig, dict(vocab_size=3.5),
                               ["vocab_size=3.5", "must be an integer"]),
    "a bool for an integer": (TextConfig, dict(hidden_size=True),
                              ["hidden_size=True", "must be an integer"]),
    "no channels": (ViTConfig, dict(num_channels=0), ["num_channels=0", "> 0"]),
    "hybrid stem of width 0": (
        ViTConfig, dict(image_size=64, patch_size=1, resnet_layers=(3,), resnet_width=0),
        ["resnet_width=0", "> 0"]),
    "hybrid stem width GroupNorm cannot split": (
        ViTConfig, dict(image_size=64, patch_size=1, resnet_layers=(3,), resnet_width=8),
        ["resnet_width=8", "multiple of 32"]),
    "EMD with positions added to the input": (
        TextConfig, dict(position_scheme="deberta_v2", use_emd=True, position_biased_input=True),
        ["use_emd=True", "position_biased_input=False"]),
    "EMD with factorised embeddings": (
        TextConfig, dict(position_scheme="deberta_v2", use_emd=True, embedding_size=8),
        ["embedding_size=8", "hidden_size=16"]),
    "absolute scheme without a table": (TextConfig, dict(max_position_embeddings=0),
                                        ["max_position_embeddings=0", "bert_abs"]),
    "unknown DeBERTa position term": (TextConfig, dict(position_scheme="deberta",
                                                       pos_att_type=("c2p", "p2p")),
                                      ["pos_att_type=('c2p', 'p2p')", "c2p", "p2c"]),
    "one position bucket (transformers divides by zero)": (
        TextConfig, dict(position_scheme="deberta_v2", position_buckets=1),
        ["position_buckets=1", ">= 2"]),
    "odd T5 buckets": (TextConfig, dict(position_scheme="tupe_r", relative_buckets=31),
                       ["relative_buckets=31", "even"]),
    "unknown gather": (TextConfig, dict(position_scheme="deberta", gather="scatter"),
                       ["gather='scatter'", "take", "onehot", "shift", "skew"]),
    "conv layer outside v2": (TextConfig, dict(position_scheme="deberta", conv_kernel_size=3),
                              ["conv_kernel_size=3", "deberta_v2"]),
    "shared attention key in v1": (TextConfig, dict(position_scheme="deberta",
                                                   share_att_key=True),
                                   ["share_att_key=True", "deberta_v2"]),
    "relative-table LayerNorm in v1 (ViT)": (
        ViTConfig, dict(position_scheme="deberta", pooling="gap", norm_rel_ebd=True),
        ["norm_rel_ebd=True", "deberta_v2"]),
    "even conv kernel": (TextConfig, dict(position_scheme="deberta_v2", conv_kernel_size=4),
                         ["conv_kernel_size=4", "odd"]),
    "DeBERTa on images with [CLS] pooling": (
        ViTConfig, dict(position_scheme="deberta", pooling="token"),
        ["pooling='token'", "gap", "map"]),
    "dropout of one": (TextConfig, dict(dropout_rate=1.0), ["dropout_rate=1.0", "[0, 1)"]),
    "conv in no groups": (TextConfig, dict(position_scheme="deberta_v2", conv_kernel_size=3,
                                           conv_groups=0), ["conv_groups=0", "> 0"]),
    "conv in negative groups that divide the width": (
        TextConfig, dict(position_scheme="deberta_v2", conv_kernel_size=3, conv_groups=-2),
        ["conv_groups=-2", "> 0"]),
    "negative odd conv kernel": (TextConfig, dict(position_scheme="deberta_v2",
                                                  conv_kernel_size=-3),
                                 ["conv_kernel_size=-3", ">= 0"]),
    "no DeBERTa position terms as None": (TextConfig, dict(position_scheme="deberta",
                                                           pos_att_type=None),
                                          ["pos_att_type=None", "'c2p|p2c'"]),
    "a DeBERTa position term twice (the scale counts terms)": (
        ViTConfig, dict(position_scheme="deberta", pooling="gap", pos_att_type="c2p|c2p"),
        ["pos_att_type='c2p|c2p'", "twice"]),
    "log buckets with no range to spread over": (
        TextConfig, dict(position_scheme="deberta_v2", position_buckets=2,
                         max_relative_positions=2),
        ["max_relative_positions=2", "position_buckets // 2 = 1", "log("]),
    "hybrid stem depth as a number": (ViTConfig, dict(resnet_layers=3),
                                      ["resnet_layers=3", "tuple"]),
}


@pytest.mark.parametrize("cls", [TextConfig, ViTConfig])
def test_pos_att_type_string_is_split_on_bars(cls):
    """'c2p|p2c' (HF's spelling, and a command-line override) means both terms, for both configs."""
    extra = dict(image_size=32, patch_size=16, pooling="gap") if cls is ViTConfig else {}
    base = {**(TINY_VIT if cls is ViTConfig else TINY), **extra, "position_scheme": "deberta"}
    assert cls(**base, pos_att_type="c2p|p2c").pos_att_type == ("c2p", "p2c")
    assert cls(**base, pos_att_type="p2c").pos_att_type == ("p2c",)


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_raises_value_error_naming_field_value_and_rule(name):
    cls, fields, expected = BAD_CONFIGS[name]
    base = TINY_VIT if cls is ViTConfig else TINY
    if cls is ViTConfig:
        base = {**base, "image_size": 32, "patch_size": 16}
    with pytest.raises(ValueError) as info:
        cls(**{**base, **fields})
    for text in expected:
        assert text in str(info.value), f"{text!r} missing from: {info.value}"


def test_numpy_scalars_become_python_numbers():
    """Sizes computed with numpy pass the type checks; they are stored as Python numbers, so
    that the config saves as JSON (save_checkpoint, train.py's config.json)."""
    import dataclasses
    import json
    cfg = TextConfig(**{**TINY, "vocab_size": np.int64(20)}, dropout_rate=np.float32(0.5))
    assert type(cfg.vocab_size) is int and type(cfg.dropout_rate) is float
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["vocab_size"] == 20


def test_unknown_config_field_is_named():
    with pytest.raises(ValueError, match=r"unknown TextConfig field\(s\) \['hiden_size'\]"):
        TextConfig.from_dict({"hiden_size": 16})


# --- input shapes, checked when the call is traced -------------------------------------------

TABLE_SCHEMES = {
    "bert_abs": dict(position_scheme="bert_abs"),
    "bert_rel": dict(position_scheme="bert_rel"),
    "tupe_a": dict(position_scheme="tupe_a"),
    "tupe_r": dict(position_scheme="tupe_r"),
    "bert_abs_d": dict(position_scheme="bert_abs_d"),
    "deberta position_biased_input": dict(position_scheme="deberta"),
}


@pytest.mark.parametrize("scheme", list(TABLE_SCHEMES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sequence_longer_than_the_absolute_table(scheme, jit):
    cfg = TextConfig(**TINY, max_position_embeddings=16, **TABLE_SCHEMES[scheme])
    model = TextEncoder(cfg)
    params = random_params(model, **padded_text_batch((16,), 16, cfg.vocab_size))
    too_long = padded_text_batch((20,), 20, cfg.vocab_size)
    apply = jax.jit(model.apply) if jit else model.apply
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds max_position_embeddings=16"):
        apply(params, **too_long)


def test_emd_sequence_longer_than_the_absolute_table():
    cfg = TextConfig(**TINY, position_scheme="deberta_v2", position_biased_input=False,
                     use_emd=True, max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds max_position_embeddings=16"):
        random_params(TextForMaskedLM(cfg), **padded_text_batch((20,), 20, cfg.vocab_size))


def test_relative_only_deberta_has_no_length_limit():
    cfg = TextConfig(**TINY, position_scheme="deberta", position_biased_input=False,
                     max_position_embeddings=0, max_relative_positions=4)
    model = TextEncoder(cfg)
    params = random_params(model, **padded_text_batch((16,), 16, cfg.vocab_size))
    tokens = padded_text_batch((30,), 30, cfg.vocab_size)
    out = jax.eval_shape(lambda p, t: model.apply(p, **t), params, tokens)
    assert out.shape == (1, 30, 16)


def test_images_of_the_wrong_size_are_named():
    cfg = ViTConfig(**TINY_VIT, image_size=32, patch_size=16)
    model = ViT(cfg)
    params = random_params(model, np.zeros((1, 32, 32, 3), np.float32))
    with pytest.raises(ValueError, match=r"images have shape \(48, 32, 3\).*image_size=\(32, 32\)"):
        model.apply(params, np.zeros((1, 48, 32, 3), np.float32))
    with pytest.raises(ValueError, match=r"images \(32, 32, 3\) must be \(B, H, W, C\)"):
        model.apply(params, np.zeros((32, 32, 3), np.float32))


def test_token_inputs_of_the_wrong_shape_or_dtype_are_named():
    cfg = TextConfig(**TINY, position_scheme="bert_abs", max_position_embeddings=16)
    model = TextForMaskedLM(cfg)
    ids = np.ones((2, 6), np.int32)
    mask = np.ones((2, 6), np.int32)
    params = random_params(model, input_ids=ids, attention_mask=mask)
    cases = [
        (dict(input_ids=ids[0], attention_mask=mask[0]), r"input_ids \(6,\) int32 must be"),
        (dict(input_ids=ids.astype(np.float32), attention_mask=mask), "must be integer"),
        (dict(input_ids=ids, attention_mask=mask[:, :5]),
         r"attention_mask \(2, 5\) must have the shape of input_ids \(2, 6\)"),
        (dict(input_ids=ids, attention_mask=mask, token_type_ids=ids[:, :5]),
         r"token_type_ids \(2, 5\)"),
        (dict(input_ids=ids, attention_mask=mask, masked_positions=np.array([1, 2])),
         r"masked_positions \(2,\) int64 must be integer \(B=2, M\)"),
        (dict(input_ids=ids, attention_mask=mask, masked_positions=np.ones((2, 2), np.float32)),
         r"masked_positions \(2, 2\) float32"),
        (dict(input_ids=ids, attention_mask=mask, masked_positions=[[1], [2]]),
         r"masked_positions must be an array \(numpy or jax\), not list: pass "
         r"np\.asarray\(masked_positions\)"),
        (dict(input_ids=ids.tolist(), attention_mask=mask),
         r"input_ids must be an array \(numpy or jax\), not list"),
        (dict(input_ids=ids, attention_mask=None),
         r"attention_mask is None: pass the \(B, L\) mask of real tokens"),
    ]
    for inputs, match in cases:
        with pytest.raises(ValueError, match=match):
            model.apply(params, **inputs)


def test_embeddings_called_directly_behave_like_nn_embed():
    """TextEmbeddings on its own: float ids are refused; a one-row token-type table (RoBERTa's
    type_vocab_size=1) gives its row for every type id, as nn.Embed does (take would give NaN)."""
    from posjax.models.text import TextEmbeddings
    module = TextEmbeddings(TextConfig(**TINY, position_scheme="bert_abs",
                                       max_position_embeddings=16, type_vocab_size=1))
    ids = np.ones((2, 6), np.int32)
    variables = module.init(jax.random.PRNGKey(0), ids, ids.astype(bool), None, False)
    zeros, _ = module.apply(variables, ids, ids.astype(bool), np.zeros_like(ids), False)
    ones, _ = module.apply(variables, ids, ids.astype(bool), ids, False)
    assert np.all(np.isfinite(ones)) and np.array_equal(zeros, ones)
    with pytest.raises(ValueError, match="token ids must be integers, not float32"):
        module.apply(variables, ids.astype(np.float32), ids.astype(bool), None, False)


def test_attention_blocks_refuse_inputs_they_would_misread():
    """A (B, L) token mask with B == L would broadcast as a query-by-key mask; a relative
    table of another size would be read with clamped or shifted indices."""
    from posjax.layers.attention import MultiHeadAttention
    from posjax.layers.disentangled import DisentangledAttention
    from posjax.layers.position_bias import TupePositionBias
    from posjax.layers.positions import t5_bucket_matrix
    x = np.ones((4, 4, 16), np.float32)
    token_mask = np.ones((4, 4), bool)
    mha = MultiHeadAttention(num_heads=2, head_dim=8, logit_scale=0.25)
    params = mha.init(jax.random.PRNGKey(0), x, x)
    with pytest.raises(ValueError, match=r"mask \(4, 4\) must be .* m\[:, None, None, :\]"):
        mha.apply(params, x, x, mask=token_mask)
    rows = np.ones((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="give position_query and position_key together"):
        mha.apply(params, x, x, position_key=rows)
    with pytest.raises(ValueError, match=r"position_key \(3, 2, 8\) must be \(L=4, heads=2, "):
        mha.apply(params, x, x, position_query=rows, position_key=rows[:3])
    att = DisentangledAttention(num_heads=2, head_dim=8, pos_att_type=("c2p", "p2c"), span=4,
                                max_relative_positions=4)
    table = np.ones((8, 16), np.float32)
    params = att.init(jax.random.PRNGKey(0), x, x, rel_table=table)
    for rows in (4, 6, 16):
        with pytest.raises(ValueError, match=rf"rel_table \({rows}, 16\) must have .* 8 rows"):
            att.apply(params, x, x, rel_table=np.ones((rows, 16), np.float32))
    with pytest.raises(ValueError, match="give query_positions"):
        att.apply(params, x[:, :3], x, rel_table=table)
    with pytest.raises(ValueError, match="length 10 exceeds max_len=8"):
        TupePositionBias(num_heads=2, head_dim=8, max_len=8).init(jax.random.PRNGKey(0), 10)
    with pytest.raises(ValueError, match=r"length 7 does not fit grid 2x3: it needs 6 tokens"):
        t5_bucket_matrix(7, 32, 128, False, (2, 3))
