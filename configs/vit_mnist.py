"""Small ViT on the MNIST files in ../shared/data/mnist (IDX .gz; only the 10k t10k split is
there, so it is split 8,000 train / 2,000 test). The last 5,000 digits of t10k come from
NIST's harder writers, so this test split holds only those: its accuracy reads lower than a
figure on all of t10k. Point --config.data.path at your own copy (with train-* files set
data.train_split=train, data.test_split=test).

    python train.py --config configs/vit_mnist.py --workdir /tmp/mnist
"""
from posjax import config_defaults as defaults


def get_config(variant: str = ""):
    """Variant key: ``data_root`` (``configs/vit_mnist.py:data_root=DIR``)."""
    given = defaults.variant_values(variant, {"data_root": ""}, "configs/vit_mnist.py")
    config = defaults.default_config()
    if given["data_root"]:
        config.data_root = given["data_root"]
    config.data = defaults.image_data_config("mnist")
    config.data.update(path=defaults.root_path(config, "mnist"), train_split="test[:8000]",
                       test_split="test[8000:]", image_size=28)
    config.model = defaults.vit_model(
        position_scheme="vit", image_size=28, patch_size=7, num_channels=1,
        hidden_size=64, num_heads=4, num_layers=4, mlp_dim=128, num_classes=10, pooling="token",
        dropout_rate=0.1)
    config.num_steps = 3000
    config.batch_size = 128
    config.label_smoothing = 0.1
    config.log_every_steps = 100
    config.eval_every_steps = 1000
    config.optimizer.update(name="adamw", learning_rate=1e-3, schedule="cosine",
                            warmup_steps=200, weight_decay=0.05, grad_clip_norm=1.0)
    config.checkpoint.every_steps = 1000
    return config
