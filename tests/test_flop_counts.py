"""The analytic FLOP counts (MFU's numerator) against the matrix products of the traced
models, and against the published count of ViT-B/16."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from posjax.models.config import ViTConfig
from posjax.models.vit import ViT
from posjax.models import flops

from model_inputs import every_eqn


def _matmul_flops(jaxpr) -> float:
    """2·MACs of every dot_general and convolution in a jaxpr (recursing into sub-jaxprs)."""
    total = 0.0
    for eqn in every_eqn(jaxpr):
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            batch = math.prod(lhs[i] for i in lb)
            contract = math.prod(lhs[i] for i in lc)
            free_l = math.prod(s for i, s in enumerate(lhs) if i not in lc and i not in lb)
            free_r = math.prod(s for i, s in enumerate(rhs) if i not in rc and i not in rb)
            total += 2.0 * batch * contract * free_l * free_r
        elif name == "conv_general_dilated":
            out = eqn.outvars[0].aval.shape
            kernel = eqn.invars[1].aval.shape            # HWIO as Flax lays it out
            total += 2.0 * math.prod(out) * math.prod(kernel[:-1])
    return total


@pytest.mark.parametrize("overrides", [
    {},
    {"pooling": "map", "representation_size": 24},
    {"position_scheme": "tupe_r", "pooling": "gap"},
    {"position_scheme": "deberta", "pooling": "gap"},
    {"resnet_layers": (1, 1), "patch_size": 1, "image_size": 32},
    {"position_scheme": "tupe_r"},
    # A one-row grid: both axes' indices are Toeplitz, but only text takes the relative shift.
    {"position_scheme": "deberta", "pooling": "gap", "image_size": (4, 16), "gather": "skew"},
    {"position_scheme": "deberta", "pooling": "first"},
    {"position_scheme": "bert_abs_d"},
    {"position_scheme": "bert_abs_d", "pooling": "gap"},
], ids=["vit", "map_prelogits", "tupe_r", "deberta", "hybrid", "tupe_r_token",
        "deberta_one_row_grid", "deberta_first_patch", "bert_abs_d_token", "bert_abs_d_gap"])
def test_analytic_flops_equal_the_traced_matmuls(overrides):
    """A batch of 3 images: B · per_example + per_step equals the traced model's matmuls (the
    position tables of TUPE and DeBERTa are computed once per batch, not per image)."""
    cfg = ViTConfig(**{"image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_size": 32,
                       "num_heads": 4, "num_layers": 2, "mlp_dim": 64, "num_classes": 7,
                       "resnet_width": 32, **overrides})
    model = ViT(cfg)
    images = jnp.zeros((3, *cfg.image_size, 3))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), images)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, images))(params)
    forward = flops.vit_forward_flops(cfg)
    assert forward.total(3) == pytest.approx(_matmul_flops(jaxpr.jaxpr), rel=1e-9)
    assert (forward.per_step > 0) == (cfg.position_scheme != "vit")
    train = flops.vit_train_flops(cfg)
    assert train.per_step == 3 * forward.per_step
    assert train.per_example < 3 * forward.per_example     # no gradient for the pixels


def test_train_flops_equal_the_traced_gradient_matmuls():
    """Forward + backward of a ViT: every product three times, except the pixels' gradient.
    (Not the hybrid: the dx of its strided convolutions is traced as a dilated convolution
    whose count includes the inserted zeros.)"""
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_heads=4,
                    num_layers=2, mlp_dim=64, num_classes=7)
    model = ViT(cfg)
    images = jnp.zeros((3, *cfg.image_size, 3))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), images)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(model.apply(p, images))))(params)
    assert flops.vit_train_flops(cfg).total(3) == pytest.approx(_matmul_flops(jaxpr.jaxpr),
                                                                rel=1e-9)


@pytest.mark.parametrize("overrides", [
    {"position_scheme": "bert_abs"},
    {"position_scheme": "tupe_r"},
    {"position_scheme": "bert_abs_d"},
    {"position_scheme": "deberta_v2", "max_relative_positions": 16, "position_buckets": 4,
     "share_att_key": True, "conv_kernel_size": 3},
    {"position_scheme": "deberta", "max_relative_positions": 4},
    # 2T − 1 = 23 distances <= R table rows: ``shift`` multiplies only those 23 rows.
    {"position_scheme": "deberta_v2", "max_relative_positions": 32, "position_buckets": 16},
    {"position_scheme": "deberta", "max_relative_positions": 16},
    {"position_scheme": "deberta_v2", "max_relative_positions": 32, "position_buckets": 16,
     "gather": "take"},
    # 23 distances > R = 8 rows: ``skew`` still multiplies the 23 rows (``shift`` the 8).
    {"position_scheme": "deberta_v2", "max_relative_positions": 16, "position_buckets": 4,
     "gather": "skew"},
    {"position_scheme": "deberta", "max_relative_positions": 4, "gather": "skew"},
], ids=["bert_abs", "tupe_r", "bert_abs_d", "deberta_v2_conv", "deberta_v1", "deberta_v2_shift_short",
        "deberta_v1_shift_short", "deberta_v2_take_short", "deberta_v2_skew_long",
        "deberta_v1_skew_long"])
def test_classifier_flops_equal_the_traced_matmuls(overrides):
    """[CLS] classifiers (the last layer computes token 0 alone): 3 sequences of 12 tokens."""
    from posjax.models.config import TextConfig
    from posjax.models.text import TextForSequenceClassification
    cfg = TextConfig(**{"vocab_size": 32, "hidden_size": 32, "num_heads": 4, "num_layers": 2,
                        "mlp_dim": 64, "max_position_embeddings": 16, **overrides})
    model = TextForSequenceClassification(cfg, num_labels=3)
    ids = jnp.ones((3, 12), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, ids)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, ids, ids))(params)
    head = flops.Flops(per_example=2.0 * 32 * 32 + 2.0 * 32 * 3)
    forward = flops.text_encoder_forward_flops(cfg, 12, first_only=True) + head
    assert forward.total(3) == pytest.approx(_matmul_flops(jaxpr.jaxpr), rel=1e-9)
    assert forward.total(3) < (flops.text_encoder_forward_flops(cfg, 12) + head).total(3)


@pytest.mark.parametrize("gather", ["take", "shift", "skew"])
@pytest.mark.parametrize("span", [4, 64])      # R = 8 < 2T − 1 = 95 < R = 128
def test_emd_mlm_flops_equal_the_traced_matmuls(gather, span):
    """DeBERTa MLM with the enhanced mask decoder, 3 sequences of 48 tokens, 6 masked slots:
    the EMD's position products use all R rows whatever the gather (a per-example index)."""
    from posjax.models.config import TextConfig
    from posjax.models.text import TextForMaskedLM
    from posjax.training.text_tasks import mlm_head_flops
    cfg = TextConfig(position_scheme="deberta_v2", vocab_size=32, hidden_size=32, num_heads=4,
                     num_layers=2, mlp_dim=64, max_position_embeddings=64,
                     max_relative_positions=span, use_emd=True, position_biased_input=False,
                     gather=gather)
    model = TextForMaskedLM(cfg)
    ids, masked = jnp.ones((3, 48), jnp.int32), jnp.zeros((3, 6), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, ids, masked_positions=masked)
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, ids, ids, masked_positions=masked))(params)
    forward = flops.text_encoder_forward_flops(cfg, 48) + mlm_head_flops(cfg, 6, 48)
    assert forward.total(3) == pytest.approx(_matmul_flops(jaxpr.jaxpr), rel=1e-9)


