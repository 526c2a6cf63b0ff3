"""Train state, its shardings and sharded initialisation (pretrained params: ``init_from``).

Sharded init: ``eval_shape`` of the boxed params gives the logical axis names -> NamedShardings
(``mesh.logical_shardings``); the optimizer state inherits each parameter's sharding
(``optax.tree_map_params``); ``jit(init, out_shardings=...)`` then materialises every array
directly on its devices, unboxed.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, Sharding

from posjax.training import mesh as mesh_lib
from posjax.training.tasks import Task


@flax.struct.dataclass
class TrainState:
    """step () int32; params and opt_state: fp32 trees (unboxed)."""

    step: jax.Array
    params: Any
    opt_state: Any


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def all_finite(tree: Any) -> bool:
    """Whether every floating-point value in ``tree`` (e.g. a TrainState) is finite."""
    return bool(_all_finite(tree))


def _is_sharding(x: Any) -> bool:
    return isinstance(x, Sharding)


def abstract_state(task: Task, model: nn.Module, tx: optax.GradientTransformation,
                   mesh: Mesh, seed: int) -> tuple[TrainState, TrainState]:
    """(abstract state with shardings attached, the state's NamedShardings) — no compute:
    everything is traced, nothing compiled (a run refused after this compiled nothing)."""
    batch = {k: jax.ShapeDtypeStruct(v.shape, jax.dtypes.canonicalize_dtype(v.dtype))
             for k, v in task.dummy_batch(mesh_lib.batch_shards(mesh)).items()}
    boxed = jax.eval_shape(lambda b: task.init_params(model, jax.random.PRNGKey(seed), b),
                           batch)
    param_shardings = mesh_lib.logical_shardings(boxed, mesh)
    params = nn.unbox(boxed)
    opt_state = jax.eval_shape(tx.init, params)
    replicated = mesh_lib.replicated(mesh)
    found = []

    def opt_shardings_traced() -> None:
        # tree_map_params runs tx.init on placeholders: traced here, its arrays (step counts)
        # are not computed, so nothing is compiled. The result holds shardings only.
        found.append(optax.tree_utils.tree_map_params(
            tx, lambda _, s: s, opt_state, param_shardings,
            transform_non_params=lambda _: replicated, is_leaf=_is_sharding))

    jax.eval_shape(opt_shardings_traced)
    opt_shardings = found[0]
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                        opt_state=opt_state)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)
    return abstract, shardings


def init_state(task: Task, model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
               shardings: TrainState, seed: int) -> TrainState:
    """Fresh state, initialised inside jit straight onto its shardings (params from ``seed``;
    the key is an argument, so every seed shares one compiled init)."""
    batch_size = mesh_lib.batch_shards(mesh)

    def init(key: jax.Array) -> TrainState:
        batch = {k: jnp.asarray(v) for k, v in task.dummy_batch(batch_size).items()}
        params = nn.unbox(task.init_params(model, key, batch))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params))

    # Initialisation needs no activation constraints: out_shardings place every array.
    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(seed))
