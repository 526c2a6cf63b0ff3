"""MLM pretraining of RoPE (queries and keys rotated by position; no absolute table).

    python train.py --config configs/mlm_rope.py:size=tiny --workdir runs/mlm_rope_tiny   # CPU, WikiText-2
    python train.py --config configs/mlm_rope.py --workdir /shared/mlm_rope             # base, seq 128
    python train.py --config configs/mlm_rope.py:seq=512 --workdir ...                 # base, seq 512

Recipes: configs/text_recipes.py (paper scale: 12x768, Adam 1e-4, 10k warmup, linear
decay, weight decay 0.01, clip 1; the base variants read TFDS wikipedia: set
--config.data.tokenizer and --config.data.data_dir).
"""
from configs.text_recipes import mlm_config


def get_config(variant: str = ""):
    return mlm_config("rope", variant)
