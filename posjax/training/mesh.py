"""Device mesh (data, fsdp, tensor) and the logical-axis rules that map model axes onto it.

Mesh axes: ``data`` (pure data parallelism, parameters replicated), ``fsdp`` (data parallelism
with parameters and optimizer state sharded along ``embed``), ``tensor`` (heads / MLP / vocab
split across devices). The batch is split over data × fsdp; each process feeds the rows its
devices hold (``batch_feeds``) and ``global_batch`` makes global arrays of them.
"""
from __future__ import annotations

import dataclasses
import functools
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


def build_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) Mesh with Auto axis types (what Flax logical constraints need).

    Devices are laid out physically (``mesh_utils.create_device_mesh``: neighbours on the mesh
    are neighbours on the chips' interconnect). Devices of several slices (a multi-slice job,
    ``device.slice_index``) split ``data`` across the slices: each slice holds a contiguous
    block of ``data`` laid out physically within it, so only the gradient reduction over
    ``data`` crosses the data-center network. ``devices``: jax.Device or compile-only TPU
    devices (``jax.experimental.topologies``); default ``jax.devices()``.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    slices: dict[int, list[Any]] = {}
    for d in devices:
        slices.setdefault(getattr(d, "slice_index", 0) or 0, []).append(d)
    if len(slices) == 1:
        grid = _physical_grid(shape, devices)
    else:
        n = len(slices)
        check(shape[0] % n == 0,
              f"mesh data={shape[0]} does not split over the {n} slices of this job (the "
              f"data axis crosses slices): make mesh.data a multiple of {n}")
        local = (shape[0] // n,) + tuple(shape[1:])
        grid = np.concatenate([_physical_grid(local, slices[k]) for k in sorted(slices)])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _physical_grid(shape: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
    """``devices`` as an array of ``shape`` in interconnect order where JAX knows the chips'
    topology (TPU), else in the given order."""
    try:
        from jax.experimental import mesh_utils
        return mesh_utils.create_device_mesh(tuple(shape), devices,
                                             allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        return np.asarray(devices, dtype=object).reshape(tuple(shape))


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
    """The global batch must split evenly over batch shards, microbatches and the processes'
    feeds (``batch_feeds``)."""
    shards = batch_shards(mesh)
    n = config.microbatches
    feeds = batch_feeds(mesh)
    for key in ("batch_size", "eval_batch_size"):
        size = config[key] or config.batch_size
        need = shards * (n if key == "batch_size" else 1)
        check(size % need == 0,
               f"{key}={size} is not divisible by " + (
                   f"microbatches={n} x batch shards (data x fsdp = {shards})"
                   if key == "batch_size" else f"the batch shards (data x fsdp = {shards})")
               + f": use a multiple of {need}")
        # (shards is a multiple of the feeds: this holds once the check above does)
        check(size % feeds.count == 0,
               f"{key}={size} is not divisible by the {feeds.count} input feeds")


@dataclasses.dataclass(frozen=True)
class BatchFeeds:
    """Which rows of every global batch each process feeds.

    The batch's leading axis is split into ``shards`` = data × fsdp equal shards (shard s =
    rows [s·B/shards, (s+1)·B/shards)). Each process feeds the shards its devices hold:
    ``groups[g]`` are the shards of feed ``g`` (sorted; they need not be contiguous: a
    physically laid out mesh interleaves hosts along the batch); processes whose devices hold
    the same shards (a ``tensor`` axis across hosts) form one feed and read the same examples.
    Feed g reads shard g of ``count`` of the input pipeline (``process_feed``), and its B/count
    rows go, in order, to its shards' rows (``jax.make_array_from_process_local_data``).
    """

    shards: int
    groups: tuple[tuple[int, ...], ...]
    feed_of: Mapping[int, int]        # {process index: feed}

    @property
    def count(self) -> int:
        return len(self.groups)

    def rows(self, feed: int, batch: int) -> np.ndarray:
        """The global rows (of a batch of ``batch`` rows) that ``feed`` fills, in order."""
        per = batch // self.shards
        return np.concatenate([np.arange(s * per, (s + 1) * per) for s in self.groups[feed]])

    def feed_order(self, batch: int) -> np.ndarray:
        """Index that puts a global batch's rows in feed order (feed 0's rows, then feed 1's,
        ...): the order the examples were read in. Identity when feeds hold contiguous
        blocks."""
        return np.concatenate([self.rows(g, batch) for g in range(self.count)])


@functools.lru_cache(maxsize=16)
def batch_feeds(mesh: Mesh) -> BatchFeeds:
    """``BatchFeeds`` of ``mesh`` (its devices' process indices and the batch sharding)."""
    shards = batch_shards(mesh)
    rows: dict[int, set[int]] = {}
    for device, index in batch_sharding(mesh).devices_indices_map((shards,)).items():
        rows.setdefault(device.process_index, set()).update(range(shards)[index[0]])
    return feed_groups(rows, shards, f"mesh {dict(mesh.shape)}")


def feed_groups(rows: Mapping[int, set[int]], shards: int, where: str) -> BatchFeeds:
    """``BatchFeeds`` from {process: the batch shards its devices hold}. Two processes must
    hold the same shards or none in common, and every feed the same number of shards (else
    one ValueError naming the mesh ``where``)."""
    groups = sorted({tuple(sorted(r)) for r in rows.values()})
    held = [s for g in groups for s in g]
    check(len(held) == len(set(held)) and len({len(g) for g in groups}) == 1,
           f"{where} gives processes overlapping but unequal sets of batch shards (by "
           f"process: { {p: sorted(r) for p, r in sorted(rows.items())} }), which no input "
           "feed can fill: put the devices of each process along data x fsdp or along "
           "tensor only (e.g. tensor <= the devices of one host)")
    feed_of = {p: groups.index(tuple(sorted(r))) for p, r in rows.items()}
    return BatchFeeds(shards, tuple(groups), feed_of)


def process_feed(mesh: Mesh, process: int | None = None) -> tuple[int, int]:
    """(feed index, feed count) of ``process`` (default: this one): it reads shard ``index``
    of ``count`` of the input pipeline."""
    feeds = batch_feeds(mesh)
    return feeds.feed_of[jax.process_index() if process is None else process], feeds.count


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows (its feed, ``batch_feeds``) -> global arrays sharded over
    data × fsdp."""
    count = batch_feeds(mesh).count
    out = {}
    for k, v in local.items():
        v = np.asarray(v)
        out[k] = jax.make_array_from_process_local_data(
            batch_sharding(mesh, v.ndim), v, (v.shape[0] * count,) + v.shape[1:])
    return out
