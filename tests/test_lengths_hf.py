"""Exact at every length: imported Hugging Face DeBERTa models reproduce transformers below, at
and above every configured limit (position_buckets, max_relative_positions, the v1 span), up to
4x max_relative_positions; and posjax's log buckets are transformers' own, distance by distance.

(A check once matched to 1e-6 at every tested length and was 2e-2 off beyond the relative span,
because every test had span >= length: these tests go past each limit on purpose.)
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import reference as ref  # noqa: E402
from posjax.convert import load_pretrained  # noqa: E402
from posjax.layers import positions  # noqa: E402
from test_convert_hf import assert_close, make_hf_text, ours_text  # noqa: E402

# (bucket_size, max_position) pairs where transformers' float32 log lands on the other side of
# an exact tie than numpy's (posjax.layers.positions.deberta_log_bucket, docstring).
FLOAT32_TIES = {(42, 10), (43, 10), (256, 130)}


def hf_buckets(r: np.ndarray, buckets: int, max_position: int) -> np.ndarray:
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position
    return make_log_bucket_position(torch.tensor(r), buckets, max_position).long().numpy()


@pytest.mark.parametrize("buckets", [2, 3, 4, 6, 7, 8, 16, 33, 64, 256])
def test_log_buckets_are_transformers_buckets(buckets):
    """Every distance within ±4·max(max_position, buckets), for max_position below, at and above
    the bucket count (all transformers accepts, max_position = 1 included)."""
    for max_position in sorted({1, 2, 5, 16, 20, buckets // 2 + 2, buckets, 2 * buckets, 512}):
        if max_position - 1 == buckets // 2 or (buckets, max_position) in FLOAT32_TIES:
            continue   # refused by TextConfig (no bucket is defined) / the documented ties
        r = np.arange(-4 * max(max_position, buckets) - 3, 4 * max(max_position, buckets) + 4)
        with np.errstate(all="ignore"):
            ours = positions.deberta_log_bucket(r, buckets, max_position)
        np.testing.assert_array_equal(ours, hf_buckets(r, buckets, max_position),
                                      err_msg=f"buckets={buckets} max_position={max_position}")


@pytest.mark.parametrize("buckets,max_position", [(8, 16), (6, 16), (16, 16), (256, 512),
                                                  (8, 32)])
def test_log_buckets_match_the_float64_reference(buckets, max_position):
    r = np.arange(-4 * max_position, 4 * max_position + 1)
    np.testing.assert_array_equal(positions.deberta_log_bucket(r, buckets, max_position),
                                  ref.deberta_log_bucket(r, buckets, max_position))


def batch(length: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded batch of 3 rows: the full length, length − 3, and 4 tokens."""
    lengths = np.array([length, max(length - 3, 1), min(4, length)])
    rng = np.random.default_rng(seed)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int64)
    return rng.integers(1, vocab, mask.shape) * mask, mask, np.zeros_like(mask)


# name: (HF config, the limit the lengths straddle)
CASES = {
    # Issue #35's cases: buckets 8 / 6 / 16 over a span of 16, at 24 tokens and beyond.
    "v2 buckets 8 span 16": (dict(model_type="deberta-v2", position_buckets=8,
                                  max_relative_positions=16, share_att_key=True,
                                  norm_rel_ebd="layer_norm"), 16),
    "v2 buckets 6 span 16 separate keys": (dict(model_type="deberta-v2", position_buckets=6,
                                                max_relative_positions=16,
                                                share_att_key=False), 16),
    "v2 buckets 16 span 16": (dict(model_type="deberta-v2", position_buckets=16,
                                   max_relative_positions=16, share_att_key=True), 16),
    "v2 odd buckets 7 span 16": (dict(model_type="deberta-v2", position_buckets=7,
                                      max_relative_positions=16, share_att_key=True), 16),
    # More buckets than max_relative_positions, which falls back to max_position_embeddings
    # (transformers runs it; posjax refused it before).
    "v2 buckets 64 > max_position_embeddings 24": (dict(
        model_type="deberta-v2", position_buckets=64, max_relative_positions=-1,
        max_position_embeddings=24, share_att_key=True), 24),
    "v2 no buckets span 6": (dict(model_type="deberta-v2", max_relative_positions=6,
                                  share_att_key=False), 6),
    "v1 span 4": (dict(model_type="deberta", max_relative_positions=4), 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_deberta_matches_transformers_beyond_every_limit(case, tmp_path):
    kw, limit = CASES[case]
    kw = dict(kw, pos_att_type="c2p|p2c", position_biased_input=False)
    arch = "DebertaV2Model" if kw["model_type"] == "deberta-v2" else "DebertaModel"
    model = make_hf_text(arch, kw, seed=len(case))
    model.save_pretrained(tmp_path / "hf")
    pre = load_pretrained(tmp_path / "hf")
    cfg = model.config
    buckets = max(getattr(cfg, "position_buckets", 0), 0)
    lengths = sorted({limit - 1, limit, limit + 1, 24, 2 * limit + 1, 4 * limit,
                      buckets + 1 if buckets else limit})
    for length in lengths:
        ids, mask, types = batch(length, cfg.vocab_size, seed=length)
        with torch.no_grad():
            theirs = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                           output_hidden_states=True).hidden_states
        ours, _ = ours_text(pre, ids, mask, types)
        for i, hs in enumerate(theirs[1:]):
            assert_close(ours[i], hs.numpy(), mask, f"{case} L={length} layer {i}")
