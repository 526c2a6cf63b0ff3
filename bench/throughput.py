"""Suite ``throughput``: training-step time of ours vs Hugging Face, MFU, and scheme overheads.

Models of one group (the text models; then ViT; then the text study's small MLM models) are
built together and stepped round-robin:
each round runs one step of every model in both frameworks back to back, so a ratio taken
within a round compares runs that saw the same machine load. Ratios are medians over rounds;
compilation and the first (warm-up) step of every model are excluded. Steps shorter than
~0.5 s (the small models) are timed several in a row, the same count in both frameworks.
"""
from __future__ import annotations

import gc
import traceback
from typing import Any

from bench.common import (Budget, Progress, Scale, Table, measure_peak_flops, median,
                          median_ratio, one_line_error, ratio_range, repeats_for, say, timed,
                          timed_steps)
from bench.workloads import HFTrainer, OursTrainer, Workload, all_workloads, train_flops

SPEEDUP_TITLE = "Train-step throughput: ours vs Hugging Face"
TARGET_SPEEDUP = 1.3       # ours must train >= 1.3x faster than HF (CPU, fp32)
TARGET_TUPE = 1.05         # TUPE-R step time <= 1.05x BERT-A


def run(scale: Scale, budget: Budget, context: dict) -> list[Table]:
    """Tables: speed vs HF, MFU, overheads; stores ours examples/s in ``context``."""
    peak = measure_peak_flops(512 if scale.smoke else (8192 if scale.gpu else 2048), scale.dtype)
    workloads = all_workloads(scale.name, scale.dtype)
    groups = [[w for w in workloads if w.is_text and not w.is_mlm],
              [w for w in workloads if not w.is_text], [w for w in workloads if w.is_mlm]]
    if scale.gpu:   # the study's models are CPU-sized
        workloads = [w for w in workloads if not w.is_mlm]
        groups = groups[:2]
    if scale.models:
        unknown = [m for m in scale.models if not any(w.name.startswith(m) for w in workloads)]
        if unknown:
            raise ValueError(f"--models: no model starts with {unknown}; the models are "
                             f"{[w.name for w in workloads]}")
        workloads = [w for w in workloads if any(w.name.startswith(m) for m in scale.models)]
        groups = [[w for w in g if w in workloads] for g in groups]
        groups = [g for g in groups if g]
    results: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    failures: list[str] = []
    for i, group in enumerate(groups):
        if budget.left() <= 0:
            skipped += [w.name for w in group]
            continue
        # An equal share of what is left per remaining group, so ViT is not starved by text.
        group_budget = Budget(budget.left() / (len(groups) - i)) if scale.budget_s else Budget(0)
        try:
            results.update(_measure_group(group, scale, group_budget))
        except Exception as e:   # e.g. out of memory: keep the other group's results
            traceback.print_exc()
            failures.append(f"{', '.join(w.name for w in group)}: {one_line_error(e)}")
        gc.collect()
        _free_torch_cache()
    context["train_examples_per_s"] = {
        name: next(w.batch for w in workloads if w.name == name) / median(r["ours"])
        for name, r in results.items()}
    tables = [_speed_table(workloads, results, skipped, failures),
              _mfu_table(workloads, results, peak, scale.dtype),
              _overhead_table(workloads, results)]
    if scale.xla_options:
        tables.insert(1, _options_table(workloads, results, scale.xla_options))
    return tables


def _measure_group(group: list[Workload], scale: Scale, budget: Budget
                   ) -> dict[str, dict[str, Any]]:
    """Build every model of ``group`` in both frameworks, warm up, then ``scale.runs`` rounds."""
    names = ", ".join(w.name for w in group)
    say("throughput", f"{names}: building, compiling and a warm-up step, ours and HF")
    ours = {w.name: OursTrainer(w, compiler_options=scale.compiler_options) for w in group}
    flagged = {w.name: OursTrainer(w, compiler_options=_with_options(scale)) for w in group
               } if scale.xla_options else {}
    hf: dict[tuple, HFTrainer] = {}
    for w in group:    # TUPE-R shares BERT-A's HF model (same HF config)
        key = _hf_key(w)
        if key not in hf:
            hf[key] = HFTrainer(w)
    order: list[tuple[str, Any]] = []
    for w in group:
        order.append((f"ours:{w.name}", ours[w.name]))
        if w.name in flagged:
            order.append((f"ours+options:{w.name}", flagged[w.name]))
        hf_trainer = hf[_hf_key(w)]
        if all(t is not hf_trainer for _, t in order):
            order.append((f"hf:{w.name}", hf_trainer))
    warm = {name: timed(trainer.step) for name, trainer in order}   # first-call allocations
    counts = {name: repeats_for(min(t for n, t in warm.items() if n.split(":", 1)[1] == model))
              for name in warm for model in [name.split(":", 1)[1]]}
    times: dict[str, list[float]] = {name: [] for name, _ in order}
    progress = Progress("throughput", [1.0] * scale.runs)
    for r in range(scale.runs):
        if r >= 2 and budget.left() <= 0:
            break
        for name, trainer in order:
            times[name].append(timed_steps(trainer.step, counts[name]))
        progress.tick(f"{names}: round {r + 1}")
    out = {}
    for w in group:
        o, h = ours[w.name], hf[_hf_key(w)]
        hf_name = next(n for n, t in order if t is h)
        out[w.name] = {"ours": times[f"ours:{w.name}"], "hf": times[hf_name],
                       "compile_s": o.compile_s, "xla_flops": o.xla_flops,
                       "params": o.num_params, "hf_params": h.num_params,
                       "hf_attn": h.attn_implementation, "hf_optimizer": h.optimizer_kind,
                       "hf_device": h.device.type,
                       "same_hf_as": hf_name.split(":", 1)[1],
                       "steps_per_timing": counts[f"ours:{w.name}"]}
        if w.name in flagged:
            out[w.name]["ours_options"] = times[f"ours+options:{w.name}"]
    return out


