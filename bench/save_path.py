"""What saving costs the training thread: posjax's ``Checkpointer`` at two revisions, side by side.

    python -m bench.save_path [--before REV|DIR] [--size deberta-v3-base|small]
                              [--saves N] [--steps-per-save K] [--rounds R] [--bucket gs://B/P]

A train state of the size of DeBERTa-v3-base's (184M parameters and AdamW's two moments: 2.2 GB
of fp32) is saved every K steps of a stand-in step (a jitted fp32 matmul chain of ~0.2 s: real
work on the same cores, so anything a save does in the background competes with it as in a
run). Timed on the training thread: each ``save`` call, each ``check_background_save`` after a
step, and the final ``close`` (the last save's wait). ``before`` is posjax at REV (default
HEAD; imported from a copy, as ``bench.ab`` does), ``after`` the working tree; rounds alternate
which goes first. With ``--bucket``, the working tree saving to a local folder (``local``) and
to that Cloud Storage folder (``bucket``: Orbax writes in place, the integrity record downloads
every object for its CRC-32) side by side instead; on the emulator, start
``python tests/gcs_emulator.py`` in another process and export STORAGE_EMULATOR_HOST.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):   # `python bench/save_path.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.ab import import_variant  # noqa: E402
from bench.common import Table, load_average, median, environment  # noqa: E402

# (vocabulary, hidden, layers, MLP, relative-table rows): the parameter shapes of the size.
SIZES = {"deberta-v3-base": (128100, 768, 12, 3072, 512), "small": (8000, 256, 4, 1024, 256)}


def state_of(size: str) -> dict[str, Any]:
    """A train-state-shaped tree (params, AdamW mu and nu) of the size's parameter shapes,
    random fp32 (incompressible, as trained weights are)."""
    vocab, h, layers, mlp, rel = SIZES[size]
    shapes = {"embeddings": (vocab, h), "rel_embeddings": (rel, h)}
    for i in range(layers):
        shapes.update({f"layer_{i}/qkv": (h, 3 * h), f"layer_{i}/out": (h, h),
                       f"layer_{i}/mlp_in": (h, mlp), f"layer_{i}/mlp_out": (mlp, h),
                       f"layer_{i}/biases": (6 * h + mlp,)})
    rng = np.random.default_rng(0)

    def tree() -> dict[str, jax.Array]:
        return {k: jnp.asarray(rng.standard_normal(s, np.float32)) for k, s in shapes.items()}

    return {"step": jnp.zeros((), jnp.int32), "params": tree(), "mu": tree(), "nu": tree()}


def stand_in_step() -> Any:
    """A jitted step of real fp32 work (~0.2 s on 2 cores): a chain of 1024² matmuls."""
    x = jnp.ones((1024, 1024), jnp.float32) / 1024

    @jax.jit
    def step(a: jax.Array) -> jax.Array:
        for _ in range(40):
            a = jnp.tanh(a @ x)
        return a

    return step, x


def _remove(workdir: Any) -> None:
    if str(workdir).startswith("gs://"):
        from posjax import storage
        if (folder := storage.as_path(workdir)).exists():
            folder.rmtree()
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def run_variant(package: Any, workdir: Any, state: Any, saves: int,
                steps_per_save: int) -> dict[str, float]:
    """Train-thread seconds in the checkpointer's calls over ``saves`` saves (``package``'s
    Checkpointer, async saves, keep 2)."""
    checkpointer_lib = __import__(f"{package.__name__}.training.checkpointing.checkpointer",
                                  fromlist=["Checkpointer"])
    _remove(workdir)
    ckpt = checkpointer_lib.Checkpointer(workdir, steps_per_save, 2)
    data_iter = iter(grain.MapDataset.range(10 ** 6).to_iter_dataset())
    step_fn, a = stand_in_step()
    jax.block_until_ready(step_fn(a))
    in_save = in_check = slowest = 0.0
    started = time.perf_counter()
    for step in range(1, saves * steps_per_save + 1):
        a = jax.block_until_ready(step_fn(a))
        t0 = time.perf_counter()
        ckpt.save(step, state, data_iter)
        t1 = time.perf_counter()
        ckpt.check_background_save()
        t2 = time.perf_counter()
        in_save += t1 - t0
        in_check += t2 - t1
        slowest = max(slowest, t2 - t0)
    t0 = time.perf_counter()
    ckpt.close()
    in_close = time.perf_counter() - t0
    total = time.perf_counter() - started
    _remove(workdir)
    return {"save": in_save, "check": in_check, "slowest": slowest, "close": in_close,
            "total": total}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.save_path",
                                description=__doc__.split("\n")[0])
    p.add_argument("--before", default="HEAD")
    p.add_argument("--size", default="deberta-v3-base", choices=sorted(SIZES))
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--steps-per-save", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default="",
                   help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--bucket", default="",
                   help="gs://bucket/folder: compare saving there with a local folder")
    args = p.parse_args(argv)
    if args.saves < 2 or args.steps_per_save < 2:
        print("error: --saves and --steps-per-save must be 2 or more", file=sys.stderr)
        return 2
    root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="posjax_save_path_"))
    (root / "code").mkdir(parents=True, exist_ok=True)
    import posjax as after
    if args.bucket:
        from posjax import storage
        storage.check_credentials(args.bucket, "--bucket")
        names = {"local": (after, root / "ckpt"), "bucket": (after, f"{args.bucket}/ckpt")}
    else:
        names = {"before": (import_variant(args.before, "before", root / "code"),
                            root / "ckpt" / "before"), "after": (after, root / "ckpt" / "after")}
    state = state_of(args.size)
    leaves = jax.tree_util.tree_leaves(state["params"])
    millions = sum(x.size for x in leaves) / 1e6
    gigabytes = 3 * sum(x.nbytes for x in leaves) / 1e9
    load0, t0 = load_average(), time.perf_counter()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = list(names)
        for name in (order if r % 2 == 0 else order[::-1]):
            package, workdir = names[name]
            results[name].append(run_variant(package, workdir, state, args.saves,
                                             args.steps_per_save))
            last = results[name][-1]
            print(f"[save_path] round {r + 1}/{args.rounds} {name}: "
                  f"{(last['save'] + last['check']) / args.saves:.2f} s per save on the "
                  f"training thread, slowest step {last['slowest']:.2f} s", flush=True)
    rows = []
    for name in names:
        runs = results[name]
        per_save = [(x["save"] + x["check"]) / args.saves for x in runs]
        rows.append([name, median(per_save), median([x["save"] / args.saves for x in runs]),
                     median([x["check"] / args.saves for x in runs]),
                     median([x["slowest"] for x in runs]), median([x["close"] for x in runs]),
                     median([x["total"] for x in runs])])
    command = "python -m bench.save_path " + " ".join(
        argv if argv is not None else sys.argv[1:])
    env = environment()
    table = Table(
        f"Save path on the training thread ({args.size}: {millions:.0f}M parameters, "
        f"{gigabytes:.2f} GB of state, "
        f"a save every {args.steps_per_save} steps, {args.saves} saves)",
        ["variant", "s per save", "in save()", "in check_background_save()",
         "slowest step s", "close() s", "loop wall s"], rows,
        [(f"local / bucket = the working tree saving to a local folder / to {args.bucket}"
          if args.bucket else f"before = posjax at {args.before}; after = the working tree")
         + f". Medians over {args.rounds} rounds, alternating order.",
         "s per save: the seconds the training thread spent in save() and "
         "check_background_save() over the loop, per save; slowest step: the most one step's "
         "calls took; close(): the end of the run (the last save's commit and, after, its "
         "record).",
         f"CPU: {env.get('cpu_model', '?')}; load average before / after: {load0} / "
         f"{load_average()}; wall {time.perf_counter() - t0:.0f} s."])
    print(f"Command: `{command}`\n")
    print(table.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
