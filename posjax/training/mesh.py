"""Device mesh (data, fsdp, tensor) and the logical-axis rules that map model axes onto it.

Mesh axes: ``data`` (pure data parallelism, parameters replicated), ``fsdp`` (data parallelism
with parameters and optimizer state sharded along ``embed``), ``tensor`` (heads / MLP / vocab
split across devices). The batch is split over data × fsdp; each process owns one block of its
rows (``process_row_blocks``) and ``global_batch`` makes global arrays of them.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from posjax.models.config import check

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Priority order: a mesh axis already used by an earlier dimension is skipped, so activations
# (batch, length, embed) keep `embed` replicated while parameters shard it over fsdp.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("lookup_batch", "data"),   # embedding rows looked up from an fsdp-split table
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("length", None),
    ("pos", None),
    ("norm", None),
    ("embed_in", None),
    ("embed_out", None),
    ("layers", None),      # the stacked-layer axis of scan_layers=True
)


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Resolve ``{data, fsdp, tensor}`` (one of them may be -1 = the remaining devices).

    Raises ValueError naming the config field when the product does not match the devices.
    """
    unknown = sorted(set(mesh_cfg) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh has unknown axes {unknown}: use only {list(MESH_AXES)}")
    sizes = [int(mesh_cfg.get(a, 1)) for a in MESH_AXES]
    desc = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
    if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
        raise ValueError(f"mesh ({desc}) is not valid: sizes must be >= 1, with at most one -1 "
                         "(= all remaining devices)")
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise ValueError(f"mesh ({desc}) does not fit the {num_devices} devices: the fixed "
                             f"axes multiply to {fixed}, which does not divide {num_devices}")
        sizes[sizes.index(-1)] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(f"mesh ({desc}) needs {fixed} devices but {num_devices} are present: "
                         "set one axis to -1 or make the sizes multiply to the device count")
    return tuple(sizes)


def build_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) Mesh with Auto axis types (what Flax logical constraints need)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    try:
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_shards(mesh: Mesh) -> int:
    """Number of ways the batch is split (data × fsdp)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Leading axis over data × fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, path: str) -> PartitionSpec:
    """Drop mesh axes from dimensions they do not divide (e.g. 10 classes over tensor=4)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        size = math.prod(mesh.shape[a] for a in names)
        if names and dim % size:
            logging.info("replicating dim of size %d of %s (not divisible by %s=%d)",
                         dim, path, names, size)
            axes = None
        out.append(axes)
    return PartitionSpec(*out)


def logical_shardings(boxed_tree: Any, mesh: Mesh,
                      rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
    """NamedShardings for a tree of (abstract) leaves boxed with logical axis names.

    Unboxed leaves (optimizer counters, step) are replicated. The result has the structure of
    the UNBOXED tree.
    """
    specs = nn.get_partition_spec(boxed_tree)
    mesh_specs = nn.logical_to_mesh(specs, rules)
    # Shapes only: no sharding constraint (nn.unbox would add one under logical_axis_rules).
    shapes = jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x,
        boxed_tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))

    def fit(path, spec, leaf):
        return NamedSharding(mesh, _fit_spec(spec, tuple(leaf.shape), mesh,
                                             jax.tree_util.keystr(path)))

    return jax.tree_util.tree_map_with_path(
        fit, mesh_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def validate_batch(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
    """The global batch must split evenly over processes, batch shards and microbatches."""
    shards = batch_shards(mesh)
    n = config.microbatches
    for key in ("batch_size", "eval_batch_size"):
        size = config[key] or config.batch_size
        need = shards * (n if key == "batch_size" else 1)
        check(size % need == 0,
               f"{key}={size} is not divisible by " + (
                   f"microbatches={n} x batch shards (data x fsdp = {shards})"
                   if key == "batch_size" else f"the batch shards (data x fsdp = {shards})")
               + f": use a multiple of {need}")
        check(size % jax.process_count() == 0,
               f"{key}={size} is not divisible by the {jax.process_count()} processes")
    process_row_blocks(mesh)   # raises when processes do not own one block of rows each


def process_row_blocks(mesh: Mesh) -> dict[int, int]:
    """{process index: k}: the process owns rows block k of the global batch (blocks of
    b / processes rows in row order), so it feeds shard k of the input pipeline and
    ``make_array_from_process_local_data`` places its rows where the pipeline means them."""
    shards = batch_shards(mesh)
    rows: dict[int, set[int]] = {}
    sharding = batch_sharding(mesh)
    for device, index in sharding.devices_indices_map((shards,)).items():
        rows.setdefault(device.process_index, set()).update(range(shards)[index[0]])
    return row_blocks(rows, shards, f"mesh {dict(mesh.shape)}")


def row_blocks(rows: dict[int, set[int]], shards: int, where: str) -> dict[int, int]:
    """{process: k} from the batch shards each process holds ({process: shard indices} of
    ``shards``): process p must hold exactly the contiguous shards of block k, blocks of
    shards / processes, one block per process. ``where`` names the mesh in the error."""
    check(shards % len(rows) == 0,
           f"{where} has data x fsdp = {shards} batch shards, which do not split over the "
           f"{len(rows)} processes: make data x fsdp a multiple of {len(rows)}")
    size = shards // len(rows)
    blocks = {p: min(r) // size for p, r in rows.items()}
    contiguous = all(r == set(range(blocks[p] * size, (blocks[p] + 1) * size))
                     for p, r in rows.items())
    check(contiguous and sorted(blocks.values()) == list(range(len(rows))),
           f"{where} does not give each of the {len(rows)} processes its own contiguous block "
           f"of batch rows (batch shards by process: "
           f"{ {p: sorted(r) for p, r in sorted(rows.items())} }): make data x fsdp a multiple "
           "of the process count, with each process's devices adjacent along data x fsdp")
    return blocks


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over data × fsdp."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim),
                                                      np.asarray(v))
            for k, v in local.items()}
