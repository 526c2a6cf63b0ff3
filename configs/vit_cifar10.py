"""ViT-Ti-sized model (patch 4) on the CIFAR-10 npz files in ../shared/data/cifar10
(train_20k: 2,000 images per class; test: 10,000), random-resized-crop + flip augmentation.

    python train.py --config configs/vit_cifar10.py --workdir /tmp/cifar
"""
from posjax import config_defaults as defaults


def get_config(variant: str = ""):
    """Variant key: ``data_root`` (``configs/vit_cifar10.py:data_root=DIR``)."""
    given = defaults.variant_values(variant, {"data_root": ""}, "configs/vit_cifar10.py")
    config = defaults.default_config()
    if given["data_root"]:
        config.data_root = given["data_root"]
    config.data = defaults.image_data_config("cifar10")
    config.data.update(path=defaults.root_path(config, "cifar10"), train_split="train_20k",
                       test_split="test", image_size=32,
                       mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616))
    config.model = defaults.vit_model(
        position_scheme="vit", image_size=32, patch_size=4, num_channels=3,
        hidden_size=192, num_heads=3, num_layers=6, mlp_dim=768, num_classes=10, pooling="gap",
        dropout_rate=0.1)
    config.num_steps = 10000
    config.batch_size = 128
    config.label_smoothing = 0.1
    config.log_every_steps = 100
    config.eval_every_steps = 2000
    config.optimizer.update(name="adamw", learning_rate=1e-3, schedule="cosine",
                            warmup_steps=500, weight_decay=0.05, grad_clip_norm=1.0)
    config.checkpoint.every_steps = 1000
    return config
