"""Training recipes for the text tasks (the configs/mlm_*.py and configs/glue_*.py files call
these), at paper scale and as tiny CPU variants.

Paper scale (BERT-base, as in TUPE's and DeBERTa's comparisons): 12 layers × 768 hidden,
12 heads, MLP 3072; MLM on sequences of 128 (or 512) tokens, batch 256, 1M steps, Adam
(β = 0.9, 0.999, ε = 1e-6) with peak lr 1e-4, 10k warmup steps then linear decay to 0,
decoupled weight decay 0.01, gradient clipping at norm 1, dropout 0.1. GLUE fine-tuning: batch
32, lr 2e-5, 3 epochs, 10% warmup, linear decay, weight decay 0.01.

Slices: every base recipe (bf16 compute, fp32 state, the default ``data=-1`` mesh) fits a
v4-32, a v5e-256 and a v5p-128 at its batch of 256, DeBERTa-v3 at 512 tokens included
(20.4 of 32 GiB per v4 chip); check another slice or override before renting it with
``python -m posjax.plan --config configs/mlm_<scheme>.py --tpu <slice>`` (docs/tpu.md).

Schemes (``scheme`` argument): every text scheme of the scheme table
(``posjax/models/schemes.py``), by its short alias where it has one: ``bert_a`` (learned
absolute positions), ``bert_r`` (+ T5 relative bias), ``tupe_a``, ``tupe_r`` (untied
positions, no token types as in TUPE's fairseq code), ``bert_a_d`` (TUPE's ablation BERT-A-d:
all four word/position terms with their own projections, [CLS] tied; TUPE's recipe
otherwise), ``deberta`` (v1 disentangled attention, no absolute input positions, EMD for MLM,
LayerNorm eps 1e-7), ``deberta_v2`` (v3's settings: log buckets of half the span, shared
position keys, LayerNorm'd relative table), ``rope``, ``alibi``, ``nope`` (BERT's recipe
without the absolute table).

Variants (``key=value`` items, ``configs/mlm_tupe_r.py:size=tiny``): MLM ``size`` (base, tiny)
and ``seq`` (128, 512; base only); GLUE ``task`` and ``scheme``; both ``data_root`` (default
``$POSJAX_DATA``, else ../shared/data), from which the tiny variants' data paths follow. The
older spellings still work: ``:tiny``, ``:seq512``, ``:sst2,deberta``.
"""
from __future__ import annotations

import math

import ml_collections

from posjax import config_defaults as defaults

SCHEMES = defaults.RECIPE_SCHEMES
# Under config.data_root (``config_defaults.data_root``): the tiny variants' data.
BERT_VOCAB = ("bert-base-uncased-vocab", "vocab.txt")
WIKITEXT2_VALID = ("wikitext-2", "valid.txt")
TINY_POSITIONS = 128        # tiny models: position tables (and DeBERTa span) of 128 tokens
TINY_GLUE_MAX_STEPS = 600   # tiny GLUE: at most 600 steps (~15 min on 2 shared CPU cores)
GLUE_TRAIN_SIZES = {"cola": 8551, "sst2": 67349, "mrpc": 3668, "qqp": 363846, "stsb": 5749,
                    "mnli": 392702, "qnli": 104743, "rte": 2490, "wnli": 635}
GLUE_TASKS = tuple(GLUE_TRAIN_SIZES)          # posjax.data.glue.TASKS (a test checks)
GLUE_SINGLE_SENTENCE = ("cola", "sst2")       # the others are sentence pairs


