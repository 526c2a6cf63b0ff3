"""Default: a small ViT on scikit-learn's bundled 8x8 digits (real data every install has).

    python train.py                        # this config, workdir /tmp/posjax_digits
    python train.py --config configs/vit_digits.py:size=tiny --workdir /tmp/d   # seconds

Target: >= 96% test accuracy (359 held-out digits) in under 5 minutes on 2 CPU cores.
"""
from posjax import config_defaults as defaults


def get_config(variant: str = "") -> "ml_collections.ConfigDict":
    """Variant keys: ``size`` ('' or tiny; older spelling ``:tiny``), ``data_root``."""
    given = defaults.variant_values(variant, {"size": "", "data_root": ""},
                                    "configs/vit_digits.py")
    config = defaults.default_config()
    if given["data_root"]:
        config.data_root = given["data_root"]
    config.data = defaults.image_data_config("digits")
    config.data.mixup_alpha = 0.2          # mixup is the regulariser that matters here
    config.model = defaults.vit_model(
        position_scheme="vit", image_size=8, patch_size=4, num_channels=1,
        hidden_size=64, num_heads=4, num_layers=4, mlp_dim=128, num_classes=10, pooling="token",
        dropout_rate=0.1, attention_dropout_rate=0.0, dtype="float32")
    config.num_steps = 800                 # ~71 epochs of the 1,438 training digits
    config.batch_size = 128
    config.label_smoothing = 0.1
    config.log_every_steps = 100
    config.eval_every_steps = 200
    config.optimizer.update(name="adamw", learning_rate=2e-3, schedule="cosine",
                            warmup_steps=50, weight_decay=0.05, grad_clip_norm=1.0)
    config.checkpoint.every_steps = 200
    if given["size"] == "tiny":   # for tests: seconds, not minutes
        config.model.update(hidden_size=16, num_heads=2, num_layers=1, mlp_dim=32,
                            dropout_rate=0.0)
        config.data.mixup_alpha = 0.0
        config.num_steps = 6
        config.batch_size = 16
        config.log_every_steps = 2
        config.eval_every_steps = 0
        config.optimizer.warmup_steps = 1
        config.checkpoint.every_steps = 2
    elif given["size"]:
        raise ValueError(f"variant {variant!r} is unknown: use '' (default) or 'tiny'")
    return config
