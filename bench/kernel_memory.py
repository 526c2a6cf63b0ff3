"""Per-chip memory of the three attention paths, compiled for single TPU chips (issue #52).

One encoder layer at DeBERTa-v3-base width (hidden 768, 12 heads of 64, MLP 3072), batch 1,
forward and backward (the gradient of every parameter), compiled by the real TPU compiler
(libtpu, no TPU) for one chip of a v5e / v5p slice, with ``model.attention_impl`` = ``xla``
(plain L × L logits), ``blocked`` (posjax/layers/blocked.py's scan) and ``pallas`` (the
kernels, forward and backward, posjax/kernels/). Memory is
``memory_analysis()``'s argument + output + temporaries + code per chip; a program the
compiler refuses is "does not fit" with the bytes it asked for. Then, on v5e (16 GiB), the
largest power-of-two length that compiles, per scheme and path.

    python -m bench.kernel_memory --out bench/results/kernel_memory.json --doc BENCHMARKS.md

Resumable: cells already in ``--out`` are kept. Needs libtpu (requirements-test.txt).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from posjax import kernels  # noqa: E402
from bench.common import write_between_markers  # noqa: E402
from posjax import plan as plan_lib  # noqa: E402
from posjax import tpu as tpu_lib  # noqa: E402
from posjax.models.config import TextConfig  # noqa: E402
from posjax.models import schemes as schemes_lib  # noqa: E402
from posjax.models.text import TextEncoder  # noqa: E402
from posjax.training import mesh as mesh_lib  # noqa: E402

# One scheme per kind of term the kernel computes (as tests/test_attention_impl.py).
SCHEMES = ("bert_abs", "bert_rel", "tupe_r", "bert_abs_d", "alibi", "rope", "deberta_v2")
IMPLS = ("xla", "blocked", "pallas")
LENGTHS = (512, 2048, 8192, 32768)
CHIPS = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1"}     # one chip of each (v5litepod-1 is refused)
LARGEST_UP_TO = 1 << 18
BLOCK = 512                                        # TextConfig's default attention_block_size


def layer_config(scheme: str, length: int, impl: str, block: int = BLOCK) -> TextConfig:
    extra = {}
    if schemes_lib.SCHEMES[scheme].disentangled:   # DeBERTa-v3: 256 log buckets over a 512 span
        extra = dict(max_relative_positions=512, position_buckets=256, use_emd=False,
                     position_biased_input=False)
    return TextConfig(position_scheme=scheme, vocab_size=128, hidden_size=768, num_heads=12,
                      num_layers=1, mlp_dim=3072, max_position_embeddings=length,
                      dropout_rate=0.0, attention_dropout_rate=0.0, attention_impl=impl,
                      attention_block_size=block, blocked_attention_from=0, **extra)


def compile_layer(chip: str, cfg: TextConfig, length: int) -> dict:
    """Compile the layer's forward + backward for one chip -> memory (bytes) or refusal."""
    device = tpu_lib.slice_devices(tpu_lib.parse_slice(CHIPS[chip]))[0]
    mesh = mesh_lib.build_mesh({"data": 1, "fsdp": 1, "tensor": 1}, [device])
    model = TextEncoder(cfg)
    ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
    abstract = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.ones(
        (1, min(length, 128)), jnp.int32), jnp.ones((1, min(length, 128)), jnp.int32))))

    def loss(params, ids, mask):
        return jnp.mean(jnp.square(model.apply(params, ids, mask).astype(jnp.float32)))

    start = time.perf_counter()
    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        lowered = jax.jit(jax.grad(loss), in_shardings=mesh_lib.replicated(mesh)).lower(
            abstract, ids, ids)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        needed, _ = plan_lib._needed_bytes(str(e))
        return {"fits": False, "needed": needed, "compile_s": time.perf_counter() - start}
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    return {"fits": total <= tpu_lib.CHIPS[chip].hbm_bytes, "total": int(total),
            "temp": int(m.temp_size_in_bytes), "compile_s": time.perf_counter() - start,
            "kernel_calls": compiled.as_text().count('custom_call_target="tpu_custom_call"')}


def cells() -> list[tuple[str, str, str, int, int]]:
    """(chip, scheme, impl, length, block): v5e's table longest length first (the cells
    that decide what fits), its block-size note, then v5p's table."""
    def table_of(chip: str) -> list:
        return [(chip, s, impl, n, BLOCK) for n in reversed(LENGTHS) for s in SCHEMES
                for impl in IMPLS]

    note = [("v5e", s, "pallas", 8192, b) for s in ("bert_rel", "deberta_v2")
            for b in (128, 256, 1024)]
    return table_of("v5e") + note + table_of("v5p")


def key(chip: str, scheme: str, impl: str, length: int, block: int) -> str:
    return f"{chip} {scheme} {impl} L={length} block={block}"


