"""GLUE fine-tuning of the tiny CPU models on the GLUE download layout (../shared/data/glue).

    python train.py --config configs/glue_tiny.py:task=sst2 --workdir runs/sst2_tupe_r \
        --config.init_from=runs/mlm_tupe_r_tiny      # the workdir of mlm_tupe_r.py:size=tiny
    python eval.py --workdir runs/sst2_tupe_r               # dev metrics + SST-2.validation.tsv

The variant keys are ``task`` (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli), ``scheme``
(bert_a, bert_r, tupe_a, tupe_r (default), bert_a_d, deberta) and ``data_root``; the older
spelling ``task[,scheme]`` still works. See RESULTS.md.
"""
from configs.text_recipes import glue_config


def get_config(variant: str = "sst2"):
    return glue_config(variant, "tiny")
