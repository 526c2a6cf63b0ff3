"""The study's one adapter to the training system: train a workdir, read its metrics and
params, evaluate params on a (changed) config, and time a train step (StepClock).

Everything the study needs from ``posjax.training`` goes through here, so when the trainer's
modules move only this file changes.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from posjax.training import trainer
from posjax.training.errors import Diverged
from posjax.training.metrics import read_metrics
from posjax.training.tasks import make_task

train = trainer.train
__all__ = ["Diverged", "train"]


def finished_eval(workdir: pathlib.Path, num_steps: int) -> dict[str, Any] | None:
    """The final eval metrics JSON of a finished run in ``workdir`` (None if not finished)."""
    files = sorted((workdir / "checkpoints").glob(f"eval_{num_steps}_*.json"))
    for f in files:
        if "_data-" not in f.name:
            return json.loads(f.read_text())
    return None


def metrics(workdir: pathlib.Path) -> list[dict[str, Any]]:
    path = workdir / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def step_time(records: list[dict[str, Any]]) -> float:
    """Median seconds per train step over the logged intervals (compilation excluded)."""
    rates = [r["steps_per_s"] for r in records
             if r.get("split") == "train" and np.isfinite(r.get("steps_per_s", np.nan))]
    return float(1.0 / np.median(rates)) if rates else float("nan")


def curve(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Rows (step, train_loss, eval_<metric>...) merged by step, in step order."""
    rows: dict[int, dict[str, float]] = {}
    for r in records:
        row = rows.setdefault(int(r["step"]), {"step": int(r["step"])})
        if r.get("split") == "train" and "loss" in r:
            row["train_loss"] = float(r["loss"])
        elif r.get("split") == "eval":
            for k, v in r.items():
                if k not in ("step", "split") and isinstance(v, (int, float)):
                    row[f"eval_{k}"] = float(v)
    return [rows[s] for s in sorted(rows)]


def load_params(workdir: pathlib.Path) -> dict[str, Any]:
    """The latest checkpoint's params of a train.py workdir, as numpy arrays."""
    import orbax.checkpoint as ocp

    from posjax import checkpoint_io

    workdir = pathlib.Path(workdir).absolute()   # orbax reads absolute paths only
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                   if p.name.isdigit() and (p / "state").is_dir())
    path = workdir / "checkpoints" / str(steps[-1]) / "state"
    tree = checkpoint_io.read_metadata_tree(path)
    item = {"params": tree["params"]}
    restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item,
                           is_leaf=lambda x: hasattr(x, "shape"))
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore, partial_restore=True)
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(path, args=args)["params"]


def initial_params(config: ml_collections.ConfigDict) -> Any:
    """The parameters train.py starts ``config`` from (its seed's initialisation), as numpy."""
    import flax.linen as nn

    task, model = build(config)
    batch = {k: jnp.asarray(v) for k, v in task.dummy_batch(1).items()}
    params = nn.unbox(task.init_params(model, jax.random.PRNGKey(int(config.seed)), batch))
    return jax.tree.map(np.asarray, params)


def param_count(params: Any) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def build(config: ml_collections.ConfigDict) -> tuple[Any, Any]:
    """(task, model) of a train config (validated as train.py would)."""
    task = make_task(config)
    task.validate()
    return task, task.build_model()


def evaluate_params(config: ml_collections.ConfigDict, params: Any,
                    max_batches: int | None = None) -> dict[str, float]:
    """``config``'s task metrics of ``params`` on its test split (one process, no mesh):
    used for held-out data at another length or resolution than the run's."""
    task, model = build(config)
    model, params = task.for_evaluation(model, params)   # a table extended to the length
    batch_size = int(config.eval_batch_size or config.batch_size)
    pipe = task.make_pipeline("test", batch_size, int(config.seed), False, 0, 1)
    step = jax.jit(lambda p, b: task.eval_outputs(model, p, b))
    collected: dict[str, list[np.ndarray]] = {}
    for i, batch in enumerate(pipe.dataset):
        if max_batches is not None and i >= max_batches:
            break
        out = {k: np.asarray(v) for k, v in step(params, {k: jnp.asarray(v)
                                                          for k, v in batch.items()}).items()}
        out["__mask__"] = np.asarray(batch["mask"])
        for k, v in out.items():
            collected.setdefault(k, []).append(v)
    mask = np.concatenate(collected.pop("__mask__")).astype(bool)
    return task.summarize({k: np.concatenate(v)[mask] for k, v in collected.items()})


class StepClock:
    """A train config's own train step (``posjax.training.steps``: forward, backward and the
    optimizer update, as train.py runs it, on this process's devices), compiled once, and one
    real training batch, stepped on demand: ``seconds(n)`` times ``n`` steps; ``memory``: XLA's
    compiled sizes of that step (bytes): ``temp`` (activations and scratch), ``arguments``
    (state + batch) and their sum ``peak``."""

    def __init__(self, config: ml_collections.ConfigDict) -> None:
        import flax.linen as nn

        from posjax.training import mesh as mesh_lib
        from posjax.training import optim, steps
        from posjax.training import state as state_lib

        task, model = build(config)
        self.mesh = mesh_lib.build_mesh(config.mesh)
        self._context = lambda: (jax.set_mesh(self.mesh),
                                 nn.logical_axis_rules(mesh_lib.LOGICAL_RULES))
        tx, _ = optim.make_optimizer(config.optimizer, int(config.num_steps))
        seed = int(config.seed)
        pipe = task.make_pipeline("train", int(config.batch_size), seed, True, 0, 1)
        self.batch = mesh_lib.global_batch(next(pipe.iterator), self.mesh)
        self.key = jax.random.PRNGKey(seed)
        _, shardings = state_lib.abstract_state(task, model, tx, self.mesh, seed)
        self.state = state_lib.init_state(task, model, tx, self.mesh, shardings, seed)
        mesh_context, rules = self._context()
        with mesh_context, rules:
            step = steps.make_train_step(task, model, tx, self.mesh, shardings,
                                         task.dummy_batch(1), int(config.microbatches))
            self._step = step.lower(self.state, self.batch, self.key).compile()
        self.params = param_count(self.state.params)
        info = self._step.memory_analysis()
        temp = float(getattr(info, "temp_size_in_bytes", 0) or 0)
        args = float(getattr(info, "argument_size_in_bytes", 0) or 0)
        self.memory = {"temp_bytes": temp, "argument_bytes": args, "peak_bytes": temp + args}

    def seconds(self, n: int) -> float:
        """Wall seconds of ``n`` train steps."""
        import time

        mesh_context, rules = self._context()
        with mesh_context, rules:
            start = time.perf_counter()
            for _ in range(n):
                self.state, _ = self._step(self.state, self.batch, self.key)
            jax.block_until_ready(self.state.step)
            return time.perf_counter() - start
