"""train_step on 8 fake devices follows the 1-device trajectory; gradient accumulation is exact."""
from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

from posjax.models.layout import stack_layers
from posjax.training import mesh as mesh_lib
from posjax.training import optim, state as state_lib, steps
from posjax.training.tasks import make_task
from configs.text_recipes import mlm_config

import synthetic_runs as syn

BATCH = 32
NUM_STEPS = 5


def _batches() -> list[dict[str, np.ndarray]]:
    data = syn.synthetic_split(True, 8, 1)
    order = np.random.default_rng(0).permutation(np.resize(np.arange(96), BATCH * NUM_STEPS))
    return [{"image": data["image"][idx], "label": data["label"][idx],
             "mask": np.ones(BATCH, bool)} for idx in order.reshape(NUM_STEPS, BATCH)]


def _setup(config, mesh_cfg: dict, devices, num_steps: int):
    """(task, model, tx, mesh, shardings, the seed's initial state) of ``config`` on a mesh."""
    task = make_task(config)
    model = task.build_model()
    tx, _ = optim.make_optimizer(config.optimizer, num_steps)
    mesh = mesh_lib.build_mesh(mesh_cfg, devices)
    _, shardings = state_lib.abstract_state(task, model, tx, mesh, config.seed)
    state = state_lib.init_state(task, model, tx, mesh, shardings, config.seed)
    return task, model, tx, mesh, shardings, state


def _trajectory(mesh_cfg: dict, devices, microbatches: int = 1, model: dict | None = None,
                init_params=None):
    """Losses of NUM_STEPS train steps and the final params (numpy). ``model``: config.model
    overrides; ``init_params``: start from these params (numpy) instead of the seed's init."""
    # No dropout: microbatches draw other masks than the big batch. (Dropout under different
    # meshes and processes is compared in test_training_runs.)
    overrides = {f"model.{k}": v for k, v in (model or {}).items()}
    config = syn.tiny_config(**{"model.dropout_rate": 0.0, "optimizer.warmup_steps": 0,
                                **overrides})
    task, model, tx, mesh, shardings, state = _setup(config, mesh_cfg, devices, NUM_STEPS)
    if init_params is not None:
        params = jax.device_put(init_params, shardings.params)
        with jax.set_mesh(mesh):
            opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
        state = state.replace(params=params, opt_state=opt_state)
    step = steps.make_train_step(task, model, tx, mesh, shardings, task.dummy_batch(1),
                                 microbatches)
    losses = []
    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        for batch in _batches():
            state, metrics = step(state, batch, jax.random.PRNGKey(7))
            loss_sum, weight = jax.device_get(metrics["loss"])
            assert weight == BATCH
            losses.append(loss_sum / weight)
    return np.array(losses), jax.tree.map(np.asarray, state.params), shardings


@pytest.fixture(scope="module")
def reference():
    return _trajectory({"data": 1}, jax.devices()[:1])


@pytest.mark.parametrize("mesh_cfg", [{"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2},
                                      {"fsdp": 8}], ids=["data8", "d2f2t2", "fsdp8"])
def test_sharded_train_step_follows_one_device(reference, mesh_cfg):
    ref_losses, ref_params, _ = reference
    losses, params, shardings = _trajectory(mesh_cfg, jax.devices())
    assert np.max(np.abs(losses - ref_losses)) <= 1e-5, (losses, ref_losses)
    assert np.ptp(ref_losses) > 1e-3   # the trajectory is not trivially constant
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=5e-4, rtol=0)   # Adam: ~lr·sign(g) for g ≈ 0
    # The parameters really are sharded as the mesh says: query kernel (embed 16, heads 2, 8).
    kernel = shardings.params["encoder"]["layer_0"]["attention"]["query"]["kernel"]
    fsdp, tensor = mesh_cfg.get("fsdp", 1), mesh_cfg.get("tensor", 1)
    assert kernel.shard_shape((16, 2, 8)) == (16 // fsdp, 2 // tensor, 8)


def test_scanned_layers_follow_unrolled_layers():
    """scan_layers=True on a 2×2×2 mesh, started from the restacked unrolled init, follows the
    unrolled 1-device run; its layer params carry the unsharded 'layers' axis first."""
    two_layers = {"num_layers": 2}
    ref_losses, ref_params, _ = _trajectory({"data": 1}, jax.devices()[:1], model=two_layers)
    unrolled_init = _initial_params(two_layers)
    losses, params, shardings = _trajectory(
        {"data": 2, "fsdp": 2, "tensor": 2}, jax.devices(),
        model={**two_layers, "scan_layers": True}, init_params=stack_layers(unrolled_init))
    assert np.max(np.abs(losses - ref_losses)) <= 1e-5, (losses, ref_losses)
    flat_ref = jax.tree_util.tree_leaves_with_path(stack_layers(ref_params))
    flat = dict(jax.tree_util.tree_leaves_with_path(params))
    assert len(flat) == len(flat_ref)
    for path, b in flat_ref:
        np.testing.assert_allclose(flat[path], b, atol=5e-4, rtol=0)
    kernel = shardings.params["encoder"]["layers"]["attention"]["query"]["kernel"]
    assert kernel.shard_shape((2, 16, 2, 8)) == (2, 8, 1, 8)


def _initial_params(model: dict):
    config = syn.tiny_config(**{f"model.{k}": v for k, v in model.items()})
    state = _setup(config, {"data": 1}, jax.devices()[:1], NUM_STEPS)[-1]
    return jax.tree.map(np.asarray, state.params)


def test_gradient_accumulation_equals_big_batch(reference):
    """4 microbatches of 8 (on 8 devices) give the 1-device 32-example step."""
    big_losses, big_params, _ = reference
    losses, params, _ = _trajectory({"data": 4, "fsdp": 2}, jax.devices(), microbatches=4)
    assert np.max(np.abs(losses - big_losses)) <= 1e-5
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(big_params)):
        np.testing.assert_allclose(a, b, atol=5e-4, rtol=0)   # Adam: ~lr·sign(g) for g ≈ 0


