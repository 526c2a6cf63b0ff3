"""Position-encoding study on text: character-level MLM on tiny Shakespeare, with a
learning-rate sweep per scheme, NoPE as the floor, unigram/bigram baselines, the same masked
targets scored at L, 2L and 4L, and synthetic position tasks (STUDY.md).

    python -m posjax.study --config configs/study_text.py --workdir studies/text        # CPU scale
    python -m posjax.study --config configs/study_text.py:tiny --workdir /tmp/text      # the test
    python -m posjax.study --config configs/study_text.py:paper --workdir /mnt/disk/study  # BERT-base

Every entry is one line of ``cells``: (name, position scheme, the scheme's own model fields).
Every other setting is the base model's, the same for every entry (token types off, LayerNorm
eps 1e-5, no dropout at CPU scale). Seed 1 of every entry runs at each rate of
``sweep.learning_rates``; seeds 2..5 run at the entry's best rate by held-out loss.
"""
import pathlib

import ml_collections

from posjax import config_defaults

HERE = pathlib.Path(__file__).resolve().parent
L = 128          # MLM sequence length (and position table rows, DeBERTa's span) at CPU scale


def cells(length: int) -> list[dict]:
    span = dict(max_relative_positions=length)
    return [
        dict(name="bert_abs", scheme="bert_abs"),                         # BERT-A
        dict(name="bert_rel", scheme="bert_rel"),                         # BERT-R
        dict(name="tupe_a", scheme="tupe_a"),
        dict(name="tupe_r", scheme="tupe_r"),
        dict(name="bert_abs_d", scheme="bert_abs_d"),                     # BERT-A-d
        dict(name="deberta", scheme="deberta", model=dict(**span, use_emd=True)),
        dict(name="deberta_no_c2p", scheme="deberta",
             model=dict(**span, pos_att_type=("p2c",), use_emd=True)),
        dict(name="deberta_no_p2c", scheme="deberta",
             model=dict(**span, pos_att_type=("c2p",), use_emd=True)),
        dict(name="deberta_v2", scheme="deberta_v2",
             model=dict(**span, position_buckets=length // 2, use_emd=True)),
        dict(name="deberta_v2_no_emd", scheme="deberta_v2",
             model=dict(**span, position_buckets=length // 2, use_emd=False)),
        dict(name="rope", scheme="rope"),                                 # today's baselines
        dict(name="alibi", scheme="alibi"),
        dict(name="nope", scheme="nope"),                                 # the floor
    ]


CORE = ("bert_abs", "tupe_a", "bert_abs_d", "deberta", "rope", "nope")


def claims() -> list[dict]:
    """The papers' claims. ``paper_effect``: the paper's number where it is in our units;
    GLUE claims are undecidable at CPU scale (GLUE is off there)."""
    lower, higher, loss = "lower", "higher", "held_out.1.loss"
    return [
        dict(paper="TUPE", claim="TUPE-A pretrains better than BERT-A (held-out MLM loss)",
             a="tupe_a", b="bert_abs", metric=loss, better=lower,
             paper_effect="lower validation loss through pre-training (TUPE Fig. 3)"),
        dict(paper="TUPE", claim="TUPE-R pretrains better than BERT-A (held-out MLM loss)",
             a="tupe_r", b="bert_abs", metric=loss, better=lower,
             paper_effect="lower validation loss through pre-training (TUPE Fig. 3)"),
        dict(paper="TUPE", claim="TUPE-A reaches BERT-A's final loss in 30% of its steps",
             a="tupe_a", b="bert_abs", rule="convergence", at_most=0.3,
             paper_effect="0.30 of BERT-A's pre-training steps (TUPE abstract)"),
        dict(paper="TUPE", claim="untying beats mixing: TUPE-A better than BERT-A-d (MLM loss)",
             a="tupe_a", b="bert_abs_d", metric=loss, better=lower,
             paper_effect="BERT-A-d between BERT-A and TUPE-A (TUPE Sec. 4, ablation)"),
        dict(paper="TUPE", claim="TUPE-A improves GLUE over BERT-A",
             a="tupe_a", b="bert_abs", metric="glue_mean", better=higher,
             paper_effect="higher GLUE average (TUPE Table 1)"),
        dict(paper="DeBERTa", claim="disentangled attention pretrains better than BERT-A",
             a="deberta", b="bert_abs", metric=loss, better=lower,
             paper_effect="better than BERT/RoBERTa at equal data (DeBERTa Tables 1-2)"),
        dict(paper="DeBERTa", claim="disentangled attention pretrains better than BERT-R",
             a="deberta", b="bert_rel", metric=loss, better=lower,
             paper_effect="c2p + p2c beat relative position bias alone (DeBERTa Sec. 3)"),
        dict(paper="DeBERTa", claim="removing c2p hurts (MLM loss)",
             a="deberta", b="deberta_no_c2p", metric=loss, better=lower,
             paper_effect="-C2P lowers every task of the ablation (DeBERTa Table 5)"),
        dict(paper="DeBERTa", claim="removing p2c hurts (MLM loss)",
             a="deberta", b="deberta_no_p2c", metric=loss, better=lower,
             paper_effect="-P2C lowers every task of the ablation (DeBERTa Table 5)"),
        dict(paper="DeBERTa", claim="the enhanced mask decoder helps (MLM loss)",
             a="deberta_v2", b="deberta_v2_no_emd", metric=loss, better=lower,
             paper_effect="-EMD lowers every task of the ablation (DeBERTa Table 5)"),
        dict(paper="DeBERTa", claim="DeBERTa improves GLUE over BERT-A",
             a="deberta", b="bert_abs", metric="glue_mean", better=higher,
             paper_effect="higher GLUE average (DeBERTa Table 1)"),
    ]


def overrides(d: dict) -> tuple:
    """Dotted-key overrides as (key, value) pairs (ConfigDict keys cannot hold dots)."""
    return tuple(d.items())


def get_config(variant: str = ""):
    if variant not in ("", "core", "tiny", "paper"):
        raise ValueError(f"variant {variant!r} is unknown: use '' (CPU scale), 'core' (6 "
                         "entries), 'tiny' or 'paper'")
    s = ml_collections.ConfigDict()
    s.kind = "text"
    s.title = "Position encodings on text (character-level MLM on tiny Shakespeare)"
    s.baseline = "bert_abs"
    s.floor = "nope"
    s.seeds = 5
    s.base = str(HERE / "mlm_bert_a.py") + ":tiny"
    shakespeare = str(pathlib.Path(config_defaults.data_root()) / "tinyshakespeare" / "input.txt")
    # Held out: every 20th speech (whole documents spread over the plays); trained on the rest.
    # CPU scale: 2 layers x 128 (4 heads, MLP 512), 1,600 steps of 32 x 128 bytes: the pilot's
    # BERT-A leaves its plateau near step 800 and ends ~0.3 nats below the bigram (STUDY.md:
    # pilot and grid size).
    s.base_overrides = overrides({
        "num_steps": 1600, "batch_size": 32, "eval_every_steps": 100, "log_every_steps": 100,
        "checkpoint.every_steps": 800, "optimizer.warmup_steps": 100, "model.num_layers": 2,
        "data.text_files": {"play": shakespeare}, "data.train_split": "~play[::20]",
        "data.test_split": "play[::20]", "data.tokenizer": "bytes", "data.unk_marker": "",
        "data.whole_word": False, "data.max_seq_length": L,
        "model.vocab_size": 261, "model.max_position_embeddings": L,
        "model.type_vocab_size": 0, "model.layer_norm_eps": 1e-5,
        "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0})
    s.cells = cells(L)
    s.claims = claims()
    s.sweep = ml_collections.ConfigDict({"learning_rates": [1e-3, 3e-3, 3e-4],   # middle first
                                         "metric": "held_out.1.loss", "better": "lower"})
    # The same targets and masks for every run, scored inside windows of L, 2L, 4L.
    s.held_out = ml_collections.ConfigDict({"factors": [1, 2, 4], "draws": 4})
    s.baselines = True                  # unigram and bigram of the held-out targets
    s.follow_up_seeds = 2               # synthetic tasks on seed 2 (seed 1 is a sweep cell)
    s.glue = ml_collections.ConfigDict({
        "config": str(HERE / "glue_tiny.py"), "tasks": [],   # off at CPU scale (":paper")
        "overrides": overrides({"data.max_seq_length": L})})
    s.synthetic = ml_collections.ConfigDict({
        "tasks": ["shift", "reverse", "count"], "length": 32, "factors": [1, 2, 4],
        "overrides": overrides({"num_steps": 1000, "batch_size": 16, "eval_every_steps": 100,
                                "log_every_steps": 100, "checkpoint.every_steps": 1000,
                                "optimizer.warmup_steps": 100,
                                "optimizer.learning_rate": 1e-3})})
    s.analysis = True
    # Cost: every entry's train step timed side by side in one process (posjax/study/cost.py).
    s.cost = ml_collections.ConfigDict({"rounds": 7, "steps": 5})
    if variant == "core":
        # The entries that decide TUPE's and DeBERTa's central claims, RoPE and the floor, in
        # ~4 h of 2 cores; the default grid in the same workdir then adds the other entries.
        s.cells = [c for c in s.cells if c["name"] in CORE]
        s.claims = [c for c in s.claims if {c["a"], c["b"]} <= set(CORE)]
    if variant == "paper":
        # BERT-base on Wikipedia (configs/mlm_bert_a.py), GLUE from each encoder, TUPE's
        # untied-[CLS] ablation; the sweep around the recipe's 1e-4.
        s.title = "Position encodings on text (BERT-base MLM on Wikipedia, GLUE)"
        s.base = str(HERE / "mlm_bert_a.py")
        s.base_overrides = overrides({"model.type_vocab_size": 0, "model.layer_norm_eps": 1e-5})
        s.cells = cells(512) + [dict(name="tupe_a_tie_cls", scheme="tupe_a",
                                     model=dict(tie_cls=True))]
        s.claims = claims() + [dict(
            paper="TUPE", claim="untied [CLS] helps GLUE: TUPE-A over TUPE-A tie-[CLS]",
            a="tupe_a", b="tupe_a_tie_cls", metric="glue_mean", better="higher",
            paper_effect="higher GLUE average with [CLS] untied (TUPE Table 2)")]
        s.sweep.learning_rates = [5e-5, 1e-4, 2e-4]
        s.held_out = ml_collections.ConfigDict({"factors": [1, 2], "draws": 1})
        s.follow_up_seeds = 5
        s.glue = ml_collections.ConfigDict({"config": str(HERE / "glue_base.py"),
                                            "tasks": ["sst2", "mrpc", "cola"],
                                            "overrides": overrides({})})
    if variant == "tiny":
        s.seeds = 2
        s.sweep.learning_rates = [1e-3, 3e-3]
        s.held_out = ml_collections.ConfigDict({"factors": [1, 2], "draws": 2})
        s.cost = ml_collections.ConfigDict({"rounds": 2, "steps": 1})
        s.cells = [c for c in cells(32) if c["name"] in ("bert_abs", "tupe_a", "nope")]
        s.claims = [c for c in claims() if {c["a"], c["b"]} <= {"bert_abs", "tupe_a"}]
        s.base_overrides = overrides({
            **dict(s.base_overrides), "num_steps": 6, "batch_size": 8, "eval_every_steps": 3,
            "log_every_steps": 3, "checkpoint.every_steps": 6, "optimizer.warmup_steps": 1,
            "data.max_seq_length": 32, "data.test_split": "play[::400]",
            "model.hidden_size": 32, "model.num_heads": 2, "model.num_layers": 2,
            "model.mlp_dim": 64, "model.max_position_embeddings": 32})
        s.synthetic = ml_collections.ConfigDict({
            "tasks": ["shift"], "length": 8, "factors": [1, 2],
            "overrides": overrides({"num_steps": 4, "batch_size": 8, "eval_every_steps": 2,
                                    "log_every_steps": 2, "checkpoint.every_steps": 4,
                                    "optimizer.warmup_steps": 1, "data.num_eval": 16})})
    return s
