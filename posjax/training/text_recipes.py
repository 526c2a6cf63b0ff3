"""Training recipes for the text tasks (the configs/mlm_*.py and configs/glue_*.py files call
these), at paper scale and as tiny CPU variants.

Paper scale (BERT-base, as in TUPE's and DeBERTa's comparisons): 12 layers × 768 hidden,
12 heads, MLP 3072; MLM on sequences of 128 (or 512) tokens, batch 256, 1M steps, Adam
(β = 0.9, 0.999, ε = 1e-6) with peak lr 1e-4, 10k warmup steps then linear decay to 0,
decoupled weight decay 0.01, gradient clipping at norm 1, dropout 0.1. GLUE fine-tuning: batch
32, lr 2e-5, 3 epochs, 10% warmup, linear decay, weight decay 0.01.

Schemes (``scheme`` argument): ``bert_a`` (learned absolute positions), ``bert_r`` (+ T5
relative bias), ``tupe_a``, ``tupe_r`` (untied positions, no token types as in TUPE's
fairseq code), ``bert_a_d`` (TUPE's ablation BERT-A-d: all four word/position terms with their
own projections, [CLS] tied; TUPE's recipe otherwise), ``deberta`` (v1 disentangled attention,
no absolute input positions, EMD for MLM, LayerNorm eps 1e-7).
"""
from __future__ import annotations

import math
import pathlib

import ml_collections

from posjax.data.glue import TASKS as GLUE_TASKS
from posjax.data.glue import default_glue_data_config
from posjax.data.text import default_mlm_data_config
from posjax.models.config import TextConfig
from posjax.config_defaults import default_config, model_defaults

SCHEMES = {"bert_a": "bert_abs", "bert_r": "bert_rel", "tupe_a": "tupe_a", "tupe_r": "tupe_r",
           "bert_a_d": "bert_abs_d", "deberta": "deberta"}
# Real data next to the project (../shared/data); the tiny variants default to it.
SHARED_DATA = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data"
BERT_VOCAB = SHARED_DATA / "bert-base-uncased-vocab" / "vocab.txt"
WIKITEXT2_VALID = SHARED_DATA / "wikitext-2" / "valid.txt"
TINY_POSITIONS = 128        # tiny models: position tables (and DeBERTa span) of 128 tokens
TINY_GLUE_MAX_STEPS = 600   # tiny GLUE: at most 600 steps (~15 min on 2 shared CPU cores)
GLUE_TRAIN_SIZES = {"cola": 8551, "sst2": 67349, "mrpc": 3668, "qqp": 363846, "stsb": 5749,
                    "mnli": 392702, "qnli": 104743, "rte": 2490, "wnli": 635}


