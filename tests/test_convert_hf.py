"""Hugging Face parity: random-init transformers models written with save_pretrained, imported by
posjax.convert, must reproduce HF hidden states and head outputs (fp32, max abs diff <= 1e-5 on
non-pad tokens); exported folders must load in transformers and reproduce posjax's outputs."""
from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from posjax.convert import export_hf, load_pretrained  # noqa: E402
from posjax.convert.mapping import check_tree, flatten  # noqa: E402
from posjax.convert.pretrained import Pretrained, expected_params  # noqa: E402
from posjax.layers.positions import resample_position_table  # noqa: E402
from posjax.models.config import TextConfig  # noqa: E402
from posjax.models.text import TextEncoder  # noqa: E402

ATOL = 1e-5
LENGTHS = (11, 7, 4)   # right-padded batch of 3, L = 11
SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def randomize(model: "torch.nn.Module", seed: int) -> None:
    """Every parameter ~ N(0, 0.2) (LayerNorm weights around 1), so no bias or scale is trivially
    zero/one and every mapping mistake shows up in the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(noise + 1.0 if "LayerNorm.weight" in name or "layernorm" in name
                    and name.endswith("weight") else noise)
    model.eval()


def text_batch(vocab: int, type_vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = (np.arange(LENGTHS[0])[None] < np.array(LENGTHS)[:, None]).astype(np.int64)
    ids = rng.integers(1, vocab, mask.shape) * mask
    types = (rng.integers(0, max(type_vocab, 1), mask.shape) * mask)
    return ids, mask, types


def hf_text_outputs(model, ids, mask, types):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    token_type_ids=torch.tensor(types), output_hidden_states=True)
    return out


def ours_text(pre: Pretrained, ids, mask, types, positions=None):
    """(every layer's output (num_layers, B, L, H), head output or None), in one compilation."""
    encoder_params = pre.params if pre.task == "encoder" else pre.params["encoder"]

    @jax.jit
    def run(params, encoder_params):
        layers = TextEncoder(pre.config).apply({"params": encoder_params}, ids, mask, types,
                                               method=TextEncoder.hidden_states)[0]
        if pre.task == "encoder":
            return layers, None
        extra = (positions,) if positions is not None else ()
        return layers, pre.module().apply({"params": params}, ids, mask, types, *extra)

    layers, head = run(pre.params, encoder_params)
    return np.stack(layers), head


def assert_close(ours, theirs, mask=None, what=""):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    if mask is not None:   # compare real tokens only (HF also masks padded queries differently)
        keep = np.broadcast_to(mask.astype(bool)[..., None], ours.shape[:-1] + (1,))[..., 0]
        ours, theirs = ours[keep], theirs[keep]
    diff = float(np.max(np.abs(ours - theirs)))
    assert diff <= ATOL, f"{what}: max abs diff {diff:.2e} > {ATOL}"


def check_structure(pre: Pretrained) -> None:
    """The loader returns exactly the tree (and shapes) of nn.meta.unbox(module.init(...))."""
    want = expected_params(pre.kind, pre.task, pre.config, pre.num_labels)
    assert jax.tree.structure(pre.params) == jax.tree.structure(want)
    check_tree(pre.params, want, "import")
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32
               for v in jax.tree.leaves(pre.params))


def last_layer_with_query(layer, h_kv, query, ext, rel_pos, rel):
    """One HF DeBERTa layer with queries from ``query`` and keys/values from ``h_kv`` (residual =
    query), as the official EnhancedMaskDecoder calls it. HF's v1 ``query_states`` branch only
    accepts 2-D inputs, so for v1 the fused in_proj output is spliced: per head [q, k, v] with q
    from ``query``."""
    att = layer.attention.self
    if hasattr(att, "in_proj"):
        heads = att.num_attention_heads
        q_fused = att.in_proj(query).unflatten(-1, (heads, 3, -1))

        def splice(_module, _inputs, kv):   # forward hook: replace each head's q block
            kv = kv.unflatten(-1, (heads, 3, -1)).clone()
            kv[..., 0, :] = q_fused[..., 0, :]
            return kv.flatten(-3)

        hook = att.in_proj.register_forward_hook(splice)
        try:
            context = att(h_kv, ext, relative_pos=rel_pos, rel_embeddings=rel)[0]
        finally:
            hook.remove()
    else:
        context = att(h_kv, ext, query_states=query, relative_pos=rel_pos, rel_embeddings=rel)[0]
    hidden = layer.attention.output(context, query)
    return layer.output(layer.intermediate(hidden), hidden)


