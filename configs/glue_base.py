"""GLUE fine-tuning at paper scale (12x768; batch 32, lr 2e-5, 3 epochs, 10% warmup, linear
decay), reading TFDS glue/<task> (or --config.data.glue_dir=<GLUE download folder>).

    python train.py --config configs/glue_base.py:task=mnli,scheme=deberta --workdir runs/mnli \
        --config.init_from=<converted or exported encoder> --config.data.tokenizer=<vocab>

The variant keys are ``task`` and ``scheme`` (schemes bert_a, bert_r, tupe_a, tupe_r (default),
bert_a_d, deberta); the older spelling ``task[,scheme]`` still works.
"""
from configs.text_recipes import glue_config


def get_config(variant: str = "sst2"):
    return glue_config(variant, "base")
