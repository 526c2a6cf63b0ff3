"""Position-encoding study on images: ViT on CIFAR-10 (default) or MNIST (``:mnist``) with
learned absolute, 2D relative (BERT-R, TUPE-R, DeBERTa-v2) and no positions, patch vs hybrid
ResNet stem; resolution transfer (trained at 32 px, evaluated at 48 and 64 px with the learned
table resampled bilinear/bicubic or relative positions as they are, and after a short
fine-tune there); learned position-embedding similarity maps (STUDY.md).

    python -m posjax.study --config configs/study_vit.py --workdir studies/vit
    python -m posjax.study --config configs/study_vit.py:tiny --workdir /tmp/vit     # the test

Today's baselines join as lines of ``cells``: ``nope`` (no positions, the control),
``sincos2d`` (big_vision's fixed table) and ``rope`` (2D axial RoPE).
"""
import pathlib

import ml_collections

HERE = pathlib.Path(__file__).resolve().parent


def overrides(d: dict) -> tuple:
    """Dotted-key overrides as (key, value) pairs (ConfigDict keys cannot hold dots)."""
    return tuple(d.items())


def cells(max_grid: int):
    return [
        dict(name="vit", scheme="vit"),                                    # learned absolute
        dict(name="bert_rel", scheme="bert_rel"),                          # + 2D T5 bias
        dict(name="tupe_r", scheme="tupe_r"),
        dict(name="deberta_v2", scheme="deberta_v2",
             model=dict(max_relative_positions=max_grid)),                 # fixed span: any grid
        dict(name="nope", scheme="nope"),                                  # NoPE control
        dict(name="sincos2d", scheme="sincos2d"),                          # fixed 2D table
        dict(name="rope", scheme="rope"),                                  # 2D axial RoPE
        dict(name="vit_hybrid", scheme="vit", model=dict(resnet_layers=(1,), resnet_width=32,
                                                         patch_size=1)),   # ResNet stem /4
    ]


def claims(sizes):
    top = max(sizes)
    return [
        dict(paper="ViT", claim="any position encoding beats none (App. D.4)", a="vit",
             b="nope", metric="final.accuracy", better="higher"),
        dict(paper="ViT", claim="2D relative positions and learned 1D positions do about equally "
             "well (App. D.4)", a="bert_rel", b="vit", metric="final.accuracy", rule="same"),
        dict(paper="ViT", claim="the hybrid stem helps at small compute (Fig. 5)",
             a="vit_hybrid", b="vit", metric="final.accuracy", better="higher"),
        dict(paper="ViT", claim=f"fine-tuning at higher resolution ({top} px) helps (Sec. 3.1)",
             a="vit", b="vit", metric=f"transfer.{top}.finetuned.accuracy",
             metric_b="final.accuracy", better="higher"),
        dict(paper="ViT", claim=f"resampled learned table at {top} px without fine-tuning keeps "
             "the accuracy of 2D relative positions as they are", a="vit", b="bert_rel",
             metric=f"transfer.{top}.bicubic.accuracy", rule="same"),
    ]


def get_config(variant: str = ""):
    if variant not in ("", "mnist", "tiny"):
        raise ValueError(f"variant {variant!r} is unknown: use '' (CIFAR-10), 'mnist' or 'tiny'")
    s = ml_collections.ConfigDict()
    s.kind = "vit"
    s.baseline = "vit"
    s.seeds = 3
    s.analysis = True
    model = {"model.hidden_size": 96, "model.num_heads": 3, "model.num_layers": 4,
             "model.mlp_dim": 192, "model.dropout_rate": 0.0}
    if variant in ("mnist", "tiny"):
        s.title = "Position encodings on images (ViT, MNIST)"
        s.base = str(HERE / "vit_mnist.py")
        sizes = [56]            # 28 px -> 56 px (hybrid stem /4: grids 7 -> 14)
        s.base_overrides = overrides({**model, "model.pooling": "gap", "num_steps": 600,
                                      "batch_size": 64, "eval_every_steps": 150,
                                      "checkpoint.every_steps": 300})
        s.cells = cells(max_grid=8 if variant == "mnist" else 4)
        ft = {"optimizer.warmup_steps": 5}
        transfer_split = ""             # the cells' own test split
    else:
        s.title = "Position encodings on images (ViT, CIFAR-10)"
        s.base = str(HERE / "vit_cifar10.py")
        sizes = [48, 64]        # grids 8 -> 12, 16
        s.base_overrides = overrides({**model, "num_steps": 800, "batch_size": 64,
                                      "eval_every_steps": 200, "log_every_steps": 100,
                                      "checkpoint.every_steps": 400,
                                      "optimizer.warmup_steps": 80,
                                      "data.test_split": "test[::5]", "eval_batch_size": 250})
        s.cells = cells(max_grid=16)
        ft = {"optimizer.warmup_steps": 5}
        transfer_split = "test[::10]"   # every class: the file is ordered by class
    s.claims = claims(sizes)
    s.transfer = ml_collections.ConfigDict({
        "sizes": sizes, "methods": ["bilinear", "bicubic"], "finetune_steps": 50,
        "test_split": transfer_split, "finetune_overrides": overrides(ft)})
    # Cost: every entry's train step timed side by side in one process (posjax/study/cost.py).
    s.cost = ml_collections.ConfigDict({"rounds": 7, "steps": 5})
    if variant == "tiny":
        s.seeds = 2
        s.cost = ml_collections.ConfigDict({"rounds": 2, "steps": 1})
        s.follow_up_seeds = 1   # resolution transfer: seed 1 only
        s.cells = [c for c in s.cells if c["name"] in ("vit", "deberta_v2", "nope")]
        s.claims = [c for c in s.claims if {c["a"], c["b"]} <= {"vit", "nope"}]
        s.base_overrides = overrides({
            "model.hidden_size": 16, "model.num_heads": 2, "model.num_layers": 2,
            "model.mlp_dim": 32, "model.pooling": "gap", "num_steps": 6, "batch_size": 8,
            "eval_every_steps": 3, "log_every_steps": 3, "checkpoint.every_steps": 6,
            "optimizer.warmup_steps": 1, "data.train_split": "test[:256]",
            "data.test_split": "test[9000:9064]", "eval_batch_size": 64})
        s.transfer.finetune_steps = 2
        s.transfer.finetune_overrides = overrides({"optimizer.warmup_steps": 1,
                                                   "log_every_steps": 1,
                                                   "checkpoint.every_steps": 2})
    return s
