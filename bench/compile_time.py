"""Suite ``compile``: time to lower and compile one training step at 12 and 24 layers, and
what scan-over-layers costs per step once compiled.

The model is the DeBERTa-v3 classifier of the throughput suite at base width (768, the most
ops per layer of our schemes), batch 8 × 128, fp32 (bf16 with ``--gpu``). Only shapes are
needed: parameters and optimizer state are ``jax.eval_shape`` structures, nothing is allocated
or run. Each depth is compiled twice: the unrolled stack and ``scan_layers=True`` (one
``lax.scan`` over stacked layer params, whose body XLA compiles once).
"""
from __future__ import annotations

import dataclasses
import time

import flax.linen as nn
import jax
import optax

from bench.common import Budget, Progress, Scale, Table, median_ratio, ratio_range, timed
from bench.workloads import (LEARNING_RATE, WEIGHT_DECAY, OursTrainer, Workload, build_model,
                             make_batch, make_train_step, text_config, throughput_workloads)
from posjax import TextConfig


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
    rows = []
    # Unrolled compile time grows with depth; scanned compiles one layer body at any depth.
    progress = Progress("compile", [w for layers in depths for w in (layers, depths[0])])
    for layers in depths:
        row = [layers]
        for scan in (False, True):
            if budget.left() <= 0:
                row.append(None)
                continue
            cfg = text_config("deberta_v2", text_scale, dtype, num_layers=layers,
                              scan_layers=scan)
            row.append(compile_seconds(Workload("compile", cfg, batch=8, length=128),
                                      scale.compiler_options))
            progress.tick(f"{layers} layers, {'scanned' if scan else 'unrolled'}")
        rows.append(row)
    notes = ["Seconds for lower + compile of jit(value_and_grad + AdamW), donated state."]
    if any(v is None for row in rows for v in row):
        notes.append("— : not measured (time budget spent).")
    return [compile_table(rows, notes, text_config("deberta_v2", text_scale, dtype)),
            step_table(scale, budget)]


def step_table(scale: Scale, budget: Budget) -> Table:
    """Train-step time of the throughput suite's text models, scanned vs unrolled layers,
    stepped alternately (one warm-up step each; the order flips every round)."""
    rows = []
    text = [w for w in throughput_workloads(scale.name, scale.dtype) if w.is_text]
    text = text[:1] if scale.smoke else text
    progress = Progress("compile", [1.0] * len(text))
    for w in text:
        if budget.left() <= 0:
            break
        scanned = dataclasses.replace(w, cfg=dataclasses.replace(w.cfg, scan_layers=True))
        pair = [OursTrainer(w, compiler_options=scale.compiler_options),
                OursTrainer(scanned, compiler_options=scale.compiler_options)]
        for trainer in pair:
            trainer.step()
        times: list[list[float]] = [[], []]
        for r in range(scale.runs):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                times[i].append(timed(pair[i].step))
        rows.append([w.name, 1000 * min(times[0]), 1000 * min(times[1]),
                     median_ratio(times[1], times[0]), ratio_range(times[1], times[0]),
                     scale.runs])
        progress.tick(f"{w.name}, scanned vs unrolled steps")
    return Table("Train-step time with scan-over-layers (same process, alternating)",
                 ["model", "unrolled ms (min)", "scanned ms (min)", "scanned/unrolled",
                  "range", "rounds"], rows,
                 ["scanned/unrolled: median over rounds of the per-round ratio (< 1: scan is "
                  "faster)."])


def compile_table(rows: list, notes: list[str], cfg: TextConfig) -> Table:
    return Table("Compile time of one training step (DeBERTa-v3 layers, width "
                  f"{cfg.hidden_size}, batch 8 × 128)",
                  ["layers", "unrolled s", "scan-over-layers s"], rows, notes)
