"""The jitted train and eval steps.

Train step, with n microbatches and the task's metrics {name: (sum, weight)}:

    g = Σ_i ∇ loss_sum_i / Σ_i loss_weight_i        (scan over microbatches, exact accumulation)
    ĝ = clip(g); params, opt_state = optimizer(ĝ)

Microbatch i holds examples i, i+n, i+2n, ... of the global batch, so every microbatch is spread
evenly over the batch shards. The dropout RNG of microbatch i is fold_in(fold_in(key, step), i).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posjax.training import mesh as mesh_lib
from posjax.training import optim
from posjax.training import state as state_lib
from posjax.training.state import TrainState
from posjax.training.tasks import Metrics, Task, make_task

StepMetrics = dict[str, Any]


def split_microbatches(batch: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
    """(B, ...) -> (n, B/n, ...) with microbatch i = batch[i::n]."""
    def split(x):
        x = x.reshape((x.shape[0] // n, n) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)
    return jax.tree.map(split, batch)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def make_train_step(task: Task, model: nn.Module, tx: optax.GradientTransformation,
                    mesh: Mesh, state_shardings: TrainState, batch_spec: dict[str, Any],
                    microbatches: int = 1) -> Callable[[TrainState, dict, jax.Array],
                                                       tuple[TrainState, StepMetrics]]:
    """jit(train_step) with in/out shardings and the state donated.

    ``batch_spec``: {key: array with the batch's ndim} (only ndim is used). Returns
    ``(state, metrics)`` with metrics {name: (sum, weight)} plus ``grad_norm`` (before clipping).
    Call it under ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(LOGICAL_RULES)``.
    """
    param_shardings = state_shardings.params
    micro_spec = NamedSharding(mesh, PartitionSpec(None, mesh_lib.BATCH_AXES))

    def loss_fn(params, batch, rng) -> tuple[jax.Array, Metrics]:
        metrics = task.train_metrics(model, params, batch, rng)
        return metrics["loss"][0], metrics

    grad_fn = jax.grad(loss_fn, has_aux=True)

    def accumulate(params, batch, rng) -> tuple[Any, Metrics]:
        if microbatches == 1:
            return grad_fn(params, batch, rng)
        micro = split_microbatches(batch, microbatches)
        micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, micro_spec), micro)
        first = jax.tree.map(lambda x: x[0], micro)
        zeros = jax.tree.map(jnp.zeros_like,
                             jax.eval_shape(grad_fn, params, first, rng))
        zeros = (jax.lax.with_sharding_constraint(zeros[0], param_shardings), zeros[1])

        def body(carry, xs):
            index, mb = xs
            out = grad_fn(params, mb, jax.random.fold_in(rng, index))
            grads, metrics = _add(carry, out)
            return (jax.lax.with_sharding_constraint(grads, param_shardings), metrics), None

        total, _ = jax.lax.scan(body, zeros, (jnp.arange(microbatches), micro))
        return total

    def train_step(state: TrainState, batch: dict, key: jax.Array):
        rng = jax.random.fold_in(key, state.step)
        grads, metrics = accumulate(state.params, batch, rng)
        weight = metrics["loss"][1]
        grads = jax.tree.map(lambda g: jnp.where(weight > 0, g / weight, 0.0), grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        return new, {**metrics, "grad_norm": grad_norm}

    batch_shardings = {k: mesh_lib.batch_sharding(mesh, v.ndim) for k, v in batch_spec.items()}
    replicated = mesh_lib.replicated(mesh)
    return jax.jit(train_step,
                   in_shardings=(state_shardings, batch_shardings, replicated),
                   out_shardings=(state_shardings, replicated),
                   donate_argnums=(0,))


def make_eval_step(task: Task, model: nn.Module) -> Callable[[Any, dict], dict[str, jax.Array]]:
    """jit(eval_outputs): per-example outputs. The inputs' own shardings are used (params as
    placed by init/restore, batches from ``global_batch``), and eval batches may carry other
    keys than train batches (e.g. no mixup targets)."""
    def eval_step(params, batch):
        return task.eval_outputs(model, params, batch)

    return jax.jit(eval_step)


@dataclasses.dataclass(frozen=True)
class Training:
    """What a run compiles for its mesh: the model, the optimizer and schedule, the state's
    abstract values and shardings, and the jitted train step (``make_train_step``)."""

    task: Task
    model: nn.Module
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    abstract: TrainState        # ShapeDtypeStructs with their shardings: nothing allocated
    shardings: TrainState
    mesh: Mesh
    train_step: Callable[[TrainState, dict, jax.Array], tuple[TrainState, StepMetrics]]

    def abstract_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """A global batch of ``batch_size`` rows as the step receives it (sharded over
        data × fsdp)."""
        return {k: jax.ShapeDtypeStruct(v.shape, jax.dtypes.canonicalize_dtype(v.dtype),
                                        sharding=mesh_lib.batch_sharding(self.mesh, v.ndim))
                for k, v in self.task.dummy_batch(batch_size).items()}

    def lower(self, batch_size: int) -> jax.stages.Lowered:
        """The train step lowered for a global batch of ``batch_size`` (ahead of time: no
        array is allocated, the mesh's devices may be compile-only ones)."""
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=mesh_lib.replicated(self.mesh))
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
            return self.train_step.lower(self.abstract, self.abstract_batch(batch_size), key)


def build_training(config: Any, mesh: Mesh, task: Task | None = None,
                   schedule: optax.Schedule | None = None) -> Training:
    """The training program of ``config`` on ``mesh``: what train.py runs and
    ``python -m posjax.plan`` compiles (no workdir, data or device memory needed).
    ``schedule``: the learning rate of a resumed run whose num_steps changed
    (``optim.resumed_schedule``), else the config's."""
    task = task or make_task(config)
    model = task.build_model()
    tx, schedule = optim.make_optimizer(config.optimizer, config.num_steps, schedule)
    abstract, shardings = state_lib.abstract_state(task, model, tx, mesh, config.seed)
    step = make_train_step(task, model, tx, mesh, shardings, task.dummy_batch(1),
                           config.microbatches)
    return Training(task, model, tx, schedule, abstract, shardings, mesh, step)
