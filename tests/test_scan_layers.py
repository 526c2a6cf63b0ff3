"""scan_layers=True: stacked layer params, one lax.scan, the same numbers as the unrolled stack.

Forward numerics against the float64 reference are in test_reference_{text,vit}.py and a
sharded training trajectory in test_training_steps.py; here: layouts, gradients, dropout,
attention maps and the converters / init_from across the two layouts.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_inputs import abstract_variables, padded_text_batch, random_params
from posjax import TextConfig, TextForMaskedLM
from posjax.convert import Pretrained, export_hf, load_pretrained, save_checkpoint
from posjax.models.layout import stack_layers, to_layout, unstack_layers
from posjax.plots import attention_maps
from posjax.training import init_from_checks
from posjax.training import init_from as init_from_lib

CFG = TextConfig(position_scheme="deberta_v2", vocab_size=40, hidden_size=32, num_heads=4,
                 num_layers=3, mlp_dim=64, max_position_embeddings=24, position_buckets=8,
                 max_relative_positions=32, share_att_key=True, use_emd=True,
                 position_biased_input=False)
SCANNED = dataclasses.replace(CFG, scan_layers=True)
BATCH = padded_text_batch((24, 17, 6), 24, 40)


@pytest.fixture(scope="module")
def unrolled() -> dict:
    return random_params(TextForMaskedLM(CFG), **BATCH)["params"]


def test_layout_round_trip_is_exact(unrolled):
    stacked = stack_layers(unrolled)
    assert "layers" in stacked["encoder"]["encoder"]
    assert not any(k.startswith("layer_") for k in stacked["encoder"]["encoder"])
    kernel = stacked["encoder"]["encoder"]["layers"]["attention"]["query"]["kernel"]
    assert kernel.shape == (3, 32, 4, 8)
    np.testing.assert_array_equal(
        kernel[2], unrolled["encoder"]["encoder"]["layer_2"]["attention"]["query"]["kernel"])
    back = unstack_layers(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(unrolled)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(unrolled)):
        np.testing.assert_array_equal(a, b)
    assert to_layout(unrolled, False) == unrolled   # already in the asked layout: untouched


def test_stacking_refuses_gaps_in_the_numbering():
    with pytest.raises(ValueError, match="not numbered"):
        stack_layers({"layer_0": {"w": np.zeros(2)}, "layer_2": {"w": np.zeros(2)}})


def test_scanned_init_has_the_stacked_shapes_and_a_layers_axis(unrolled):
    boxed = abstract_variables(TextForMaskedLM(SCANNED), **BATCH)["params"]
    shapes = jax.tree.map(lambda x: x.shape, nn.meta.unbox(boxed))
    expected = jax.tree.map(lambda x: x.shape, stack_layers(unrolled))
    assert shapes == expected
    names = nn.get_partition_spec(boxed)["encoder"]["encoder"]["layers"]
    assert tuple(names["attention"]["query"]["kernel"]) == ("layers", "embed", "heads", "kv")
    assert names["mlp_norm"]["scale"][0] == "layers"


def _mlm_loss(cfg: TextConfig, train: bool):
    positions = jnp.array([[1, 5, 9], [0, 3, 16], [2, 4, 5]])

    def loss(params, rng):
        logits = TextForMaskedLM(cfg).apply({"params": params}, **BATCH,
                                            masked_positions=positions, train=train,
                                            rngs={"dropout": rng})
        return jnp.mean(jax.nn.log_softmax(logits)[..., 7])
    return loss


def test_gradients_equal_the_unrolled_ones(unrolled):
    rng = jax.random.key(0)
    loss_u, grad_u = jax.jit(jax.value_and_grad(_mlm_loss(CFG, False)))(unrolled, rng)
    loss_s, grad_s = jax.jit(jax.value_and_grad(_mlm_loss(SCANNED, False)))(
        stack_layers(unrolled), rng)
    assert abs(float(loss_u) - float(loss_s)) <= 1e-6
    expected = stack_layers(jax.tree.map(np.asarray, grad_u))
    worst = max(float(np.max(np.abs(np.asarray(a) - b)))
                for a, b in zip(jax.tree.leaves(grad_s), jax.tree.leaves(expected)))
    scale = max(float(np.max(np.abs(b))) for b in jax.tree.leaves(expected))
    assert worst <= 1e-5 * scale, (worst, scale)
    assert float(np.max(np.abs(expected["encoder"]["encoder"]["layers"]["mlp"]["fc2"]["kernel"]
                              [0]))) > 0   # every layer really gets a gradient


def test_dropout_is_per_layer_and_deterministic_under_remat(unrolled):
    cfg = dataclasses.replace(SCANNED, remat=True)
    params = stack_layers(unrolled)
    step = jax.jit(jax.value_and_grad(_mlm_loss(cfg, True)))
    (a, grads), (b, _) = step(params, jax.random.key(1)), step(params, jax.random.key(1))
    c, _ = step(params, jax.random.key(2))
    clean = jax.jit(_mlm_loss(cfg, False))(params, jax.random.key(1))
    assert float(a) == float(b)
    assert float(a) != float(c) and float(a) != float(clean)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_attention_maps_are_the_same_in_both_layouts(unrolled):
    maps_u = attention_maps(TextForMaskedLM(CFG), {"params": unrolled}, **BATCH)
    maps_s = attention_maps(TextForMaskedLM(SCANNED), {"params": stack_layers(unrolled)}, **BATCH)
    assert len(maps_u) == len(maps_s) == 3 + 2   # three layers, two EMD passes
    for a, b in zip(maps_u, maps_s):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_scanned_model_exports_and_reimports(unrolled, tmp_path):
    pre = Pretrained(SCANNED, stack_layers(unrolled), "text", "mlm")
    out = export_hf(pre, tmp_path / "hf")
    back = load_pretrained(out)
    assert back.config.scan_layers is False
    for a, b in zip(jax.tree.leaves(back.params),
                    jax.tree.leaves(unstack_layers(pre.params))):
        np.testing.assert_array_equal(a, b)
    again = back.with_scan_layers(True)
    assert again.config == dataclasses.replace(back.config, scan_layers=True)
    saved = load_pretrained(save_checkpoint(again, tmp_path / "posjax"))
    assert saved.config.scan_layers
    np.testing.assert_array_equal(
        saved.params["encoder"]["encoder"]["layers"]["mlp"]["fc1"]["kernel"],
        pre.params["encoder"]["encoder"]["layers"]["mlp"]["fc1"]["kernel"])


@pytest.mark.parametrize("saved_scanned", [False, True], ids=["unrolled->scan", "scan->unrolled"])
def test_init_from_loads_across_layouts(unrolled, tmp_path, saved_scanned):
    saved = Pretrained(CFG, unrolled, "text", "mlm").with_scan_layers(saved_scanned)
    folder = save_checkpoint(saved, tmp_path / "ckpt")
    target_cfg = dataclasses.replace(CFG, scan_layers=not saved_scanned)
    target = jax.tree.map(jnp.zeros_like, to_layout(unrolled, target_cfg.scan_layers))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = jax.tree.map(lambda _: replicated, target)
    init_from_checks.check_init_from(folder, target)   # accepted from metadata, either layout
    loaded, model_cfg = init_from_lib.read_pretrained(folder, target, shardings)
    merged, notes = init_from_lib.merge_pretrained(target, loaded, shardings, model_cfg)
    assert notes == []   # every tensor found its place
    expected = to_layout(unrolled, target_cfg.scan_layers)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("scheme", ["tupe_a", "tupe_r", "bert_abs_d"])
def test_scanned_stack_inits_with_a_one_position_table(scheme):
    """The stacked layers are initialised on a dummy input no longer than the shortest table
    (length 1), as the unrolled ones are on the real input."""
    cfg = TextConfig(position_scheme=scheme, vocab_size=40, hidden_size=16, num_heads=2,
                     num_layers=2, mlp_dim=32, max_position_embeddings=1)
    batch = dict(input_ids=np.ones((2, 1), np.int32), attention_mask=np.ones((2, 1), np.int32))
    unrolled = random_params(TextForMaskedLM(cfg), **batch)
    scanned = TextForMaskedLM(dataclasses.replace(cfg, scan_layers=True))
    assert jax.tree.structure(random_params(scanned, **batch)) == jax.tree.structure(
        {"params": to_layout(unrolled["params"], True)})
    np.testing.assert_allclose(scanned.apply({"params": to_layout(unrolled["params"], True)},
                                             **batch),
                               TextForMaskedLM(cfg).apply(unrolled, **batch), atol=1e-5)