def emd_reference(model, hf_out, mask, table):
    """The official EnhancedMaskDecoder on HF modules: the last layer twice, keys/values H_{L-1},
    first query H_{L-1} + P_abs, then the LM head on the result (B, L, V)."""
    enc = model.deberta.encoder
    h_prev = hf_out.hidden_states[-2]
    ext = enc.get_attention_mask(torch.tensor(mask))
    rel, rel_pos = enc.get_rel_embedding(), enc.get_rel_pos(h_prev)
    query = h_prev + torch.tensor(table[: h_prev.shape[1]])[None]
    with torch.no_grad():
        for _ in range(2):
            query = last_layer_with_query(enc.layer[-1], h_prev, query, ext, rel_pos, rel)
        return model.lm_predictions(query, model.deberta.embeddings.word_embeddings)


TEXT_CASES = {
    # v1: c2p + p2c, MLM (official head names), absolute table only for EMD, token types.
    "v1_mlm_both_emd": ("DebertaForMaskedLM", dict(
        model_type="deberta", pos_att_type="c2p|p2c", max_relative_positions=16,
        position_biased_input=False, type_vocab_size=2, legacy=False), True),
    # v1: c2p only, classification, absolute positions on the input, gelu pooler.
    "v1_cls_c2p": ("DebertaForSequenceClassification", dict(
        model_type="deberta", pos_att_type="c2p", max_relative_positions=16,
        position_biased_input=True, max_position_embeddings=24, num_labels=3), False),
    # v1: p2c only, span 4 < L (clamping), legacy MLM head.
    "v1_mlm_p2c_legacy": ("DebertaForMaskedLM", dict(
        model_type="deberta", pos_att_type="p2c", max_relative_positions=4,
        position_biased_input=False, legacy=True), False),
    # v2: share_att_key, log buckets, LayerNorm'd table, conv layer, encoder only.
    "v2_model_share_buckets_norm_conv": ("DebertaV2Model", dict(
        model_type="deberta-v2", pos_att_type="p2c|c2p", share_att_key=True,
        position_buckets=8, max_relative_positions=32, norm_rel_ebd="layer_norm",
        conv_kernel_size=3, conv_act="gelu", position_biased_input=False), False),
    # v2: separate position projections, no buckets, span 6 < L, biased input, regression.
    "v2_cls_noshare_nobuckets": ("DebertaV2ForSequenceClassification", dict(
        model_type="deberta-v2", pos_att_type="c2p|p2c", share_att_key=False,
        max_relative_positions=6, position_biased_input=True, max_position_embeddings=16,
        num_labels=1, pooler_hidden_act="tanh", type_vocab_size=2), False),
    # v2: embedding_size != hidden (embed_proj), grouped conv k=5, c2p only, legacy MLM head.
    "v2_mlm_legacy_embproj_groups": ("DebertaV2ForMaskedLM", dict(
        model_type="deberta-v2", pos_att_type="c2p", share_att_key=False, position_buckets=6,
        max_relative_positions=20, embedding_size=16, conv_kernel_size=5, conv_groups=2,
        norm_rel_ebd="layer_norm", position_biased_input=False, legacy=True), False),
    # v3-like: share_att_key + buckets + norm, official MLM head with the EMD table.
    "v3_mlm_emd": ("DebertaV2ForMaskedLM", dict(
        model_type="deberta-v2", pos_att_type="p2c|c2p", share_att_key=True, position_buckets=8,
        max_relative_positions=32, norm_rel_ebd="layer_norm", position_biased_input=False,
        legacy=False), True),
}


def make_hf_text(arch: str, kw: dict, seed: int):
    kw = dict(kw)
    model_type = kw.pop("model_type")
    config_cls = transformers.DebertaConfig if model_type == "deberta" else \
        transformers.DebertaV2Config
    config = config_cls(relative_attention=True, **SMALL, **kw)
    model = getattr(transformers, arch)(config)
    randomize(model, seed)
    return model


