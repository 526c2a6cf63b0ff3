"""MLM pretraining of BERT-A-d, TUPE's ablation (Ke et al. 2021): every layer sums all four
word/position correlations, each with its own projections, over √(4d); [CLS] stays tied.

    python train.py --config configs/mlm_bert_a_d.py:size=tiny --workdir runs/mlm_bert_a_d_tiny   # CPU, WikiText-2
    python train.py --config configs/mlm_bert_a_d.py --workdir /shared/mlm_bert_a_d             # base, seq 128
    python train.py --config configs/mlm_bert_a_d.py:seq=512 --workdir ...                   # base, seq 512

Against TUPE-A with tie_cls (``configs/mlm_tupe_a.py --config.model.tie_cls=True``) it shows
what the two mixed word-position terms add (with them the shared scale is 1/√(4d), not
TUPE's 1/√(2d)). Recipes: configs/text_recipes.py.
"""
from configs.text_recipes import mlm_config


def get_config(variant: str = ""):
    return mlm_config("bert_a_d", variant)