def text_model(scheme: str, size: str, max_length: int) -> dict:
    """Every TextConfig field of ``scheme`` at ``size`` ``base`` or ``tiny`` (position tables of
    ``max_length`` rows), so each can be overridden (``--config.model.remat=True``)."""
    row = defaults.recipe_scheme(scheme)
    if size == "base":
        # Paper scale runs on pods: one scanned layer compiles ~N times faster; bf16 compute
        # (fp32 parameters and optimizer state) as TPUs and GPUs run it at full rate.
        dims = dict(hidden_size=768, num_heads=12, num_layers=12, mlp_dim=3072, scan_layers=True,
                    dtype="bfloat16")
    elif size == "tiny":
        dims = dict(hidden_size=128, num_heads=4, num_layers=4, mlp_dim=512)
    else:
        raise ValueError(f"size {size!r} is unknown: choose base or tiny")
    model = dict(position_scheme=row.name, vocab_size=30522, **dims,
                 max_position_embeddings=max_length, type_vocab_size=2, hidden_act="gelu",
                 layer_norm_eps=1e-12, dropout_rate=0.1, attention_dropout_rate=0.1)
    # The scheme table's presets and paper recipe (TUPE's fairseq one, the official DeBERTa
    # one, BERT's without the absolute table), then the settings that scale with the length.
    model.update(row.presets + row.recipe)
    if "max_relative_positions" in row.fields:   # DeBERTa: a span of the whole length
        model.update(max_relative_positions=max_length)
    if "position_buckets" in row.fields:   # v3: 256 buckets over 512 positions
        model.update(position_buckets=max_length // 2)
    return defaults.text_model(**model)


def mlm_config(scheme: str, variant: str = "") -> ml_collections.ConfigDict:
    """MLM pretraining: ``size=base`` (default) paper scale, seq 128 (TFDS wikipedia);
    ``seq=512`` the same at 512 tokens; ``size=tiny`` a 4×128 model on WikiText-2 valid (95%
    train, 5% eval) with the BERT vocabulary, 1000 steps of 32 × 128 tokens (CPU)."""
    where = f"configs/mlm_{scheme}.py"
    given = defaults.variant_values(variant, {"size": "base", "seq": "128", "data_root": ""},
                                    where, aliases={"tiny": {"size": "tiny"},
                                                    "seq512": {"seq": "512"}})
    if given["size"] not in ("base", "tiny") or given["seq"] not in ("128", "512") or (
            given["size"] == "tiny" and given["seq"] != "128"):
        raise ValueError(f"variant {variant!r} is unknown: use one of '', 'seq512', 'tiny' "
                         "(size=base|tiny, seq=128|512 for base)")
    config = defaults.default_config()
    if given["data_root"]:
        config.data_root = given["data_root"]
    config.task = "mlm"
    data = defaults.mlm_data_config()
    if given["size"] == "tiny":
        length = 128
        data.update(source="text_files",
                    text_files={"valid": defaults.root_path(config, *WIKITEXT2_VALID)},
                    train_split="valid[:95%]", test_split="valid[95%:]",
                    tokenizer=defaults.root_path(config, *BERT_VOCAB), unk_marker="<unk>",
                    max_seq_length=length)
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
        length = int(given["seq"])
        data.update(source="tfds", tfds_name="wikipedia/20230601.en", text_key="text",
                    train_split="train[:99%]", test_split="train[99%:]",
                    tokenizer=defaults.root_path(config, *BERT_VOCAB), max_seq_length=length)
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
    config.model["use_emd"] = defaults.recipe_scheme(scheme).disentangled
    config.data = data
    return config


def glue_config(variant: str, size: str) -> ml_collections.ConfigDict:
    """GLUE fine-tuning; ``variant``: ``task=``, ``scheme=`` (default tupe_r), ``data_root=``
    (older spelling ``task`` or ``task,scheme``).

    ``size='base'``: the paper-scale model and recipe, TFDS ``glue/<task>``;
    ``size='tiny'``: the tiny MLM model, the GLUE download layout in ../shared/data/glue,
    3 epochs capped at 600 steps, sequences of 64 tokens (single sentences) or 128 (pairs).
    Set ``init_from`` to the pretrained encoder (see RESULTS.md for the commands).
    """
    given = defaults.variant_values(variant, {"task": "sst2", "scheme": "tupe_r",
                                              "data_root": ""}, f"configs/glue_{size}.py")
    task, scheme = given["task"], given["scheme"]
    if task not in GLUE_TASKS:
        raise ValueError(f"variant {variant!r}: GLUE task {task!r} is unknown; use "
                         f"'<task>[,<scheme>]' with task one of {', '.join(GLUE_TASKS)}")
    config = defaults.default_config()
    if given["data_root"]:
        config.data_root = given["data_root"]
    config.task = "glue"
    data = defaults.glue_data_config(task)
    data.tokenizer = defaults.root_path(config, *BERT_VOCAB)
    batch = 32
    if size == "tiny":   # single sentences fit 64 tokens (SST-2: 4 of 67k cut), pairs 128
        length = 64 if task in GLUE_SINGLE_SENTENCE else 128
        data.update(glue_dir=defaults.root_path(config, "glue"), max_seq_length=length)
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
