"""MLM pretraining of BERT-R (BERT-A + T5 relative bias).

    python train.py --config configs/mlm_bert_r.py:size=tiny --workdir runs/mlm_bert_r_tiny   # CPU, WikiText-2
    python train.py --config configs/mlm_bert_r.py --workdir /shared/mlm_bert_r             # base, seq 128
    python train.py --config configs/mlm_bert_r.py:seq=512 --workdir ...                 # base, seq 512

Recipes: configs/text_recipes.py (paper scale: 12x768, Adam 1e-4, 10k warmup, linear
decay, weight decay 0.01, clip 1; the base variants read TFDS wikipedia: set
--config.data.tokenizer and --config.data.data_dir).
"""
from configs.text_recipes import mlm_config


def get_config(variant: str = ""):
    return mlm_config("bert_r", variant)
