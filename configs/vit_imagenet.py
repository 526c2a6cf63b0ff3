"""ViT recipes of Dosovitskiy et al. (2021): pre-training and fine-tuning.

Variant string ``<model>[,<mode>]``:

* model: ``ti16``, ``s16``, ``s32``, ``b16``, ``b32``, ``l16``, ``l32``, ``h14``
  (Ti/S/B/L/H = hidden 192/384/768/1024/1280, layers 12/12/12/24/32, heads 3/6/12/16/16,
  MLP 4x hidden; the digits are the patch size).
* mode: ``imagenet`` (default; pre-train on ImageNet-1k), ``i21k`` (pre-train on ImageNet-21k),
  ``cifar`` (pre-train on CIFAR-10 upsampled to 224), or ``finetune`` (fine-tune a pre-trained
  checkpoint on ImageNet-1k at 384 px).

Pre-training (paper §4.1, Table 3 / App. B.1): Adam β1 0.9, β2 0.999, batch 4096, 10k linear
warmup (CIFAR: a tenth of its 3662 steps) then linear decay, weight decay 0.3 (ImageNet-1k,
300 epochs) or 0.03 (ImageNet-21k, 90 epochs; 0.1 for H), lr 3e-3 / 1e-3, 224 px, dropout 0.1
on ImageNet-1k, a pre-logits (representation) layer, [CLS] pooling.
Fine-tuning (App. B.1.1): SGD momentum 0.9, batch 512, cosine decay, no weight decay, global
gradient-norm clipping at 1, 384 px (518 px for /14 patches); the pre-trained 224 px position
table is resampled (bilinear) to the new grid when ``init_from`` is loaded, and the head is
re-initialised (zero) for the new classes; no pre-logits layer.

    python train.py --config configs/vit_imagenet.py:b16 --workdir /shared/runs/b16 \\
        --config.data.data_dir=/path/to/tfds
    python train.py --config configs/vit_imagenet.py:b16,finetune --workdir ... \\
        --config.init_from=/path/to/converted_b16

Slices (``python -m posjax.plan --config configs/vit_imagenet.py:b16 --tpu v4-32``; the
table in docs/tpu.md): pre-training keeps 4096 images per step with ``model.remat`` on (each
layer's activations recomputed in the backward pass): ViT-B/16 then takes 7.3 GiB per v4
chip on v4-32 (256 images per chip; 45.6 GB without remat, which no v4 or v5e chip holds)
and 2.9 GiB on v5e-64. Where the plan shows the room, ``--config.model.remat=False`` saves
the recomputation (about a third of the FLOPs).

The recipes compute as the official vit_jax code (tanh GELU, LayerNorm eps 1e-6). A checkpoint
converted from Hugging Face ViT also needs ``--config.model.hidden_act=gelu
--config.model.layer_norm_eps=1e-12`` (a run without them stops and says so).
"""
from posjax import config_defaults as defaults

SIZES = {  # hidden, layers, heads
    "ti": (192, 12, 3), "s": (384, 12, 6), "b": (768, 12, 12), "l": (1024, 24, 16),
    "h": (1280, 32, 16),
}
MODES = ("imagenet", "i21k", "cifar", "finetune")
IMAGENET_TRAIN = 1_281_167
I21K_TRAIN = 14_197_122
CIFAR_TRAIN = 50_000


def parse_variant(variant: str) -> tuple[str, int, str]:
    """'model=b16,mode=finetune' (older spelling 'b16,finetune') -> ('b', 16, 'finetune')."""
    given = defaults.variant_values(variant, {"model": "b16", "mode": "imagenet"},
                                    "configs/vit_imagenet.py")
    model, mode = given["model"], given["mode"]
    size = model.rstrip("0123456789")
    patch = model[len(size):]
    if size not in SIZES or not patch.isdigit() or mode not in MODES:
        raise ValueError(f"variant {variant!r} is unknown: use <model>[,<mode>] with model in "
                         "ti16, s16, s32, b16, b32, l16, l32, h14 and mode in "
                         f"{', '.join(MODES)}")
    return size, int(patch), mode


def get_config(variant: str = "b16"):
    size, patch, mode = parse_variant(variant)
    hidden, layers, heads = SIZES[size]
    # Fine-tuning at 384 px; /14 patches need a multiple of 14: 518 px, the paper's ViT-H/14.
    resolution = (518 if patch == 14 else 384) if mode == "finetune" else 224
    config = defaults.default_config()
    config.model = defaults.vit_model(
        position_scheme="vit", image_size=resolution, patch_size=patch,
        num_channels=3, hidden_size=hidden, num_heads=heads, num_layers=layers,
        mlp_dim=4 * hidden, num_classes=1000, pooling="token", representation_size=hidden,
        hidden_act="gelu_tanh", layer_norm_eps=1e-6, dropout_rate=0.0, dtype="bfloat16",
        remat=mode != "finetune" or size in ("l", "h"), scan_layers=True)
    config.mesh = dict(data=-1, fsdp=1, tensor=1)
    config.data = defaults.image_data_config("tfds")
    config.data.update(tfds_name="imagenet2012", train_split="train", test_split="validation",
                       image_size=resolution, worker_count=16)
    config.log_every_steps = 100
    config.checkpoint.update(every_steps=2000, keep=3)

    if mode == "finetune":
        config.model.update(representation_size=0)
        config.batch_size = 512
        config.num_steps = 20_000
        config.eval_every_steps = 2000
        config.optimizer.update(name="sgd", momentum=0.9, nesterov=False, learning_rate=0.03,
                                schedule="cosine", warmup_steps=500, weight_decay=0.0,
                                grad_clip_norm=1.0)
        config.init_from = ""   # set to the converter/pre-training export to fine-tune
        return config

    config.batch_size = 4096
    config.eval_every_steps = 10_000
    config.optimizer.update(name="adamw", b1=0.9, b2=0.999, warmup_steps=10_000,
                            schedule="linear", grad_clip_norm=1.0)
    if mode == "imagenet":
        config.model.update(dropout_rate=0.1)
        config.num_steps = 300 * IMAGENET_TRAIN // 4096
        config.optimizer.update(learning_rate=3e-3, weight_decay=0.3)
    elif mode == "i21k":
        config.data.update(name="image_folder", path="/path/to/imagenet21k", tfds_name="",
                           train_split="train", test_split="val", worker_count=16)
        config.model.update(num_classes=21843)
        config.num_steps = 90 * I21K_TRAIN // 4096
        config.optimizer.update(learning_rate=1e-3, weight_decay=0.1 if size == "h" else 0.03)
    else:   # cifar: CIFAR-10 from TFDS, upsampled to 224
        config.data.update(tfds_name="cifar10", test_split="test")
        config.model.update(num_classes=10)
        config.num_steps = 300 * CIFAR_TRAIN // 4096
        # 3662 steps in all: warm up for a tenth of them, as 10k of ImageNet's 93.8k steps.
        config.optimizer.update(learning_rate=3e-3, weight_decay=0.3,
                                warmup_steps=config.num_steps // 10)
    return config
