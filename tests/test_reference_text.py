"""Text models against the float64 numpy reference (tests/reference.py): fp32 error <= 1e-5.

Each case runs on a right-padded batch (one full row, two padded rows, one fully padded row).
Every layer's hidden states are compared on real tokens and MLM / classification logits where
they read real tokens; all outputs, pads and the fully padded row included, must be finite.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import reference as ref
from model_inputs import max_abs_error, padded_text_batch, random_params
from posjax import TextConfig, TextForMaskedLM, TextForSequenceClassification
from posjax.layers import positions
from posjax.models.layout import to_layout

TOL = 1e-5
VOCAB = 40
SHORT = (24, 19, 5, 0)    # lengths per row: full, padded, short, fully padded (L = 24)
LONG = (40, 33, 7, 0)     # L = 40: DeBERTa-v2 log buckets beyond max_position (32)


def text_config(scheme: str, **overrides) -> TextConfig:
    fields = dict(position_scheme=scheme, vocab_size=VOCAB, hidden_size=32, num_heads=4,
                  num_layers=2, mlp_dim=64, max_position_embeddings=24, dropout_rate=0.0,
                  attention_dropout_rate=0.0)
    return TextConfig(**{**fields, **overrides})


def masked_positions(lengths: tuple[int, ...], count: int = 3, seed: int = 1) -> np.ndarray:
    """(B, count) sorted distinct real-token positions per row (0..count-1 for an empty row)."""
    rng = np.random.default_rng(seed)
    return np.stack([np.sort(rng.choice(n, count, replace=False)) if n >= count
                     else np.arange(count) for n in lengths]).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _params(model_cls, cfg: TextConfig, max_len: int) -> dict:
    # Neither the gather method nor scan_layers changes the parameters (scan_layers only their
    # layout): cases differing only in them share the same unrolled draw.
    model = model_cls(dataclasses.replace(cfg, gather="take", scan_layers=False))
    batch = padded_text_batch((max_len,), max_len, cfg.vocab_size)
    return random_params(model, **batch)


def model_params(params: dict, cfg: TextConfig) -> dict:
    """The unrolled reference draw in the layout the model with ``cfg`` expects."""
    return {"params": to_layout(params["params"], cfg.scan_layers)}


def _assert_finite(tree) -> None:
    for x in (tree if isinstance(tree, (list, tuple)) else [tree]):
        assert np.all(np.isfinite(np.asarray(x))), "non-finite model output"


def mlm_error(cfg: TextConfig, lengths: tuple[int, ...]) -> float:
    """Max abs error of every layer (real tokens) and of the MLM logits at masked positions."""
    max_len = lengths[0]
    params = _params(TextForMaskedLM, cfg, max_len)
    batch = padded_text_batch(lengths, max_len, cfg.vocab_size)
    decode = masked_positions(lengths)

    def layers_and_logits(m, input_ids, attention_mask, token_type_ids, masked_positions):
        layers = m.encoder.hidden_states(input_ids, attention_mask, token_type_ids)[0]
        return layers, m(input_ids, attention_mask, token_type_ids, masked_positions)

    layers, logits = TextForMaskedLM(cfg).apply(model_params(params, cfg), **batch, masked_positions=decode,
                                                method=layers_and_logits)
    _assert_finite(layers)
    _assert_finite(logits)
    ref_layers, ref_logits = ref.masked_lm(
        ref.to_float64(params["params"]), cfg, batch["input_ids"],
        batch["attention_mask"].astype(bool), batch["token_type_ids"], decode)
    real = batch["attention_mask"][..., None].astype(bool)
    errors = [max_abs_error(a, b, real) for a, b in zip(layers, ref_layers)]
    decoded_real = np.take_along_axis(batch["attention_mask"], decode, 1)[..., None].astype(bool)
    errors.append(max_abs_error(logits, ref_logits, decoded_real))
    return max(errors)


def check(name: str, cfg: TextConfig, lengths: tuple[int, ...] = SHORT) -> None:
    err = mlm_error(cfg, lengths)
    print(f"[reference] {name}: max abs error {err:.2e}")
    assert err <= TOL, f"{name}: max abs error {err:.3e} > {TOL}"


# --- bucketing helpers, exhaustively ---------------------------------------------------------

def test_reference_buckets_match_hand_computed_values():
    # T5, 32 buckets / 128: exact below 8, then 8 + floor(8·log(n/8)/log 16); keys after: +16.
    rel = np.array([0, -1, -7, -8, -12, -127, -500, 1, 12, 500])
    np.testing.assert_array_equal(ref.t5_bucket(rel, 32, 128),
                                  [0, 1, 7, 8, 9, 15, 15, 17, 25, 31])
    # DeBERTa-v2, 8 buckets / max 32: mid 4; 5 -> 4 + ceil(3·log(5/4)/log(31/4)) = 5, …
    # Beyond max_position nothing is clamped: 39 -> 4 + ceil(3·log(39/4)/log(31/4)) = 8.
    r = np.array([0, 4, -4, 5, 10, 31, 39, -39, 130])
    np.testing.assert_array_equal(ref.deberta_log_bucket(r, 8, 32),
                                  [0, 4, -4, 5, 6, 7, 8, -8, 10])


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (16, 20), (8, 8), (6, 40)])
def test_t5_buckets_match_reference(buckets, max_distance):
    rel = np.arange(-300, 301)
    np.testing.assert_array_equal(positions.t5_relative_bucket(rel, buckets, max_distance),
                                  ref.t5_bucket(rel, buckets, max_distance))


@pytest.mark.parametrize("span,buckets,max_position", [(8, 0, 8), (32, 0, 32), (8, 8, 32),
                                                       (256, 256, 512), (16, 16, 20)])
def test_deberta_index_matches_reference(span, buckets, max_position):
    q = np.arange(0, 700, 7)
    k = np.arange(0, 600, 3)
    np.testing.assert_array_equal(
        positions.deberta_relative_index(q, k, span, buckets, max_position),
        ref.deberta_index(q[None], k, span, buckets, max_position)[0])


# --- BERT-A/R, TUPE-A/R and BERT-A-d ---------------------------------------------------------------------

BERT_TUPE = {
    "bert_abs": text_config("bert_abs"),
    "bert_rel": text_config("bert_rel", relative_buckets=16, relative_max_distance=20),
    "tupe_a": text_config("tupe_a"),
    "tupe_a/tie_cls": text_config("tupe_a", tie_cls=True),
    "tupe_r": text_config("tupe_r", relative_buckets=16, relative_max_distance=20),
    "tupe_r/tie_cls": text_config("tupe_r", tie_cls=True),
    "tupe_r/embedding_size": text_config("tupe_r", embedding_size=16, hidden_act="gelu_tanh"),
    "bert_abs_d": text_config("bert_abs_d"),
    "bert_abs_d/scan_layers": text_config("bert_abs_d", num_layers=3, scan_layers=True),
}


@pytest.mark.parametrize("name", list(BERT_TUPE))
def test_bert_tupe_match_reference(name):
    check(name, BERT_TUPE[name])


# --- today's baselines: RoPE, ALiBi, NoPE (no table: any length) ---------------------------------

MODERN = {
    "rope": text_config("rope"),
    "rope base 100 remat": text_config("rope", rope_base=100.0, remat=True),
    "rope scan_layers": text_config("rope", num_layers=3, scan_layers=True),
    "alibi": text_config("alibi"),
    "alibi 6 heads (slopes of 4, then every other of 8)": text_config(
        "alibi", hidden_size=48, num_heads=6),
    "nope": text_config("nope", max_position_embeddings=0),
}


@pytest.mark.parametrize("name", list(MODERN))
def test_modern_schemes_match_reference(name):
    check(name, MODERN[name])
    check(f"{name} (L = 40, longer than max_position_embeddings)", MODERN[name], LONG)


# --- DeBERTa v1 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("gather", ["take", "onehot", "shift", "skew"])
@pytest.mark.parametrize("pos_att_type", [("c2p",), ("p2c",), ("c2p", "p2c")])
def test_deberta_v1_clamped_matches_reference(pos_att_type, gather):
    # k = 8 < L = 24: relative distances beyond ±8 are clamped to the table ends.
    cfg = text_config("deberta", max_relative_positions=8, pos_att_type=pos_att_type,
                      gather=gather, type_vocab_size=0)
    check(f"deberta v1 k=8 {'+'.join(pos_att_type)} {gather}", cfg)


@pytest.mark.parametrize("gather", ["take", "onehot", "shift", "skew"])
def test_deberta_v1_wide_span_matches_reference(gather):
    # k = 32 > L = 24: only the centre 2L rows of the table are used.
    cfg = text_config("deberta", max_relative_positions=32, gather=gather,
                      position_biased_input=False, max_position_embeddings=0)
    check(f"deberta v1 k=32 c2p+p2c {gather}", cfg)


def test_deberta_v1_emd_matches_reference():
    cfg = text_config("deberta", max_relative_positions=8, position_biased_input=False,
                      use_emd=True, num_layers=3)
    check("deberta v1 EMD", cfg)


# --- DeBERTa v2 (L = 40) -------------------------------------------------------------------------

V2 = dict(position_buckets=8, max_relative_positions=32, max_position_embeddings=40)
DEBERTA_V2 = {
    "v2 log-buckets separate-keys take": dict(**V2, position_biased_input=False),
    "v2 log-buckets share_att_key norm_rel_ebd shift EMD": dict(
        **V2, share_att_key=True, norm_rel_ebd=True, gather="shift", use_emd=True,
        position_biased_input=False),
    "v2 conv position_biased_input embedding_size onehot": dict(
        **V2, share_att_key=True, conv_kernel_size=3, conv_groups=2, embedding_size=16,
        gather="onehot"),
    "v2 no-buckets k=16 p2c shift": dict(
        max_relative_positions=16, max_position_embeddings=0, position_biased_input=False,
        pos_att_type=("p2c",), gather="shift"),
    "v2 log-buckets c2p onehot norm_rel_ebd": dict(
        **V2, pos_att_type=("c2p",), norm_rel_ebd=True, gather="onehot"),
    "v2 log-buckets share_att_key skew": dict(   # 2L − 1 = 79 distances > R = 16 rows
        **V2, share_att_key=True, gather="skew", position_biased_input=False),
}


@pytest.mark.parametrize("name", list(DEBERTA_V2))
def test_deberta_v2_matches_reference(name):
    check(f"deberta {name}", text_config("deberta_v2", **DEBERTA_V2[name]), LONG)


# --- every scheme below, at and above each of its limits ----------------------------------------

def _limit_lengths(limit: int) -> list[int]:
    return sorted({max(limit - 1, 1), limit, limit + 1, 2 * limit + 3})


LIMITS = {   # name: (config, the limit the sequence lengths straddle)
    "bert_rel T5 max_distance": (text_config("bert_rel", relative_buckets=8,
                                             relative_max_distance=6, max_position_embeddings=16), 6),
    "tupe_r T5 max_distance": (text_config("tupe_r", relative_buckets=8, relative_max_distance=6,
                                           max_position_embeddings=16), 6),
    "tupe_a table rows": (text_config("tupe_a", max_position_embeddings=9), 9),
    "bert_abs_d table rows": (text_config("bert_abs_d", max_position_embeddings=9), 9),
    "deberta v1 span": (text_config("deberta", max_relative_positions=6, type_vocab_size=0,
                                    max_position_embeddings=16, position_biased_input=False,
                                    use_emd=True), 6),
    "deberta_v2 buckets": (text_config("deberta_v2", position_buckets=6,
                                       max_relative_positions=12, max_position_embeddings=32,
                                       position_biased_input=False, use_emd=True), 6),
    "deberta_v2 max_relative_positions": (text_config(
        "deberta_v2", position_buckets=6, max_relative_positions=12, max_position_embeddings=32,
        position_biased_input=False, use_emd=True, gather="shift"), 12),
}


@pytest.mark.parametrize("name", list(LIMITS))
def test_every_scheme_at_its_limits_matches_reference(name):
    """Lengths limit − 1, limit, limit + 1 and 2·limit + 3 (capped by the absolute table):
    hidden states and MLM/EMD logits against the float64 reference."""
    cfg, limit = LIMITS[name]
    for length in _limit_lengths(limit):
        if length > (cfg.max_position_embeddings or length):
            continue
        check(f"{name} L={length}", cfg, (length, max(length - 2, 1), min(3, length), 0))


def test_absolute_tables_refuse_longer_sequences():
    """One row past the table: a clear error, not a silent clamp of the position index."""
    for scheme in ("bert_abs", "tupe_a", "bert_abs_d"):
        cfg = text_config(scheme, max_position_embeddings=9)
        with pytest.raises(ValueError, match="sequence length 10 exceeds max_position_embeddings=9"):
            mlm_error(cfg, (10, 8, 3, 0))


# --- classification head -------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [text_config("tupe_r", pooler_act="tanh"),
                                 text_config("bert_abs_d", num_layers=3, scan_layers=True),
                                 text_config("deberta_v2", position_buckets=8,
                                             max_relative_positions=32, pooler_act="gelu"),
                                 text_config("deberta_v2", position_buckets=8,
                                             max_relative_positions=32, scan_layers=True)],
                         ids=["tupe_r", "bert_abs_d scan_layers", "deberta_v2",
                              "deberta_v2 scan_layers"])
def test_classification_head_matches_reference(cfg):
    params = _params(TextForSequenceClassification, cfg, SHORT[0])
    batch = padded_text_batch(SHORT, SHORT[0], VOCAB)
    logits = TextForSequenceClassification(cfg).apply(model_params(params, cfg), **batch)
    _assert_finite(logits)
    expected = ref.sequence_classification(ref.to_float64(params["params"]), cfg,
                                           batch["input_ids"],
                                           batch["attention_mask"].astype(bool),
                                           batch["token_type_ids"])
    has_tokens = (np.asarray(SHORT) > 0)[:, None]
    err = max_abs_error(logits, expected, has_tokens)
    print(f"[reference] classification {cfg.position_scheme}: max abs error {err:.2e}")
    assert err <= TOL


# --- scan over layers: the same numbers from stacked parameters ----------------------------------

SCANNED = {
    "bert_abs": text_config("bert_abs", num_layers=3),
    "tupe_r": text_config("tupe_r", num_layers=3),
    "deberta v1 EMD": text_config("deberta", max_relative_positions=8, position_biased_input=False,
                                  use_emd=True, num_layers=3),
    "deberta v2 conv EMD remat": text_config(
        "deberta_v2", **V2, share_att_key=True, conv_kernel_size=3, conv_groups=2,
        use_emd=True, position_biased_input=False, num_layers=3, remat=True),
}


@pytest.mark.parametrize("name", list(SCANNED))
def test_scanned_layers_match_reference(name):
    cfg = dataclasses.replace(SCANNED[name], scan_layers=True)
    check(f"scan_layers {name}", cfg, LONG if cfg.position_scheme == "deberta_v2" else SHORT)

