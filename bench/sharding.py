"""The sharded MLM train step on a simulated 8-device mesh: per-device memory and collectives.

    python -m bench.sharding [--before REV|DIR] [--batch B] [--layers N] [--out F.md]
    python -m bench.sharding --smoke     # a tiny model on one mesh (CI)

Compile-only: the step of ``posjax.training`` (the one ``train.py`` runs) is lowered for
abstract, sharded state on 8 host devices (``--xla_force_host_platform_device_count=8``, set
here before JAX starts) for each mesh (data × fsdp × tensor), and read back from XLA:
- the SPMD partitioner's "Involuntary full rematerialization" warnings (it replicated a whole
  tensor to re-split it),
- the per-device temporary memory of the compiled step (``memory_analysis``),
- the per-device result bytes of every collective in the partitioned HLO, by kind.
What the SPMD partitioner does depends on the mesh and the program, not on the host. Later
backend passes do differ: TPU and GPU turn an all-reduce whose result is then sliced (the
gradient of an fsdp-split parameter) into a reduce-scatter, XLA:CPU keeps the all-reduce. So the
bytes are an upper bound for an accelerator, and XLA:CPU's buffer sizes only a guide to an
accelerator's: compare code versions, not hosts. With ``--before``, posjax at REV (or the
``posjax/`` inside the folder DIR) is measured too, in the same process.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":   # before JAX starts: a simulated 8-device pod slice on the CPU
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Iterator, Sequence  # noqa: E402

if __package__ in (None, ""):   # `python bench/sharding.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

from bench.ab import import_variant  # noqa: E402
from bench.common import Table, load_average  # noqa: E402
from posjax.models.schemes import SCHEMES  # noqa: E402

MESHES = ((2, 2, 2), (2, 4, 1), (4, 2, 1), (1, 4, 2), (1, 8, 1))
MODELS = {"BERT-A": "bert_a", "DeBERTa-v3": "deberta"}
KINDS = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
BYTES = {"f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "f32": 4, "s32": 4, "u32": 4,
         "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")        # e.g. /*index=5*/ inside long tuples
REMAT_WARNING = "Involuntary full rematerialization"


def collective_bytes(hlo: str) -> dict[str, int]:
    """Per-device result bytes of the collectives in a partitioned XLA:CPU HLO module, by kind.

    XLA:CPU emits synchronous collectives only (``kind(...)`` returning an array or a tuple);
    an async ``-start`` form (an accelerator's) is refused rather than misread.
    """
    hlo = _COMMENT.sub("", hlo)
    found = _COLLECTIVE.findall(hlo)
    present = len(re.findall(r" (?:" + "|".join(KINDS) + r")(?:-start)?\(", hlo))
    if len(found) != present:
        raise ValueError(f"read {len(found)} of the HLO's {present} collectives: the parser "
                         "does not know one of their forms")
    out: collections.Counter = collections.Counter()
    for shapes, kind, start in found:
        if start:
            raise ValueError(f"async {kind}-start in the HLO: only XLA:CPU's synchronous "
                             "collectives are read (run bench.sharding on the CPU)")
        for dtype, dims in _ARRAY.findall(shapes):
            if dtype not in BYTES:
                raise ValueError(f"element type {dtype!r} of a {kind}: add its size to BYTES")
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            out[kind] += n * BYTES[dtype]
    return dict(out)


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """What C++ code (XLA's logging) writes to file descriptor 2 inside the block."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def analyse(package: Any, scheme: str, mesh_shape: tuple[int, int, int], batch: int,
            width: int, layers: int, length: int) -> dict[str, Any]:
    """Compile the MLM train step of ``package`` (posjax or a variant) on ``mesh_shape``, set
    up by its ``run_setup.prepare`` as train.py does (validated; nothing is written). A
    variant from before the split of training/loop.py uses its own recipes and ``loop``."""
    def module(name: str) -> Any:
        return importlib.import_module(f"{package.__name__}.training.{name}")

    def has(name: str) -> bool:
        return importlib.util.find_spec(f"{package.__name__}.training.{name}") is not None

    recipes = (module("text_recipes") if has("text_recipes")
               else importlib.import_module("configs.text_recipes"))
    config = recipes.mlm_config(scheme, "tiny")
    config.model.update(hidden_size=width, num_heads=max(width // 64, 2), num_layers=layers,
                        mlp_dim=4 * width, max_position_embeddings=length)
    if "max_relative_positions" in SCHEMES[config.model.position_scheme].fields:   # DeBERTa
        config.model.update(max_relative_positions=length)
    config.data.max_seq_length = length
    config.batch_size = batch
    config.optimizer.warmup_steps = 0
    config.mesh.update(dict(zip(("data", "fsdp", "tensor"), mesh_shape)))
    module("text_tasks")   # registers "mlm" (TASK_MODULES names the unaliased package)
    with tempfile.TemporaryDirectory() as workdir:
        run = module("run_setup" if has("run_setup") else "loop").prepare(config, workdir,
                                                                           training=True)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         run.abstract, run.shardings)
    step = module("steps").make_train_step(run.task, run.model, run.tx, run.mesh, run.shardings,
                                           run.task.dummy_batch(1), 1)
    with captured_stderr() as log, jax.set_mesh(run.mesh), \
            nn.logical_axis_rules(module("mesh").LOGICAL_RULES):
        compiled = step.lower(state, run.task.dummy_batch(batch),
                              jax.random.PRNGKey(0)).compile()
    return {"remat": sum(REMAT_WARNING in line for line in log),
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "collectives": collective_bytes(compiled.as_text())}


def run(variants: Sequence[tuple[str, Any]], models: Sequence[str],
        meshes: Sequence[tuple[int, int, int]], batch: int, width: int, layers: int,
        length: int) -> Table:
    """One row per model × mesh × code variant; a column per collective kind that occurs."""
    results = []
    for name in models:
        for shape in meshes:
            for label, package in variants:
                r = analyse(package, MODELS[name], shape, batch, width, layers, length)
                results.append((name, "×".join(map(str, shape)), label, r))
                print(f"{name} {shape} {label}: {r}", file=sys.stderr, flush=True)
    kinds = [k for k in KINDS if any(k in r["collectives"] for *_, r in results)]
    mib = 2.0 ** -20
    rows = [[name, mesh, label, r["remat"], r["temp"] * mib,
             *(r["collectives"].get(k, 0) * mib for k in kinds),
             sum(r["collectives"].values()) * mib] for name, mesh, label, r in results]
    layer_word = "layer" if layers == 1 else "layers"
    return Table(f"Sharded MLM train step, {width} wide, {layers} {layer_word}, batch {batch} × "
                 f"{length}: per device",
                 ["model", "data×fsdp×tensor", "code", "full rematerializations", "temp MiB",
                  *(f"{k} MiB" for k in kinds), "collectives MiB"], rows,
                 ["Compile-only, 8 simulated host devices. full rematerializations = XLA SPMD "
                  "warnings that a whole tensor was replicated to be re-split. temp = XLA "
                  "memory_analysis().temp_size_in_bytes. Collective MiB = result bytes per "
                  "device, summed over the partitioned step's collectives (kinds that occur)."])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sharding",
                                description=__doc__.split("\n")[0])
    p.add_argument("--before", default="", help="also measure posjax at this git revision or "
                                                 "folder holding posjax/")
    p.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model on one mesh (CI); --batch and --layers do not apply")
    p.add_argument("--out", default="", help="also write the table to this .md file")
    args = p.parse_args(argv)
    problems = []
    if len(jax.devices()) != 8:
        problems.append(f"needs 8 devices, JAX has {len(jax.devices())}: run it as "
                        "`python -m bench.sharding` (which simulates them), or set "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts")
    if args.batch < 8 or args.batch % 8:
        problems.append(f"--batch={args.batch}: must be a positive multiple of 8 (the devices)")
    if args.layers < 1:
        problems.append(f"--layers={args.layers}: must be >= 1")
    if args.out and not args.out.endswith(".md"):
        problems.append(f"--out={args.out}: the file name must end in .md")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    command = "python -m bench.sharding " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="posjax_sharding_") as workdir:
        variants: list[tuple[str, Any]] = [("working tree", importlib.import_module("posjax"))]
        if args.before:
            try:
                before = import_variant(args.before, "before", pathlib.Path(workdir))
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            variants.insert(0, (args.before, before))
        load0, t0 = load_average(), time.perf_counter()
        if args.smoke:
            table = run(variants, ["BERT-A"], MESHES[:1], 16, 32, 1, 16)
        else:
            table = run(variants, list(MODELS), MESHES, args.batch, 768, args.layers, 128)
    table.notes.append(f"Load average before / after: {load0} / {load_average()}; wall time "
                       f"{time.perf_counter() - t0:.0f} s.")
    text = f"Command: `{command}`\n\n{table.markdown()}"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0

if __name__ == "__main__":
    sys.exit(main())
