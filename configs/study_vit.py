"""Position-encoding study on images: ViT on CIFAR-10 (default) or MNIST (``:mnist``) with a
learned 1D table, no positions (the floor), big_vision's fixed 2D sin-cos table, 2D axial RoPE
and one 2D relative scheme (BERT-R's T5 buckets); resolution transfer (trained at 32 px,
evaluated at 48 and 64 px with the learned table resampled bilinear/bicubic or relative
positions as they are, then fine-tuned there, against the same steps at 32 px); learned
position-embedding similarity maps (STUDY.md).

    python -m posjax.study --config configs/study_vit.py --workdir studies/vit
    python -m posjax.study --config configs/study_vit.py:tiny --workdir /tmp/vit     # the test
"""
import pathlib

import ml_collections

HERE = pathlib.Path(__file__).resolve().parent


def overrides(d: dict) -> tuple:
    """Dotted-key overrides as (key, value) pairs (ConfigDict keys cannot hold dots)."""
    return tuple(d.items())


def cells() -> list[dict]:
    return [
        dict(name="vit", scheme="vit"),                                    # learned absolute
        dict(name="nope", scheme="nope"),                                  # the floor
        dict(name="sincos2d", scheme="sincos2d"),                          # fixed 2D table
        dict(name="rope", scheme="rope"),                                  # 2D axial RoPE
        dict(name="bert_rel", scheme="bert_rel"),                          # + 2D T5 bias
    ]


def claims(sizes: list[int]) -> list[dict]:
    """``margin`` of a 'same' claim: written here before the run (accuracy, 0..1)."""
    top = max(sizes)
    return [
        dict(paper="ViT", claim="any position encoding beats none (App. D.4)", a="vit",
             b="nope", metric="final.accuracy", better="higher",
             paper_effect="every encoding a few points above none; the encodings within a "
             "fraction of a point of each other (App. D.4, Table 8)"),
        dict(paper="ViT", claim="2D relative positions and learned 1D positions do about equally "
             "well (App. D.4)", a="bert_rel", b="vit", metric="final.accuracy", rule="same",
             margin=0.015, paper_effect="within a fraction of a point (App. D.4, Table 8)"),
        dict(paper="ViT", claim=f"fine-tuning at higher resolution ({top} px) helps, against the "
             "same steps at the training resolution (Sec. 3.1)", a="vit", b="vit",
             metric=f"transfer.{top}.finetuned.accuracy",
             metric_b="transfer_control.finetuned.accuracy", better="higher",
             paper_effect="higher accuracy when fine-tuned at higher resolution (Sec. 3.1, "
             "after Touvron et al. 2019)"),
        dict(paper="ViT", claim=f"resampled learned table at {top} px without fine-tuning keeps "
             "the accuracy of 2D relative positions as they are", a="vit", b="bert_rel",
             metric=f"transfer.{top}.bicubic.accuracy", rule="same", margin=0.02,
             paper_effect="2D interpolation of the table makes higher resolution work "
             "(Sec. 3.2; no number)"),
    ]


def get_config(variant: str = ""):
    if variant not in ("", "mnist", "tiny"):
        raise ValueError(f"variant {variant!r} is unknown: use '' (CIFAR-10), 'mnist' or 'tiny'")
    s = ml_collections.ConfigDict()
    s.kind = "vit"
    s.baseline = "vit"
    s.floor = "nope"
    s.seeds = 3
    s.analysis = True
    model = {"model.hidden_size": 96, "model.num_heads": 3, "model.num_layers": 4,
             "model.mlp_dim": 192, "model.dropout_rate": 0.0}
    s.cells = cells()
    if variant in ("mnist", "tiny"):
        s.title = "Position encodings on images (ViT, MNIST)"
        s.base = str(HERE / "vit_mnist.py")
        sizes = [56]            # 28 px -> 56 px
        s.base_overrides = overrides({**model, "model.pooling": "gap", "num_steps": 3000,
                                      "batch_size": 64, "eval_every_steps": 500,
                                      "checkpoint.every_steps": 1000})
        transfer_split = ""             # the cells' own test split
    else:
        # 3,000 steps of 64 images (~10 epochs of the 20k training images): enough for the
        # learned table to form a 2D layout (the similarity maps); tested on 5,000 images.
        s.title = "Position encodings on images (ViT, CIFAR-10)"
        s.base = str(HERE / "vit_cifar10.py")
        sizes = [48, 64]        # grids 8 -> 12, 16
        s.base_overrides = overrides({**model, "num_steps": 3000, "batch_size": 64,
                                      "eval_every_steps": 500, "log_every_steps": 100,
                                      "checkpoint.every_steps": 1000,
                                      "optimizer.warmup_steps": 200,
                                      "data.test_split": "test[::2]", "eval_batch_size": 250})
        transfer_split = "test[::2]"    # every class: the file is ordered by class
    s.claims = claims(sizes)
    # Resolution transfer: each size evaluated as is (tables resampled), then fine-tuned there
    # for finetune_steps; the control fine-tunes as many steps at the training resolution.
    s.transfer = ml_collections.ConfigDict({
        "sizes": sizes, "methods": ["bilinear", "bicubic"], "finetune_steps": 100,
        "test_split": transfer_split,
        "finetune_overrides": overrides({"optimizer.warmup_steps": 10})})
    # Cost: every entry's train step timed side by side in one process (posjax/study/cost.py).
    s.cost = ml_collections.ConfigDict({"rounds": 7, "steps": 5})
    if variant == "tiny":
        s.seeds = 2
        s.cost = ml_collections.ConfigDict({"rounds": 2, "steps": 1})
        s.follow_up_seeds = 1   # resolution transfer: seed 1 only
        s.cells = [c for c in s.cells if c["name"] in ("vit", "bert_rel", "nope")]
        s.claims = [c for c in s.claims if {c["a"], c["b"]} <= {"vit", "nope", "bert_rel"}]
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