def test_position_flops_per_step_and_per_example_by_hand():
    """DeBERTa v2, H=8, MLP 16, 2 layers, k=4 buckets (R=8 rows), c2p+p2c, T=6 tokens;
    TUPE-A on the same sizes (a (T+1)-row table, a T x T correlation)."""
    from posjax.models.config import TextConfig
    base = dict(vocab_size=32, hidden_size=8, num_heads=2, num_layers=2, mlp_dim=16,
                max_position_embeddings=16)
    deberta = TextConfig(**base, position_scheme="deberta_v2", max_relative_positions=8,
                         position_buckets=4)
    layer = 2 * 6 * 8 * 4 * 8 + 2 * 2 * 6 * 6 * 8 + 2 * 6 * 2 * 8 * 16       # 7296
    per_example = 2 * layer + 2 * 2 * (2 * 6 * 8 * 8)     # + layers x terms x 2·T·R·H
    per_step = 2 * 2 * (2 * 8 * 8 * 8)                    # layers x terms x 2·R·H²
    assert flops.position_flops(deberta, 6) == flops.Flops(2 * 2 * 2 * 6 * 8 * 8, per_step)
    assert flops.text_encoder_forward_flops(deberta, 6) == flops.Flops(per_example, per_step)
    assert flops.Flops(per_example, per_step).total(32) == 32 * per_example + per_step
    tupe = TextConfig(**base, position_scheme="tupe_a")
    # Projections of the 7 table rows, the 6 x 6 correlation, [CLS]'s θ1 and θ2 per head.
    assert flops.text_encoder_forward_flops(tupe, 6) == flops.Flops(
        2 * layer, 2 * 2 * 7 * 8 * 8 + 2 * 6 * 6 * 8 + 2 * 2 * 8)
    # BERT-A-d: TUPE's part, the mixed terms' position sides on T rows (per step), and per
    # layer the word sides 2·2T·H² and the two products 2·2·T·T·H (per example).
    four_terms = TextConfig(**base, position_scheme="bert_abs_d")
    mixed = 2 * 12 * 8 * 8 + 2 * 2 * 6 * 6 * 8                                   # 2688
    assert flops.text_encoder_forward_flops(four_terms, 6) == flops.Flops(
        2 * layer + 2 * mixed, 2 * 2 * 7 * 8 * 8 + 2 * 6 * 6 * 8 + 2 * 2 * 6 * 8 * 8)


def test_vit_b16_flops_match_the_published_count():
    # ViT-B/16 at 224: 17.6 GMACs forward (e.g. timm / fvcore tables), every token of every
    # layer; ours skips the last layer's 196 patch rows (the head reads [CLS] only).
    cfg = ViTConfig()
    skipped = (flops.attention_layer_flops(197, 768, 3072)
               - flops.attention_layer_flops(197, 768, 3072, queries=1))
    ours = flops.vit_forward_flops(cfg).total(1)
    assert (ours + skipped) / 2 / 1e9 == pytest.approx(17.56, abs=0.05)
    assert ours / 2 / 1e9 == pytest.approx(16.35, abs=0.01)
