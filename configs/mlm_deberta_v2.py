"""MLM pretraining of DeBERTa v2/v3 (disentangled attention, log buckets, shared position keys, EMD).

    python train.py --config configs/mlm_deberta_v2.py:size=tiny --workdir runs/mlm_deberta_v2_tiny   # CPU, WikiText-2
    python train.py --config configs/mlm_deberta_v2.py --workdir /shared/mlm_deberta_v2             # base, seq 128
    python train.py --config configs/mlm_deberta_v2.py:seq=512 --workdir ...                 # base, seq 512

Recipes: configs/text_recipes.py (paper scale: 12x768, Adam 1e-4, 10k warmup, linear
decay, weight decay 0.01, clip 1; the base variants read TFDS wikipedia: set
--config.data.tokenizer and --config.data.data_dir).
"""
from configs.text_recipes import mlm_config


def get_config(variant: str = ""):
    return mlm_config("deberta_v2", variant)