@pytest.mark.parametrize("case", sorted(TEXT_CASES))
def test_deberta_parity_and_round_trip(case, tmp_path):
    arch, kw, emd = TEXT_CASES[case]
    model = make_hf_text(arch, kw, seed=len(case))
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    table = None
    if emd:   # official MLM checkpoints keep the absolute table although the input ignores it
        tensors = load_file(folder / "model.safetensors")
        table = np.random.default_rng(1).normal(0, 0.5, (24, 32)).astype(np.float32)
        tensors["deberta.embeddings.position_embeddings.weight"] = table
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    pre = load_pretrained(folder)
    check_structure(pre)
    assert pre.config.use_emd == emd
    cfg = model.config
    ids, mask, types = text_batch(cfg.vocab_size, cfg.type_vocab_size)
    hf_out = hf_text_outputs(model, ids, mask, types)
    positions = np.array([[1, 5, 9], [0, 3, 6], [1, 2, 3]]) if emd else None
    ours, logits = ours_text(pre, ids, mask, types, positions)
    for i, hs in enumerate(hf_out.hidden_states[1:]):
        assert_close(ours[i], hs.numpy(), mask, f"{case} layer {i} hidden states")
    if emd:
        ref = emd_reference(model, hf_out, mask, table).numpy()
        ref = np.take_along_axis(ref, positions[..., None], axis=1)
        assert_close(logits, ref, None, f"{case} EMD logits")
    elif pre.task == "mlm":
        assert_close(logits, hf_out.logits.numpy(), mask, f"{case} MLM logits")
    elif pre.task == "classification":
        assert_close(logits, hf_out.logits.numpy(), None, f"{case} classification logits")

    # Round trip posjax -> HF -> posjax: identical params, and transformers reproduces HF.
    out = export_hf(pre, tmp_path / "export")
    again = load_pretrained(out)
    assert again.config == pre.config and again.task == pre.task
    jax.tree.map(np.testing.assert_array_equal, again.params, pre.params)
    arch_out = json.loads((out / "config.json").read_text())["architectures"][0]
    reloaded = getattr(transformers, arch_out).from_pretrained(out).eval()
    re_out = hf_text_outputs(reloaded, ids, mask, types)
    assert_close(re_out.last_hidden_state if pre.task == "encoder" else
                 re_out.hidden_states[-1].numpy(), hf_out.hidden_states[-1].numpy(), mask,
                 f"{case} exported hidden states")
    if pre.task != "encoder":
        assert_close(re_out.logits.numpy(), hf_out.logits.numpy(), mask if pre.task == "mlm"
                     else None, f"{case} exported logits")


VIT_CASES = {
    "cls_32_p8": ("ViTForImageClassification", dict(image_size=32, patch_size=8, num_labels=5)),
    "model_pooler_nonsquare_p4_noqkvbias": ("ViTModel", dict(
        image_size=[24, 16], patch_size=4, qkv_bias=False, hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6, pooler_output_size=24, num_channels=2)),
    "cls_48_p16": ("ViTForImageClassification", dict(image_size=48, patch_size=16,
                                                     num_labels=2)),
}


def hf_vit(arch: str, kw: dict, seed: int):
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=48, **kw)
    model = getattr(transformers, arch)(config)
    randomize(model, seed)
    return model


def ours_vit(pre: Pretrained, images: np.ndarray):
    """(output, final LayerNorm states (B, N+1, H))."""
    out, state = jax.jit(lambda params: pre.module().apply(
        {"params": params}, images,
        capture_intermediates=lambda mdl, _: mdl.name == "encoder_norm",
        mutable=["intermediates"]))(pre.params)
    return np.asarray(out), np.asarray(state["intermediates"]["encoder_norm"]["__call__"][0])


@pytest.mark.parametrize("case", sorted(VIT_CASES))
def test_vit_parity_and_round_trip(case, tmp_path):
    arch, kw = VIT_CASES[case]
    model = hf_vit(arch, kw, seed=len(case))
    model.save_pretrained(tmp_path / "hf")
    pre = load_pretrained(tmp_path / "hf")
    check_structure(pre)
    cfg = model.config
    h, w = (cfg.image_size, cfg.image_size) if isinstance(cfg.image_size, int) else cfg.image_size
    images = np.random.default_rng(0).normal(size=(2, cfg.num_channels, h, w)).astype(np.float32)
    with torch.no_grad():
        hf_out = model(pixel_values=torch.tensor(images), output_hidden_states=True)
    out, states = ours_vit(pre, images.transpose(0, 2, 3, 1))
    if arch == "ViTModel":
        assert_close(states, hf_out.last_hidden_state.numpy(), None, f"{case} hidden states")
        assert_close(out, hf_out.pooler_output.numpy(), None, f"{case} pooler")
    else:
        assert_close(out, hf_out.logits.numpy(), None, f"{case} logits")

    exported = export_hf(pre, tmp_path / "export")
    again = load_pretrained(exported)
    assert again.config == pre.config
    jax.tree.map(np.testing.assert_array_equal, again.params, pre.params)
    reloaded = getattr(transformers, arch).from_pretrained(exported).eval()
    with torch.no_grad():
        re_out = reloaded(pixel_values=torch.tensor(images))
    key = "logits" if arch != "ViTModel" else "pooler_output"
    assert_close(getattr(re_out, key).numpy(), out, None, f"{case} exported {key}")


@pytest.mark.parametrize("old,new", [((4, 4), (6, 6)), ((6, 6), (4, 4)), ((14, 14), (24, 24)),
                                     ((3, 5), (7, 2)), ((1, 4), (3, 4))])
