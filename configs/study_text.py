"""Position-encoding study on text: MLM pretraining on WikiText-2, GLUE fine-tuning from each
pretrained encoder, length extrapolation, and synthetic position tasks (STUDY.md).

    python -m posjax.study --config configs/study_text.py --workdir studies/text        # CPU scale
    python -m posjax.study --config configs/study_text.py:tiny --workdir /tmp/text      # the test

Every cell is one line of ``cells``: (name, position scheme, model overrides); adding a scheme
is one more line (rope, alibi and nope are today's baselines). Paper scale is overrides:
``base`` -> configs/mlm_bert_a.py (BERT-base on Wikipedia), ``base_overrides`` empty,
``glue.config`` -> configs/glue_base.py, more seeds.
"""
import pathlib

import ml_collections

HERE = pathlib.Path(__file__).resolve().parent
L = 64           # MLM sequence length (and position table rows) at CPU scale


def cells():
    return [
        dict(name="bert_abs", scheme="bert_abs"),                         # BERT-A
        dict(name="bert_rel", scheme="bert_rel"),                         # BERT-R
        dict(name="tupe_a", scheme="tupe_a"),
        dict(name="tupe_r", scheme="tupe_r"),
        dict(name="tupe_a_tie_cls", scheme="tupe_a", model=dict(tie_cls=True)),
        dict(name="bert_abs_d", scheme="bert_abs_d"),                     # BERT-A-d
        dict(name="deberta", scheme="deberta", model=dict(max_relative_positions=L, use_emd=True)),
        dict(name="deberta_no_c2p", scheme="deberta",
             model=dict(max_relative_positions=L, pos_att_type=("p2c",), use_emd=True)),
        dict(name="deberta_no_p2c", scheme="deberta",
             model=dict(max_relative_positions=L, pos_att_type=("c2p",), use_emd=True)),
        dict(name="deberta_v2", scheme="deberta_v2",
             model=dict(max_relative_positions=L, position_buckets=32, use_emd=True)),
        dict(name="deberta_v2_no_emd", scheme="deberta_v2",
             model=dict(max_relative_positions=L, position_buckets=32, use_emd=False)),
        dict(name="rope", scheme="rope"),                                 # today's baselines
        dict(name="alibi", scheme="alibi"),
        dict(name="nope", scheme="nope"),
    ]


def claims():
    lower, higher = "lower", "higher"
    return [
        dict(paper="TUPE", claim="TUPE-A pretrains better than BERT-A (held-out MLM loss)",
             a="tupe_a", b="bert_abs", metric="final.loss", better=lower),
        dict(paper="TUPE", claim="TUPE-R pretrains better than BERT-A (held-out MLM loss)",
             a="tupe_r", b="bert_abs", metric="final.loss", better=lower),
        dict(paper="TUPE", claim="TUPE-A reaches BERT-A's final loss in 30% of its steps",
             a="tupe_a", b="bert_abs", rule="convergence", at_most=0.3),
        dict(paper="TUPE", claim="untying beats mixing: TUPE-A better than BERT-A-d (MLM loss)",
             a="tupe_a", b="bert_abs_d", metric="final.loss", better=lower),
        dict(paper="TUPE", claim="untied [CLS] helps GLUE: TUPE-A over TUPE-A tie-[CLS]",
             a="tupe_a", b="tupe_a_tie_cls", metric="glue_mean", better=higher),
        dict(paper="TUPE", claim="TUPE-A improves GLUE over BERT-A",
             a="tupe_a", b="bert_abs", metric="glue_mean", better=higher),
        dict(paper="DeBERTa", claim="disentangled attention pretrains better than BERT-A",
             a="deberta", b="bert_abs", metric="final.loss", better=lower),
        dict(paper="DeBERTa", claim="disentangled attention pretrains better than BERT-R",
             a="deberta", b="bert_rel", metric="final.loss", better=lower),
        dict(paper="DeBERTa", claim="removing c2p hurts (MLM loss)",
             a="deberta", b="deberta_no_c2p", metric="final.loss", better=lower),
        dict(paper="DeBERTa", claim="removing p2c hurts (MLM loss)",
             a="deberta", b="deberta_no_p2c", metric="final.loss", better=lower),
        dict(paper="DeBERTa", claim="the enhanced mask decoder helps (MLM loss)",
             a="deberta_v2", b="deberta_v2_no_emd", metric="final.loss", better=lower),
        dict(paper="DeBERTa", claim="DeBERTa improves GLUE over BERT-A",
             a="deberta", b="bert_abs", metric="glue_mean", better=higher),
    ]