def _free_torch_cache() -> None:
    """Hand torch's cached GPU memory back, so that the next group (and JAX) can use it."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _with_options(scale: Scale) -> dict[str, Any]:
    """The compile options of the flagged trainers: the scale's own plus --xla-option."""
    return {**(scale.compiler_options or {}), **(scale.xla_options or {})}


def _hf_key(w: Workload) -> tuple:
    c = w.cfg
    return (w.hf, w.task, c.hidden_size, c.num_layers, getattr(c, "vocab_size", 0), w.batch,
            w.tokens)


def _speed_table(workloads: list[Workload], res: dict[str, dict[str, Any]],
                 skipped: list[str], failures: list[str]) -> Table:
    rows = []
    for w in workloads:
        if w.name not in res:
            continue
        r = res[w.name]
        t_ours, t_hf = median(r["ours"]), median(r["hf"])
        speedup = median_ratio(r["hf"], r["ours"])
        hf_name = "HF " + ({"bert": "BertForSequenceClassification",
                            "deberta_v2": "DebertaV2ForSequenceClassification",
                            "vit": "ViTForImageClassification"}[w.hf])
        if w.is_mlm:
            hf_name = "HF " + {"bert": "BertForMaskedLM", "deberta_v2": "DebertaV2ForMaskedLM"}[
                w.hf]
        rows.append([w.name, hf_name + ("" if r["same_hf_as"] == w.name else " †"),
                     f"{w.batch} × {w.tokens}",
                     f"{r['params'] / 1e6:.1f}M / {r['hf_params'] / 1e6:.1f}M",
                     1e3 * t_ours, 1e3 * t_hf, w.batch / t_ours, w.batch / t_hf, speedup,
                     ratio_range(r["hf"], r["ours"]), len(r["ours"]),
                     "yes" if speedup >= TARGET_SPEEDUP else "no"])
    notes = ["speed-up = median over rounds of t_HF / t_ours (> 1: ours is faster), range = "
             f"its min–max over the rounds; target ≥ {TARGET_SPEEDUP}.",
             "Step = forward + backward + AdamW update, classification cross-entropy, "
             "dropout as configured (text 0.1, ViT 0), compile and warm-up excluded.",
             "† " + "HF has no TUPE; its row reuses the HF BERT-A timings (absolute positions, "
             "equal size): the closest architecture, doing strictly less work than TUPE-R."]
    if any(w.is_mlm for w in workloads if w.name in res):
        notes.append("study models: masked-LM steps of the text study (configs/study_text.py), "
                     "cross-entropy on the masked slots; both frameworks run the encoder on "
                     "every token and the tied 30,522-word output layer on the slots alone "
                     "(HF: the base model's hidden states gathered at the slots, then its own "
                     "MLM head); several steps per timing (ours/HF the same count): "
                     + ", ".join(f"{w.name} {res[w.name].get('steps_per_timing', 1)}"
                                 for w in workloads if w.is_mlm and w.name in res) + ".")
    notes.append("Ours computes the last layer for [CLS] alone (Encoder(first_only=True): the "
                 "classifier reads only that row; exact), HF every row. Analytic matmul FLOPs "
                 "per step, ours / HF: " + ", ".join(
                     f"{w.name} {train_flops(w) / train_flops(w, every_row=True):.2f}"
                     for w in workloads if w.name in res and not w.is_mlm) + ".")
    notes.append("HF attention implementation: "
                 + ", ".join(f"{name}: {r['hf_attn']}" for name, r in res.items())
                 + "; torch AdamW: "
                 + ", ".join(sorted({r["hf_optimizer"] for r in res.values()}))
                 + "; HF device: " + ", ".join(sorted({r["hf_device"] for r in res.values()}))
                 + ".")
    if skipped:
        notes.append(f"Not measured (time budget spent): {', '.join(skipped)}.")
    notes += [f"Failed: {f}" for f in failures]
    return Table(SPEEDUP_TITLE,
                 ["model", "HF counterpart", "batch × tokens", "params ours / HF",
                  "ours ms/step", "HF ms/step", "ours ex/s", "HF ex/s", "speed-up", "range",
                  "rounds", "≥ 1.3×"], rows, notes)