def text_model(scheme: str, size: str, max_length: int) -> dict:
    """Every TextConfig field of ``scheme`` at ``size`` ``base`` or ``tiny`` (position tables of
    ``max_length`` rows), so each can be overridden (``--config.model.remat=True``)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is unknown: choose one of {', '.join(SCHEMES)}")
    if size == "base":
        # Paper scale runs on pods: one scanned layer compiles ~N times faster.
        dims = dict(hidden_size=768, num_heads=12, num_layers=12, mlp_dim=3072, scan_layers=True)
    elif size == "tiny":
        dims = dict(hidden_size=128, num_heads=4, num_layers=4, mlp_dim=512)
    else:
        raise ValueError(f"size {size!r} is unknown: choose base or tiny")
    model = dict(position_scheme=SCHEMES[scheme], vocab_size=30522, **dims,
                 max_position_embeddings=max_length, type_vocab_size=2, hidden_act="gelu",
                 layer_norm_eps=1e-12, dropout_rate=0.1, attention_dropout_rate=0.1)
    if scheme.startswith("tupe") or scheme == "bert_a_d":
        model.update(type_vocab_size=0, layer_norm_eps=1e-5)
    if scheme == "deberta":
        model.update(type_vocab_size=0, layer_norm_eps=1e-7, position_biased_input=False,
                     max_relative_positions=max_length, pos_att_type=("c2p", "p2c"))
    return model_defaults(TextConfig, **model)


def _parse(variant: str, allowed: tuple[str, ...]) -> str:
    if variant not in allowed:
        raise ValueError(f"variant {variant!r} is unknown: use one of "
                         f"{', '.join(repr(a) for a in allowed)}")
    return variant


def mlm_config(scheme: str, variant: str = "") -> ml_collections.ConfigDict:
    """MLM pretraining: ``''`` paper scale, seq 128 (TFDS wikipedia); ``'seq512'`` the same at
    512 tokens; ``'tiny'`` a 4×128 model on WikiText-2 valid (95% train, 5% eval) with the BERT
    vocabulary, 1000 steps of 32 × 128 tokens (CPU)."""
    _parse(variant, ("", "seq512", "tiny"))
    config = default_config()
    config.task = "mlm"
    data = default_mlm_data_config()
    if variant == "tiny":
        length = 128
        data.update(source="text_files", text_files={"valid": str(WIKITEXT2_VALID)},
                    train_split="valid[:95%]", test_split="valid[95%:]",
                    tokenizer=str(BERT_VOCAB), unk_marker="<unk>", max_seq_length=length)
        config.model = text_model(scheme, "tiny", TINY_POSITIONS)
        config.num_steps = 1000
        config.batch_size = 32
        config.log_every_steps = 50
        config.eval_every_steps = 250
        config.optimizer.update(name="adamw", learning_rate=1e-3, schedule="linear",
                                warmup_steps=100, b1=0.9, b2=0.999, eps=1e-6,
                                weight_decay=0.01, grad_clip_norm=1.0)
        config.checkpoint.every_steps = 250
    else:
        length = 512 if variant == "seq512" else 128
        data.update(source="tfds", tfds_name="wikipedia/20230601.en", text_key="text",
                    train_split="train[:99%]", test_split="train[99%:]",
                    tokenizer=str(BERT_VOCAB), max_seq_length=length)
        config.model = text_model(scheme, "base", 512)
        config.num_steps = 1_000_000
        config.batch_size = 256
        config.eval_batch_size = 256
        config.log_every_steps = 1000
        config.eval_every_steps = 50_000
        config.optimizer.update(name="adamw", learning_rate=1e-4, schedule="linear",
                                warmup_steps=10_000, b1=0.9, b2=0.999, eps=1e-6,
                                weight_decay=0.01, grad_clip_norm=1.0)
        config.checkpoint.every_steps = 10_000
    config.model["use_emd"] = scheme == "deberta"
    config.data = data
    return config


def glue_config(variant: str, size: str) -> ml_collections.ConfigDict:
    """GLUE fine-tuning; ``variant`` = ``task`` or ``task,scheme`` (default scheme tupe_r).

    ``size='base'``: the paper-scale model and recipe, TFDS ``glue/<task>``;
    ``size='tiny'``: the tiny MLM model, the GLUE download layout in ../shared/data/glue,
    3 epochs capped at 600 steps, sequences of 64 tokens (single sentences) or 128 (pairs).
    Set ``init_from`` to the pretrained encoder (see RESULTS.md for the commands).
    """
    task, _, scheme = variant.partition(",")
    scheme = scheme or "tupe_r"
    if task not in GLUE_TASKS:
        raise ValueError(f"variant {variant!r}: GLUE task {task!r} is unknown; use "
                         f"'<task>[,<scheme>]' with task one of {', '.join(GLUE_TASKS)}")
    config = default_config()
    config.task = "glue"
    data = default_glue_data_config(task)
    data.tokenizer = str(BERT_VOCAB)
    batch = 32
    if size == "tiny":   # single sentences fit 64 tokens (SST-2: 4 of 67k cut), pairs 128
        length = 64 if len(GLUE_TASKS[task].tsv_text) == 1 else 128
        data.update(glue_dir=str(SHARED_DATA / "glue"), max_seq_length=length)
        config.model = text_model(scheme, "tiny", TINY_POSITIONS)
        epochs, lr, max_steps = 3, 5e-4, TINY_GLUE_MAX_STEPS
    else:
        data.max_seq_length = 128
        config.model = text_model(scheme, "base", 512)
        epochs, lr, max_steps = 3, 2e-5, None
    steps = math.ceil(epochs * GLUE_TRAIN_SIZES[task] / batch)
    steps = min(steps, max_steps or steps)
    config.num_steps = steps
    config.batch_size = batch
    config.eval_batch_size = 64
    config.log_every_steps = max(min(100, steps // 20), 1)
    config.eval_every_steps = 0
    config.optimizer.update(name="adamw", learning_rate=lr, schedule="linear",
                            warmup_steps=max(steps // 10, 1), b1=0.9, b2=0.999, eps=1e-6,
                            weight_decay=0.01, grad_clip_norm=1.0)
    config.checkpoint.every_steps = max(steps // 3, 1)
    config.data = data
    return config