def overrides(d: dict) -> tuple:
    """Dotted-key overrides as (key, value) pairs (ConfigDict keys cannot hold dots)."""
    return tuple(d.items())


def get_config(variant: str = ""):
    if variant not in ("", "tiny"):
        raise ValueError(f"variant {variant!r} is unknown: use '' (CPU scale) or 'tiny'")
    s = ml_collections.ConfigDict()
    s.kind = "text"
    s.title = "Position encodings on text (MLM on WikiText-2, GLUE, synthetic tasks)"
    s.baseline = "bert_abs"
    s.seeds = 3
    s.base = str(HERE / "mlm_bert_a.py") + ":tiny"
    # CPU scale: the 4 x 128 model of mlm_*.py:tiny, 300 steps of 32 x 64 tokens (a table of
    # 64 rows), held-out loss every 50 steps.
    s.base_overrides = overrides({"num_steps": 300, "batch_size": 32, "eval_every_steps": 50,
                                  "log_every_steps": 50, "checkpoint.every_steps": 200,
                                  "optimizer.warmup_steps": 40, "data.max_seq_length": L,
                                  "model.max_position_embeddings": L,
                                  "data.test_split": "valid[95%:]"})
    s.cells = cells()
    s.claims = claims()
    s.glue = ml_collections.ConfigDict({
        "config": str(HERE / "glue_tiny.py"), "tasks": ["sst2", "mrpc", "cola"],
        "overrides": overrides({"num_steps": 60, "optimizer.warmup_steps": 6,
                                "log_every_steps": 20, "checkpoint.every_steps": 60,
                                "data.max_seq_length": L})})
    s.extrapolation = ml_collections.ConfigDict({"factors": [2, 4], "max_batches": 4})
    s.synthetic = ml_collections.ConfigDict({
        "tasks": ["shift", "reverse", "count"], "length": 32, "factors": [1, 2, 4],
        "overrides": overrides({"num_steps": 300, "batch_size": 16, "eval_every_steps": 100,
                                "log_every_steps": 50, "checkpoint.every_steps": 300,
                                "optimizer.warmup_steps": 30, "optimizer.learning_rate": 2e-3})})
    s.analysis = True
    # Cost: every entry's train step timed side by side in one process (posjax/study/cost.py).
    s.cost = ml_collections.ConfigDict({"rounds": 7, "steps": 5})
    if variant == "tiny":
        s.seeds = 2
        s.cost = ml_collections.ConfigDict({"rounds": 2, "steps": 1})
        s.follow_up_seeds = 1   # GLUE, synthetic tasks and extrapolation: seed 1 only
        s.cells = [c for c in cells() if c["name"] in ("bert_abs", "tupe_a", "deberta_v2_no_emd")]
        s.claims = [c for c in claims() if {c["a"], c["b"]} <= {"bert_abs", "tupe_a"}]
        s.base_overrides = overrides({
            "num_steps": 6, "batch_size": 8, "eval_every_steps": 3, "log_every_steps": 3,
            "checkpoint.every_steps": 6, "optimizer.warmup_steps": 1,
            "data.max_seq_length": 32, "data.test_split": "valid[95%:96%]",
            "model.hidden_size": 32, "model.num_heads": 2, "model.num_layers": 2,
            "model.mlp_dim": 64, "model.max_position_embeddings": 32})
        for c in s.cells:
            if "max_relative_positions" in c.get("model", {}):
                c["model"]["max_relative_positions"] = 32
                c["model"].pop("position_buckets", None)
        s.glue.tasks = ["mrpc"]
        s.glue.overrides = overrides({"num_steps": 4, "optimizer.warmup_steps": 1, "log_every_steps": 2,
                            "checkpoint.every_steps": 4, "batch_size": 8,
                            "eval_batch_size": 64, "data.max_seq_length": 32})
        s.extrapolation = ml_collections.ConfigDict({"factors": [2], "max_batches": 1})
        s.synthetic = ml_collections.ConfigDict({
            "tasks": ["shift"], "length": 8, "factors": [1, 2],
            "overrides": overrides({"num_steps": 4, "batch_size": 8, "eval_every_steps": 2,
                                    "log_every_steps": 2, "checkpoint.every_steps": 4,
                                    "optimizer.warmup_steps": 1, "data.num_eval": 16})})
    return s