def _options_table(workloads: list[Workload], res: dict[str, dict[str, Any]],
                   options: dict[str, Any]) -> Table:
    """Our step with the --xla-option compile options, timed in the same rounds."""
    rows = []
    for w in workloads:
        r = res.get(w.name)
        if r is None or "ours_options" not in r:
            continue
        speedup = median_ratio(r["hf"], r["ours_options"])
        rows.append([w.name, 1e3 * median(r["ours"]), 1e3 * median(r["ours_options"]),
                     median_ratio(r["ours"], r["ours_options"]), 1e3 * median(r["hf"]), speedup,
                     ratio_range(r["hf"], r["ours_options"]),
                     "yes" if speedup >= TARGET_SPEEDUP else "no"])
    shown = ", ".join(f"{k}={v}" for k, v in options.items())
    return Table(f"Our step with XLA options {shown}",
                 ["model", "ours ms/step", "ours ms/step with options", "default / with options",
                  "HF ms/step", "speed-up with options", "range", "≥ 1.3×"], rows,
                 ["Same rounds as the table above (the options trainer runs right after the "
                  "default one); ratios are medians over rounds of per-round ratios.",
                  "Options are passed to XLA's compile of our step only (not via XLA_FLAGS), "
                  "so both variants run in one process."])


def _mfu_table(workloads: list[Workload], res: dict[str, dict[str, Any]],
               peak: dict[str, float], dtype: str) -> Table:
    rows = []
    for w in workloads:
        if w.name not in res:
            continue
        r = res[w.name]
        flops, hf_flops = train_flops(w), train_flops(w, every_row=True)
        t_ours, t_hf = median(r["ours"]), median(r["hf"])
        rows.append([w.name, flops / 1e9, hf_flops / 1e9, r["xla_flops"] / 1e9,
                     flops / t_ours / 1e9, flops / t_ours / peak["peak"],
                     hf_flops / t_hf / peak["peak"],
                     flops / (t_hf / TARGET_SPEEDUP) / peak["peak"], r["compile_s"]])
    peaks = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peak.items() if k != "peak")
    return Table("Model FLOPs utilisation",
                 ["model", "analytic GFLOP/step", "HF analytic GFLOP/step",
                  "XLA-counted GFLOP/step", "ours GFLOP/s", "ours MFU", "HF MFU",
                  f"ours MFU at {TARGET_SPEEDUP}× HF", "ours compile s"],
                 rows,
                 [f"Peak = best large {dtype} matmul measured in the same run: "
                  f"{peak['peak'] / 1e9:.0f} GFLOP/s ({peaks} GFLOP/s).",
                  "Analytic FLOPs: matmuls only, train = 3 × forward "
                  "(formula in bench/workloads.py:forward_flops); HF's count has every row of "
                  "the last layer (ours computes [CLS] alone there); XLA-counted = the compiled "
                  "step's cost analysis (includes elementwise ops and the optimizer).",
                  "MFU = each framework's analytic FLOPs per step / its median step time / "
                  "peak.",
                  f"ours MFU at {TARGET_SPEEDUP}× HF = the MFU our step would need to be "
                  f"{TARGET_SPEEDUP}× faster than HF's median step (a {dtype} matmul alone "
                  "peaks at 1.0; the step also runs softmax, LayerNorm, GELU, dropout and "
                  "AdamW)."])


def _overhead_table(workloads: list[Workload], res: dict[str, dict[str, Any]]) -> Table:
    by_scheme = {w.cfg.position_scheme: w.name for w in workloads if w.name in res
                 and not w.is_mlm}
    rows = []
    base = by_scheme.get("bert_abs")
    if base is None:
        return Table("Position-scheme overheads", ["comparison"], [], ["BERT-A not measured."])
    # (scheme, label, the paper's overhead, the target ratio: None where there is none)
    for scheme, label, paper, goal in (
            ("tupe_r", "TUPE-R / BERT-A", "almost none (Ke et al. 2021)", TARGET_TUPE),
            ("deberta_v2", "DeBERTa-v3 / BERT-A", "about +30% (brief)", None)):
        name = by_scheme.get(scheme)
        if name is None:
            continue
        ours = median_ratio(res[name]["ours"], res[base]["ours"])
        hf = (median_ratio(res[name]["hf"], res[base]["hf"])
              if res[name]["same_hf_as"] == name else None)
        target = "—" if goal is None else f"≤ {goal}"
        met = "—" if goal is None else ("yes" if ours <= goal else "no")
        rows.append([label, ours, ratio_range(res[name]["ours"], res[base]["ours"]), hf,
                     res[name]["params"] / res[base]["params"], paper, target, met])
    return Table("Position-scheme overheads (equal size, same batch)",
                 ["step-time ratio", "ours", "ours range", "HF", "params ratio", "paper",
                  "target", "met"],
                 rows, ["Median (and min–max) over rounds of the per-round step-time ratio."])
