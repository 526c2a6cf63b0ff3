"""Tiny configs of every position scheme for the TPU compile tests (test_tpu_*.py)."""
from __future__ import annotations

import ml_collections

from configs import vit_digits
from configs.text_recipes import mlm_config
from posjax import config_defaults
from posjax.models.schemes import SCHEMES

# The ViT-only schemes, and text schemes on patch grids (2D relative positions).
VIT_SCHEMES = ("vit", "sincos2d", "rope", "alibi", "deberta_v2")


def tiny_text(scheme: str, batch: int = 16) -> ml_collections.ConfigDict:
    """The tiny MLM recipe of ``scheme`` at width 32, 2 layers (DeBERTa's enhanced mask
    decoder needs 2), 64 tokens."""
    config = mlm_config(SCHEMES[scheme].alias or scheme, "size=tiny")
    config.model.update(hidden_size=32, num_heads=2, num_layers=2, mlp_dim=64,
                        vocab_size=512)
    config.data.max_seq_length = 64
    config.batch_size = config.eval_batch_size = batch
    return config


def tiny_vit(scheme: str, batch: int = 16) -> ml_collections.ConfigDict:
    config = vit_digits.get_config("size=tiny")
    config.model.position_scheme = scheme
    if scheme == "deberta_v2":
        config.model.update(pooling="gap", **{k: v for k, v in config_defaults.text_model(
            position_scheme="deberta_v2", position_buckets=4, max_relative_positions=8).items()
            if k in ("position_buckets", "max_relative_positions")})
    config.batch_size = config.eval_batch_size = batch
    return config
