"""Multi-host TPU slices without the hardware: on the 4-host v4:2x2x4 (and every slice shape up
to 256 chips) each process feeds exactly the batch rows its devices hold, for every mesh the
docs offer, and every position scheme compiles for v4:2x2x4."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu (requirements-test.txt) compiles for TPU")

from posjax import plan as plan_lib  # noqa: E402
from posjax import tpu as tpu_lib  # noqa: E402
from posjax.models.schemes import TEXT_SCHEMES  # noqa: E402
from posjax.training import mesh as mesh_lib  # noqa: E402
from tpu_plans import VIT_SCHEMES, tiny_text, tiny_vit  # noqa: E402

V4_16 = {"data": 16}
MESHES = [  # data-only, fsdp-only, data x fsdp, with tensor (within and across hosts)
    {"data": -1}, {"fsdp": -1}, {"data": 2, "fsdp": 8}, {"data": 4, "fsdp": 4},
    {"data": 8, "fsdp": 2}, {"data": 4, "tensor": 4}, {"data": 2, "fsdp": 4, "tensor": 2},
    {"data": 2, "tensor": 8}, {"fsdp": 2, "tensor": 8},
]


def _devices(name: str) -> list:
    return tpu_lib.slice_devices(tpu_lib.parse_slice(name))


def _rows_fed(mesh, batch: int) -> dict[int, np.ndarray]:
    """{process: the global rows it feeds} as the input pipeline and global_batch place them."""
    feeds = mesh_lib.batch_feeds(mesh)
    return {p: feeds.rows(f, batch) for p, f in feeds.feed_of.items()}


@pytest.mark.parametrize("mesh_cfg", MESHES, ids=str)
def test_each_process_of_v4_2x2x4_feeds_exactly_the_rows_its_chips_hold(mesh_cfg):
    devices = _devices("v4-32")
    assert len({d.process_index for d in devices}) == 4
    mesh = mesh_lib.build_mesh(mesh_cfg, devices)
    batch = 64
    fed = _rows_fed(mesh, batch)
    sharding = mesh_lib.batch_sharding(mesh)
    for device, index in sharding.devices_indices_map((batch,)).items():
        held = np.arange(batch)[index[0]]
        assert set(held) <= set(fed[device.process_index])   # it feeds what its chips need
    needed = {p: set() for p in fed}
    for device, index in sharding.devices_indices_map((batch,)).items():
        needed[device.process_index] |= set(np.arange(batch)[index[0]].tolist())
    assert {p: set(r.tolist()) for p, r in fed.items()} == needed   # and nothing more
    # every row is fed: by one process, or by all processes of a tensor group alike
    feeds = mesh_lib.batch_feeds(mesh)
    assert sorted(np.concatenate([feeds.rows(g, batch) for g in range(feeds.count)])) \
        == list(range(batch))


@pytest.mark.parametrize("name", ["v4-32", "v4-128", "v4-512", "v5e-16", "v5e-64",
                                  "v5e-256", "v5p-32", "v5p-512", "v6e-16", "v6e-256"])
def test_every_documented_mesh_is_fed_on_every_slice_shape(name):
    devices = _devices(name)
    n = len(devices)
    for mesh_cfg in ({"data": -1}, {"fsdp": -1}, {"data": 2, "fsdp": -1},
                     {"fsdp": n // 4, "tensor": 4}, {"data": -1, "tensor": 8}):
        mesh = mesh_lib.build_mesh(mesh_cfg, devices)
        feeds = mesh_lib.batch_feeds(mesh)
        assert sum(len(g) for g in feeds.groups) == mesh_lib.batch_shards(mesh)


def test_train_batch_check_passes_where_it_refused_before():
    """The README's pod mesh (data=-1, fsdp=8) and the recipes' default mesh on v4-32."""
    import ml_collections
    devices = _devices("v4-32")
    for mesh_cfg in ({"data": -1, "fsdp": 8, "tensor": 1}, {"data": -1, "fsdp": 1, "tensor": 1}):
        config = ml_collections.ConfigDict({"batch_size": 256, "eval_batch_size": 256,
                                            "microbatches": 1})
        mesh_lib.validate_batch(config, mesh_lib.build_mesh(mesh_cfg, devices))


@pytest.mark.parametrize("scheme", TEXT_SCHEMES)
def test_every_text_scheme_compiles_for_v4_2x2x4(scheme):
    report = plan_lib.plan(tiny_text(scheme, batch=32), "v4:2x2x4", progress=lambda _: None)
    assert report["fits"] and report["chips"] == 16 and report["hosts"] == 4


@pytest.mark.parametrize("scheme", VIT_SCHEMES)
def test_vit_schemes_compile_for_v4_2x2x4(scheme):
    config = tiny_vit(scheme, batch=32)
    config.mesh = {"data": 4, "fsdp": 4, "tensor": 1}
    report = plan_lib.plan(config, "v4:2x2x4", progress=lambda _: None)
    assert report["fits"] and report["hosts"] == 4