def test_split_microbatches_is_strided():
    x = np.arange(12)
    out = steps.split_microbatches({"x": x}, 3)["x"]
    np.testing.assert_array_equal(out, [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]])


def _text_steps(mesh_cfg: dict, devices):
    """Losses and final params of 3 MLM steps of a 1-layer BERT-A (batch 8 × 16 tokens)."""
    length = 16
    config = mlm_config("bert_a", "tiny")
    config.model.update(hidden_size=24, num_heads=2, num_layers=1, mlp_dim=32,
                        vocab_size=40, max_position_embeddings=length, dropout_rate=0.0,
                        attention_dropout_rate=0.0)
    config.data.max_seq_length = length
    config.optimizer.warmup_steps = 0
    task, model, tx, mesh, shardings, state = _setup(config, mesh_cfg, devices, 3)
    step = steps.make_train_step(task, model, tx, mesh, shardings, task.dummy_batch(1), 1)
    rng = np.random.default_rng(0)
    batch = task.dummy_batch(8)
    losses = []
    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        for _ in range(3):
            batch["input_ids"] = rng.integers(5, 40, batch["input_ids"].shape, dtype=np.int32)
            batch["token_type_ids"] = rng.integers(0, 2, batch["input_ids"].shape, dtype=np.int32)
            batch["masked_positions"] = rng.integers(0, length, batch["masked_positions"].shape,
                                                     dtype=np.int32)
            batch["masked_ids"] = rng.integers(5, 40, batch["masked_ids"].shape, dtype=np.int32)
            batch["masked_weights"] = np.ones_like(batch["masked_weights"])
            state, metrics = step(state, batch, jax.random.PRNGKey(7))
            loss_sum, weight = jax.device_get(metrics["loss"])
            losses.append(loss_sum / weight)
    return np.array(losses), jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize("mesh_cfg", [{"data": 2, "fsdp": 2, "tensor": 2},
                                      {"data": 2, "fsdp": 4}], ids=["d2f2t2", "d2f4"])
def test_sharded_text_step_keeps_embeddings_batch_sharded(mesh_cfg, capfd):
    """The word-embedding lookup from an fsdp-split table follows the 1-device step, and XLA's
    SPMD partitioner no longer replicates the whole (B, L, E) embeddings to re-split them
    ("Involuntary full rematerialization", on meshes with data and fsdp both > 1)."""
    ref_losses, ref_params = _text_steps({"data": 1}, jax.devices()[:1])
    capfd.readouterr()
    losses, params = _text_steps(mesh_cfg, jax.devices())
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    assert np.ptp(ref_losses) > 1e-3
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=5e-4, rtol=0)


def test_rules_without_lookup_batch_leave_the_lookup_to_xla():
    """Our rules split the looked-up ids over `data`, and so do rules that map `lookup_batch`
    but not `length`; rules that do not map `lookup_batch` add no constraint on them (not a
    replicated one)."""
    import jax.numpy as jnp
    from posjax import TextConfig
    from posjax.models.text import TextEmbeddings
    module = TextEmbeddings(TextConfig(vocab_size=40, hidden_size=16, num_heads=2, num_layers=1,
                                       mlp_dim=32, max_position_embeddings=8))
    ids = jnp.zeros((8, 8), jnp.int32)
    params = module.init(jax.random.PRNGKey(0), ids, ids, None, False)
    mesh = mesh_lib.build_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    theirs = tuple(r for r in mesh_lib.LOGICAL_RULES if r[0] != "lookup_batch")
    no_length = tuple(r for r in mesh_lib.LOGICAL_RULES if r[0] != "length")
    constraints = []
    for rules in (mesh_lib.LOGICAL_RULES, no_length, theirs):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            text = jax.jit(lambda p, i: module.apply(p, i, i, None, False)).lower(
                params, ids).as_text()
        constraints.append([line for line in text.splitlines()
                            if "sharding_constraint" in line and "tensor<8x8xi32>" in line])
    ours, without_length, none = constraints
    for split in (ours, without_length):
        assert len(split) == 1 and '[{"data"}, {}]' in split[0]
    assert none == []
