"""``attention_impl`` (TextConfig, ViTConfig): 'xla' (plain L × L path), 'blocked' (the
plain-JAX scan), 'pallas' (the Pallas kernel; ``pallas_interpret`` runs it in Pallas'
interpreter on CPU) and 'auto' compute the same model: MLM logits and every parameter's
gradient with the kernel equal the plain path's for each kind of position term; a kernel
that cannot run is one error naming the field and the fix."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from model_inputs import max_abs_error, padded_text_batch, random_params
from posjax import TextForMaskedLM, ViT
from posjax.models import encoder
from test_blocked_encoder import LENGTHS, config, vit_config

TOL = 2e-5
# One scheme per kind of term the kernel computes: none (absolute table), T5 buckets, TUPE's
# untied product with [CLS], BERT-A-d's per-batch products, ALiBi, RoPE (rotated q, k) and
# DeBERTa's c2p + p2c with log buckets.
TEXT = ("bert_abs", "bert_rel", "tupe_r", "bert_abs_d", "alibi", "rope", "deberta_v2")


def _close_grads(got, want) -> None:
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        err = float(np.abs(np.asarray(g) - np.asarray(w)).max())
        assert err <= TOL * max(float(np.abs(w).max()), largest), (jax.tree_util.keystr(path),
                                                                    err)


@pytest.mark.parametrize("scheme", TEXT)
def test_the_pallas_kernel_computes_the_plain_path_text(scheme):
    cfg = config(scheme, num_layers=1, **({"use_emd": False} if scheme.startswith("deberta")
                                          else {}))
    batch = padded_text_batch(LENGTHS, LENGTHS[0], 40)
    decode = np.array([[1, 20, 44], [0, 9, 37], [0, 2, 5], [0, 1, 2]], np.int32)
    p = random_params(TextForMaskedLM(cfg), **batch)

    def run(c):
        def loss(p):
            logits = TextForMaskedLM(c).apply(p, **batch, masked_positions=decode)
            return (logits[:3] ** 2).mean(), logits
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
        return np.asarray(logits), grads

    logits, grads = run(dataclasses.replace(cfg, attention_impl="xla"))
    k_logits, k_grads = run(dataclasses.replace(cfg, attention_impl="pallas",
                                                pallas_interpret=True))
    assert max_abs_error(k_logits[:3], logits[:3]) <= TOL
    _close_grads(k_grads, grads)


def test_the_pallas_kernel_computes_the_plain_path_on_a_patch_grid():
    """2D T5 buckets with [CLS] (5 × 7 patches + [CLS] = 36 tokens, blocks of 16)."""
    cfg = vit_config("bert_rel", num_layers=1)
    images = np.random.default_rng(1).normal(size=(2, 20, 28, 3)).astype(np.float32)
    p = random_params(ViT(cfg), images)

    def run(c):
        return jax.jit(jax.value_and_grad(lambda p: (ViT(c).apply(p, images) ** 2).mean()))(p)

    loss, grads = run(dataclasses.replace(cfg, attention_impl="xla"))
    k_loss, k_grads = run(dataclasses.replace(cfg, attention_impl="pallas",
                                              pallas_interpret=True))
    assert abs(float(k_loss) - float(loss)) <= TOL * abs(float(loss))
    _close_grads(k_grads, grads)


def test_which_path_runs_where():
    """'auto' off TPU: plain below blocked_attention_from, the scan from there; 'xla' never
    blocks; 'blocked'/'pallas' at every length."""
    cfg = config("bert_rel", blocked_attention_from=32)
    runs = {}
    for impl in ("auto", "xla", "blocked", "pallas"):
        c = dataclasses.replace(cfg, attention_impl=impl, pallas_interpret=impl == "pallas")
        enc = encoder.Encoder(c, pre_ln=False).bind({})
        runs[impl] = [enc.uses_blocked_attention(n) for n in (8, 32)], encoder.attention_kernel(c)
    assert runs == {"auto": ([False, True], "blocked"), "xla": ([False, False], "blocked"),
                    "blocked": ([True, True], "blocked"),
                    "pallas": ([True, True], "pallas_interpret")}


@pytest.mark.parametrize("make, message", [
    (lambda: config("bert_rel", attention_impl="pallas"),
     "attention_impl='pallas' is not valid: the Pallas kernel compiles for TPU only, and this "
     "backend is cpu: set pallas_interpret=True"),
    (lambda: config("bert_rel", attention_impl="pallas", pallas_interpret=True,
                    attention_dropout_rate=0.1),
     "attention_impl='pallas' is not valid: the Pallas kernel has no attention dropout "
     "(attention_dropout_rate=0.1): use 'blocked' or attention_dropout_rate=0"),
    (lambda: vit_config("deberta_v2", attention_impl="blocked"),
     "attention_impl='blocked' is not valid: DeBERTa's 2D relative terms on a patch grid have "
     "no blocked form: use 'auto' or 'xla'"),
    (lambda: config("bert_rel", attention_impl="flash"),
     "attention_impl='flash' is not valid: choose one of auto, xla, blocked, pallas"),
])
def test_a_kernel_that_cannot_run_is_one_error(make, message):
    with pytest.raises(ValueError) as raised:
        make()
    assert message in str(raised.value)


@pytest.mark.parametrize("scheme", ("bert_abs_d", "deberta_v2", "bert_rel", "tupe_r"))
def test_the_pallas_kernel_runs_per_shard_of_a_mesh(scheme):
    """Under a mesh (data 2 × fsdp 2 × tensor 2 of the 8 test devices) the kernel runs inside
    shard_map, each device on its examples and heads (XLA cannot partition a Mosaic kernel:
    without it every multi-chip TPU run failed), and computes the unsharded plain path."""
    from jax.sharding import NamedSharding, PartitionSpec
    import flax.linen as nn
    from posjax.training import mesh as mesh_lib

    cfg = config(scheme, num_layers=1, **({"use_emd": False} if scheme.startswith("deberta")
                                          else {}))
    batch = padded_text_batch(LENGTHS, LENGTHS[0], 40)
    p = random_params(TextForMaskedLM(cfg), **batch)

    def loss(c):
        return lambda p, batch: (TextForMaskedLM(c).apply(p, **batch) ** 2).mean()

    want, want_grads = jax.jit(jax.value_and_grad(loss(dataclasses.replace(
        cfg, attention_impl="xla"))))(p, batch)
    mesh = mesh_lib.build_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    kernel = jax.value_and_grad(loss(dataclasses.replace(cfg, attention_impl="pallas",
                                                         pallas_interpret=True)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.LOGICAL_RULES):
        on_mesh = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
        assert "shard_map" in str(jax.make_jaxpr(kernel)(p, on_mesh))
        got, got_grads = jax.jit(kernel)(p, on_mesh)
    assert abs(float(got) - float(want)) <= TOL * abs(float(want))
    _close_grads(got_grads, want_grads)