def run(out: pathlib.Path, only: str | None, chip_only: str | None) -> dict:
    results = json.loads(out.read_text()) if out.exists() else {}

    def measure(chip, scheme, impl, length, block):
        k = key(chip, scheme, impl, length, block)
        logits = 4 * 12 * length ** 2   # one layer's f32 L x L scores, 12 heads, batch 1
        if k not in results and impl == "xla" and logits > tpu_lib.CHIPS[chip].hbm_bytes:
            # Not compiled: the chip would refuse it, and DeBERTa's static (L, L) gather index
            # is a host constant of 4 L^2 bytes (4 GiB at 32k; BERT-R's buckets were one too,
            # before they were computed on device) that exhausts this machine's memory.
            results[k] = {"fits": False, "needed": logits, "at_least": True, "compile_s": 0.0}
        if k not in results:
            with kernels.compiling_for("tpu"):
                cfg = layer_config(scheme, length, impl, block)
                results[k] = compile_layer(chip, cfg, length)
            out.write_text(json.dumps(results, indent=1))
            r = results[k]
            print(f"{k}: {'fits' if r['fits'] else 'does not fit'} "
                  f"{_gib(r.get('total') or r.get('needed'))} GiB "
                  f"({r['compile_s']:.1f} s)", flush=True)
        return results[k]

    todo = [c for c in cells() if (only is None or c[1] == only)
            and (chip_only is None or c[0] == chip_only)]
    for i, cell in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}]", end=" ", flush=True)
        measure(*cell)
    for scheme in SCHEMES:            # the largest length that fits one v5e chip
        if (only is not None and scheme != only) or chip_only not in (None, "v5e"):
            continue
        for impl in IMPLS:
            length = LENGTHS[-1]
            while (length <= LARGEST_UP_TO
                   and measure("v5e", scheme, impl, length, BLOCK)["fits"]):
                length *= 2
    return results


def _gib(n) -> str:
    return "—" if n is None else f"{n / 2 ** 30:.2f}"


def largest(results: dict, scheme: str, impl: str) -> str:
    """The largest power-of-two length that fits one v5e chip: "·" until the search has
    reached a refused length (or the cap: "≥")."""
    seen = {n: results[k]["fits"] for n in (512 << i for i in range(12))
            if (k := key("v5e", scheme, impl, n, BLOCK)) in results}
    refused = [n for n, fits in seen.items() if not fits]
    fits = [n for n, ok in seen.items() if ok and (not refused or n < min(refused))]
    if refused:
        return f"{max(fits):,}" if fits else f"< {min(refused):,}"
    return f"≥ {max(fits):,}" if fits and max(fits) >= LARGEST_UP_TO else "·"


def table(results: dict) -> str:
    rows = []
    for chip in CHIPS:
        rows += [f"\n**{chip}** ({tpu_lib.CHIPS[chip].hbm_bytes / 2 ** 30:.0f} GiB HBM), GiB "
                 "per chip (xla / blocked / pallas); ✗ = does not fit (bytes the compiler "
                 "asked for; ✗ ≥: not compiled, the plain path's f32 L × L scores alone "
                 "exceed the chip):\n", "| scheme | " + " | ".join(f"L = {n:,}" for n in LENGTHS)
                 + (" | largest L on v5e (xla / blocked / pallas) |" if chip == "v5e" else " |"),
                 "|---" * (len(LENGTHS) + 1 + (chip == "v5e")) + "|"]
        for s in SCHEMES:
            cols = []
            for n in LENGTHS:
                parts = []
                for impl in IMPLS:
                    r = results.get(key(chip, s, impl, n, BLOCK))
                    parts.append("·" if r is None else _gib(r["total"]) if r["fits"]
                                 else f"✗ {'≥ ' * r.get('at_least', False)}"
                                      f"{_gib(r.get('needed'))}")
                cols.append(" / ".join(parts))
            last = (" | " + " / ".join(largest(results, s, i) for i in IMPLS)) \
                if chip == "v5e" else ""
            rows.append(f"| {s} | " + " | ".join(cols) + last + " |")
    rows += ["\nBlock size (v5e, L = 8,192, the kernel, GiB per chip; ✗ (VMEM): the compiler "
             "refused a kernel whose tiles overflow its scoped VMEM):\n",
             "| scheme | " + " | ".join(f"block {b}" for b in (128, 256, 512, 1024)) + " |",
             "|---" * 5 + "|"]
    for s in ("bert_rel", "deberta_v2"):
        cols = []
        for b in (128, 256, 512, 1024):
            r = results.get(key("v5e", s, "pallas", 8192, b))
            cols.append("·" if r is None else _gib(r["total"]) if r["fits"] else
                        f"✗ {_gib(r['needed'])}" if r.get("needed") else "✗ (VMEM)")
        rows.append(f"| {s} | " + " | ".join(cols) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path,
                        default=ROOT / "bench/results/kernel_memory.json")
    parser.add_argument("--doc", type=pathlib.Path, default=None,
                        help="write the table between the markers of this Markdown file")
    parser.add_argument("--scheme", default=None, help="only this scheme")
    parser.add_argument("--chip", default=None, choices=list(CHIPS), help="only this chip")
    args = parser.parse_args()
    text = table(run(args.out, args.scheme, args.chip))
    print(text)
    if args.doc:
        write_between_markers(args.doc, "kernel_memory", text)


if __name__ == "__main__":
    main()