def test_bicubic_resampling_equals_torch_interpolate(old, new):
    """'bicubic' is torch's F.interpolate(bicubic, align_corners=False), up and down."""
    table = np.random.default_rng(4).normal(size=(1, 1 + old[0] * old[1], 8)).astype(np.float32)
    out = np.asarray(resample_position_table(table, old, new, method="bicubic"))
    grid = torch.tensor(table[0, 1:].reshape(1, *old, 8)).permute(0, 3, 1, 2)
    want = torch.nn.functional.interpolate(grid, size=new, mode="bicubic", align_corners=False)
    np.testing.assert_array_equal(out[:, 0], table[:, 0])
    np.testing.assert_allclose(out[0, 1:], want.permute(0, 2, 3, 1).reshape(-1, 8).numpy(),
                               atol=1e-5, rtol=0)


def test_vit_at_new_resolution_matches_interpolate_pos_encoding(tmp_path):
    """load_pretrained(HF folder, image_size=48) of a 32 px model gives HF's logits at 48 px
    with interpolate_pos_encoding=True (its default resample is HF's bicubic)."""
    model = hf_vit("ViTForImageClassification", dict(image_size=32, patch_size=8, num_labels=3),
                   seed=6)
    model.save_pretrained(tmp_path / "hf")
    images = np.random.default_rng(1).normal(size=(2, 3, 48, 48)).astype(np.float32)
    with torch.no_grad():
        want = model(pixel_values=torch.tensor(images), interpolate_pos_encoding=True).logits
    pre = load_pretrained(tmp_path / "hf", image_size=48)
    out, _ = ours_vit(pre, images.transpose(0, 2, 3, 1))
    assert_close(out, want.numpy(), None, "logits at 48 px")


def random_params(tree, seed: int):
    """Replace every leaf by N(0, 0.2) noise (so zero-init heads and unit scales are exercised)."""
    leaves, treedef = jax.tree.flatten(tree)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [rng.normal(0, 0.2, x.shape).astype(np.float32)
                                        for x in leaves])


@pytest.mark.parametrize("scheme,task", [("deberta", "classification"), ("deberta_v2", "mlm")])
def test_posjax_native_model_served_by_transformers(scheme, task, tmp_path):
    """A model initialised (as if fine-tuned) in posjax, exported, gives the same logits in
    transformers. Its absolute table is unused (no biased input, no EMD), so the export leaves
    it out and the re-import has max_position_embeddings=0 (and, for MLM, still no EMD)."""
    cfg = TextConfig(position_scheme=scheme, vocab_size=50, hidden_size=32, num_heads=4,
                     num_layers=2, mlp_dim=40, max_position_embeddings=64, type_vocab_size=2,
                     position_biased_input=False, max_relative_positions=16,
                     position_buckets=8 if scheme == "deberta_v2" else 0,
                     norm_rel_ebd=scheme == "deberta_v2", layer_norm_eps=1e-7,
                     dropout_rate=0.0, attention_dropout_rate=0.0, pooler_act="gelu")
    labels = 4 if task == "classification" else 0
    params = random_params(nn.meta.unbox(expected_params("text", task, cfg, labels)), 3)
    pre = Pretrained(cfg, params, "text", task)
    ids, mask, types = text_batch(50, 2, seed=5)
    _, ours = ours_text(pre, ids, mask, types)
    folder = export_hf(pre, tmp_path / "hf")
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(folder).eval()
    assert_close(hf_text_outputs(model, ids, mask, types).logits.numpy(), ours,
                 mask if task == "mlm" else None, f"{scheme} exported {task}")
    again = load_pretrained(folder)
    assert again.config == dataclasses.replace(cfg, max_position_embeddings=0)
    base = again.params["encoder"]["embeddings"]
    assert "position_embeddings" not in base


def test_pytorch_bin_checkpoint(tmp_path):
    """pytorch_model.bin folders (older hub checkpoints) load like safetensors ones."""
    model = make_hf_text("DebertaV2Model", dict(model_type="deberta-v2", pos_att_type="c2p|p2c",
                                                position_buckets=8, max_relative_positions=32,
                                                position_biased_input=False), seed=9)
    model.save_pretrained(tmp_path / "st")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    a, b = load_pretrained(tmp_path / "st"), load_pretrained(tmp_path / "bin")
    assert a.config == b.config
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    assert flatten(a.params)  # non-empty


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_safetensors(dtype, tmp_path):
    """fp16/bf16 checkpoints (common on the hub) load as the float32 of their stored values."""
    import ml_dtypes
    half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    model = hf_vit("ViTModel", dict(image_size=16, patch_size=8), seed=2)
    model.save_pretrained(tmp_path / "f32")
    tensors = load_file(tmp_path / "f32" / "model.safetensors")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text(
        (tmp_path / "f32" / "config.json").read_text())
    save_file({k: v.astype(half) for k, v in tensors.items()},
              tmp_path / "half" / "model.safetensors")
    full, low = load_pretrained(tmp_path / "f32"), load_pretrained(tmp_path / "half")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.astype(half).astype(np.float32), b),
                 full.params, low.params)
