"""The pod table of docs/tpu.md: every paper-scale recipe compiled for real TPU slices with
``python -m posjax.plan`` (``posjax.plan.plan``), the largest batch per chip searched, the
results in one JSON file (cells already there are kept: rerun to resume) and the table.

    python -m bench.tpu_table --out bench/results/tpu_plans.json --doc docs/tpu.md

Runs on a CPU machine with libtpu installed (requirements-test.txt). The largest batch is
searched with at most 3 more compiles per cell, to within --tolerance: the table gives the
bracket (fits, refused); ``python -m posjax.plan ... --max-batch`` narrows it to one unit.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_between_markers  # noqa: E402
from posjax import plan as plan_lib  # noqa: E402

SLICES = ("v4-32", "v5e-256", "v5p-128", "v6e-64")
LARGE = {"hidden_size": 1024, "num_heads": 16, "num_layers": 24, "mlp_dim": 4096}
# (row name, config module, variant, model overrides)
RECIPES = (
    ("BERT-A base, 128 tokens", "mlm_bert_a", "", {}),
    ("ViT-B/16, 224 px (pre-train)", "vit_imagenet", "b16", {}),
    ("DeBERTa base, 128 tokens", "mlm_deberta", "", {}),
    ("DeBERTa-v3 base, 512 tokens", "mlm_deberta_v2", "seq=512", {}),
    ("ViT-L/16, 224 px (pre-train)", "vit_imagenet", "l16", {}),
    ("TUPE-R base, 128 tokens", "mlm_tupe_r", "", {}),
    ("DeBERTa large, 128 tokens", "mlm_deberta", "", LARGE),
    ("ViT-H/14, 224 px (pre-train)", "vit_imagenet", "h14", {}),
    ("ViT-B/16, 384 px (fine-tune)", "vit_imagenet", "b16,finetune", {}),
    ("ViT-L/16, 384 px (fine-tune)", "vit_imagenet", "l16,finetune", {}),
    ("ViT-H/14, 518 px (fine-tune)", "vit_imagenet", "h14,finetune", {}),
)
# v6e: one recipe (the others scale as on v4, which has the same HBM per chip)
V6E_RECIPES = ("BERT-A base, 128 tokens", "ViT-B/16, 224 px (pre-train)")


def cells() -> list[tuple[tuple, str]]:
    return [(recipe, tpu) for recipe in RECIPES for tpu in SLICES
            if tpu != "v6e-64" or recipe[0] in V6E_RECIPES]


def recipe_config(module: str, variant: str, model: dict):
    config = importlib.import_module(f"configs.{module}").get_config(variant)
    config.model.update(model)
    return config


def command(module: str, variant: str, model: dict, tpu: str) -> str:
    overrides = "".join(f" --config.model.{k}={v}" for k, v in model.items())
    spec = f"configs/{module}.py" + (f":{variant}" if variant else "")
    return f"python -m posjax.plan --config {spec} --tpu {tpu}{overrides} --max-batch"


def run(out: pathlib.Path, tolerance: float, max_batch: bool, slices: list[str]) -> dict:
    """Plan every cell not in ``out`` yet (with ``max_batch``: every cell of ``slices``
    without a largest batch), writing ``out`` after each."""
    results = json.loads(out.read_text()) if out.exists() else {}
    for (name, module, variant, model), tpu in cells():
        key = f"{name} @ {tpu}"
        if key in results and not (max_batch and tpu in slices
                                    and "max_batch" not in results[key]):
            continue
        start = time.perf_counter()
        print(f"== {key}", flush=True)
        report = plan_lib.plan(recipe_config(module, variant, model), tpu,
                               max_batch=max_batch and tpu in slices,
                               max_batch_tolerance=tolerance, max_batch_compiles=3,
                               progress=lambda line: print("  " + line, flush=True))
        report["command"] = command(module, variant, model, tpu)
        report["wall_s"] = time.perf_counter() - start
        report.pop("collectives", None)   # the table keeps sizes; rerun the plan for these
        results[key] = report
        out.write_text(json.dumps(results, indent=1))
    return results


def _gib(n) -> str:
    return "—" if n is None else f"{n / 2 ** 30:.1f}"


def table(results: dict) -> str:
    rows = ["| recipe | slice | mesh | params + opt state / chip (GiB) | total / chip (GiB) "
            "| HBM (GiB) | fits | largest batch (global) | est. step (ms) | est. days to "
            "the paper's steps |", "|" + "---|" * 10]
    for (name, module, variant, model), tpu in cells():
        r = results.get(f"{name} @ {tpu}")
        if r is None:
            rows.append(f"| {name} | {tpu} | not compiled yet: `"
                        f"{command(module, variant, model, tpu)}` |" + " |" * 7)
            continue
        pc = r["per_chip"]
        mesh = "×".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1"
        mb = r.get("max_batch", {})
        largest = (f"{mb['fits']}" + (f" (< {mb['refused']})" if mb.get("refused") else "")
                   if mb else "not searched")
        est = r.get("estimate")
        step = f"{est['step_s_overlapped'] * 1e3:.0f}–{est['step_s_serial'] * 1e3:.0f}" \
            if est else "—"
        days = f"{est['days_to_num_steps']:.2f} ({r['num_steps']} steps)" if est else "—"
        fits = f"yes, batch {r['batch_size']}" if r["fits"] else (
            f"no at {r['batch_size']} (needs {_gib(r.get('needed_bytes'))})")
        rows.append(f"| {name} | {tpu} | {mesh} | {_gib(pc['params'] + pc['opt_state'])} "
                    f"| {_gib(pc.get('total'))} | {r['chip']['hbm_bytes'] / 2 ** 30:.0f} | "
                    f"{fits} | {largest} | {step} | {days} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench/results/tpu_plans.json")
    parser.add_argument("--doc", type=pathlib.Path, default=None,
                        help="write the table between the markers of this Markdown file")
    parser.add_argument("--max-batch", action="store_true",
                        help="also search each cell's largest batch (3 more compiles a cell)")
    parser.add_argument("--max-batch-slices", default=",".join(SLICES),
                        help="comma-separated slices whose cells get --max-batch")
    parser.add_argument("--tolerance", type=float, default=0.25,
                        help="largest batch to within this fraction (1 unit: 0)")
    args = parser.parse_args()
    results = run(args.out, args.tolerance, args.max_batch, args.max_batch_slices.split(","))
    text = table(results)
    print(text)
    if args.doc:
        write_between_markers(args.doc, "tpu_table", text)


if __name__ == "__main__":
    main()
