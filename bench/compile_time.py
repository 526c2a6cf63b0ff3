"""Suite ``compile``: time to lower and compile one training step at 12 and 24 layers.

The model is the DeBERTa-v3 classifier of the throughput suite at base width (768, the most
ops per layer of our schemes), batch 8 × 128, fp32 (bf16 with ``--gpu``). Only shapes are
needed: parameters and optimizer state are ``jax.eval_shape`` structures, nothing is allocated
or run. With scan-over-layers (a ``scan_layers`` config field) when the config has one.
"""
from __future__ import annotations

import dataclasses
import time

import flax.linen as nn
import jax
import optax

from bench.common import Budget, Scale, Table
from bench.workloads import (LEARNING_RATE, WEIGHT_DECAY, Workload, build_model, make_batch,
                             make_train_step, text_config)
from posjax import TextConfig

SCAN_FIELD = "scan_layers"


def scan_supported() -> bool:
    return SCAN_FIELD in {f.name for f in dataclasses.fields(TextConfig)}


def compile_seconds(w: Workload, compiler_options: dict | None = None) -> float:
    """Wall time of ``jit(train_step).lower(abstract args).compile()``."""
    model = build_model(w)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in make_batch(w).items()}
    key = jax.random.key(0)
    variables = jax.eval_shape(model.init, key, batch["input_ids"], batch["attention_mask"])
    params = nn.meta.unbox(variables["params"])
    tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    opt_state = jax.eval_shape(tx.init, params)
    step = make_train_step(model, tx, is_text=True)
    t0 = time.perf_counter()
    step.lower(params, opt_state, batch, jax.eval_shape(lambda: key)).compile(compiler_options)
    return time.perf_counter() - t0


def run(scale: Scale, budget: Budget, context: dict) -> list[Table]:
    depths = (1,) if scale.smoke else (12, 24)
    text_scale = "smoke" if scale.smoke else "gpu"          # base width
    dtype = scale.dtype
    scans = (False, True) if scan_supported() else (False,)
    rows = []
    for layers in depths:
        row = [layers]
        for scan in scans:
            if budget.left() <= 0:
                row.append(None)
                continue
            extra = {SCAN_FIELD: True} if scan else {}
            cfg = text_config("deberta_v2", text_scale, dtype, num_layers=layers, **extra)
            row.append(compile_seconds(Workload("compile", cfg, batch=8, length=128),
                                      scale.compiler_options))
        if not scan_supported():
            row.append("n/a")
        rows.append(row)
    notes = ["Seconds for lower + compile of jit(value_and_grad + AdamW), donated state."]
    if not scan_supported():
        notes.append(f"TextConfig has no `{SCAN_FIELD}` field: scan-over-layers does not exist "
                     "in posjax.models yet, so only the unrolled stack is measured.")
    return [Table("Compile time of one training step (DeBERTa-v3 layers, width "
                  f"{cfg.hidden_size}, batch 8 × 128)",
                  ["layers", "unrolled s", "scan-over-layers s"], rows, notes)]
