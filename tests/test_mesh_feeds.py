"""The device mesh, the logical shardings on it, and which batch rows each process feeds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax.models.config import ViTConfig
from posjax.models.vit import ViT
from posjax.training import mesh as mesh_lib


def test_mesh_shape_resolution_and_errors():
    assert mesh_lib.mesh_shape({"data": -1, "fsdp": 2, "tensor": 1}, 8) == (4, 2, 1)
    with pytest.raises(ValueError, match="needs 4 devices but 8 are present"):
        mesh_lib.mesh_shape({"data": 2, "fsdp": 2, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="does not divide 8"):
        mesh_lib.mesh_shape({"data": -1, "fsdp": 3, "tensor": 1}, 8)
    with pytest.raises(ValueError, match="unknown axes"):
        mesh_lib.mesh_shape({"pipeline": 2}, 8)
    mesh = mesh_lib.build_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_shardings_drop_axes_that_do_not_divide():
    mesh = mesh_lib.build_mesh({"fsdp": 2, "tensor": 4})
    spec = mesh_lib._fit_spec(jax.sharding.PartitionSpec("fsdp", "tensor"), (16, 10), mesh, "x")
    assert spec == jax.sharding.PartitionSpec("fsdp", None)


def test_logical_shardings_inside_the_logical_axis_rules():
    """The shardings of a boxed abstract tree are the same whether or not the caller is
    already inside ``nn.logical_axis_rules`` (where nn.unbox would add a constraint)."""
    import flax.linen as nn
    mesh = mesh_lib.build_mesh({"fsdp": 2, "tensor": 4})
    model = ViT(ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                          num_heads=4, num_layers=1, mlp_dim=32, num_classes=3))
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((2, 8, 8, 1)))
    outside = mesh_lib.logical_shardings(boxed, mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        inside = mesh_lib.logical_shardings(boxed, mesh)
    assert jax.tree.leaves(inside) == jax.tree.leaves(outside)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(inside))


def test_batch_feeds_on_the_local_mesh():
    mesh = mesh_lib.build_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices())
    feeds = mesh_lib.batch_feeds(mesh)
    assert feeds.feed_of == {0: 0} and feeds.count == 1   # one process holds every batch row
    assert mesh_lib.process_feed(mesh) == (0, 1)
    np.testing.assert_array_equal(feeds.feed_order(8), np.arange(8))


@pytest.mark.parametrize("rows,shards,groups,feed_of", [
    ({0: {0, 1}, 1: {2, 3}}, 4, ((0, 1), (2, 3)), {0: 0, 1: 1}),
    ({1: {0, 1}, 0: {2, 3}}, 4, ((0, 1), (2, 3)), {1: 0, 0: 1}),   # process 1 feeds first
    ({0: {0, 2}, 1: {1, 3}}, 4, ((0, 2), (1, 3)), {0: 0, 1: 1}),   # interleaved (physical)
    ({0: {0, 1}, 1: {0, 1}}, 2, ((0, 1),), {0: 0, 1: 0}),          # tensor across hosts
    ({0: {0}, 1: {1}, 2: {2}, 3: {3}}, 4, ((0,), (1,), (2,), (3,)), {0: 0, 1: 1, 2: 2, 3: 3}),
])
def test_feed_groups(rows, shards, groups, feed_of):
    feeds = mesh_lib.feed_groups(rows, shards, "mesh M")
    assert feeds.groups == groups and dict(feeds.feed_of) == feed_of


def test_feed_order_puts_each_feeds_rows_together():
    feeds = mesh_lib.feed_groups({0: {0, 2}, 1: {1, 3}}, 4, "mesh M")
    np.testing.assert_array_equal(feeds.rows(0, 8), [0, 1, 4, 5])
    np.testing.assert_array_equal(feeds.feed_order(8), [0, 1, 4, 5, 2, 3, 6, 7])


@pytest.mark.parametrize("rows,shards", [
    ({0: {0, 1}, 1: {1, 2}}, 3),          # overlapping but unequal
    ({0: {0, 1, 2}, 1: {3}}, 4),          # feeds of unequal size
])
def test_feed_groups_refuse_meshes_no_feed_can_fill(rows, shards):
    with pytest.raises(ValueError, match="overlapping but unequal"):
        mesh_lib.feed_groups(rows, shards, "mesh M")
