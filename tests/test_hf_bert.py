"""BERT-A against Hugging Face BertForMaskedLM (PyTorch, CPU, random init): same weights, same
hidden states and MLM logits on non-pad tokens within 1e-5."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import TextConfig, TextEncoder, TextForMaskedLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

H, HEADS, LAYERS, MLP, VOCAB, L = 32, 4, 2, 64, 97, 12


def _dense(w, b=None, out_shape=None, in_shape=None):
    """torch Linear (out, in) -> our kernel (in..., out...)."""
    k = w.T
    if in_shape:
        k = k.reshape(in_shape + (k.shape[-1],))
    if out_shape:
        k = k.reshape((k.shape[0],) + out_shape)
    d = {"kernel": k}
    if b is not None:
        d["bias"] = b.reshape(out_shape) if out_shape else b
    return d


def _ln(sd, prefix):
    return {"scale": sd[prefix + ".weight"], "bias": sd[prefix + ".bias"]}


def bert_params(sd):
    d = H // HEADS
    emb = {"word_embeddings": {"embedding": sd["bert.embeddings.word_embeddings.weight"]},
           "position_embeddings": {"embedding": sd["bert.embeddings.position_embeddings.weight"]},
           "token_type_embeddings": {"embedding": sd["bert.embeddings.token_type_embeddings.weight"]},
           "norm": _ln(sd, "bert.embeddings.LayerNorm")}
    layers = {}
    for i in range(LAYERS):
        p = f"bert.encoder.layer.{i}."
        att = {n: _dense(sd[p + f"attention.self.{n}.weight"], sd[p + f"attention.self.{n}.bias"],
                         out_shape=(HEADS, d)) for n in ("query", "key", "value")}
        att["out"] = _dense(sd[p + "attention.output.dense.weight"],
                            sd[p + "attention.output.dense.bias"], in_shape=(HEADS, d))
        layers[f"layer_{i}"] = {
            "attention": att, "attention_norm": _ln(sd, p + "attention.output.LayerNorm"),
            "mlp": {"fc1": _dense(sd[p + "intermediate.dense.weight"], sd[p + "intermediate.dense.bias"]),
                    "fc2": _dense(sd[p + "output.dense.weight"], sd[p + "output.dense.bias"])},
            "mlp_norm": _ln(sd, p + "output.LayerNorm")}
    head = {"dense": _dense(sd["cls.predictions.transform.dense.weight"],
                            sd["cls.predictions.transform.dense.bias"]),
            "norm": _ln(sd, "cls.predictions.transform.LayerNorm"),
            "bias": sd["cls.predictions.bias"]}
    return {"encoder": {"embeddings": emb, "encoder": layers}, "mlm_head": head}


def test_bert_abs_matches_hf_bert():
    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=MLP,
                                     max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    hf = transformers.BertForMaskedLM(hf_cfg).eval()
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (3, L))
    mask = np.ones((3, L), np.int64)
    mask[1, 8:] = 0
    mask[2, 3:] = 0
    types = rng.integers(0, 2, (3, L))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                 token_type_ids=torch.tensor(types), output_hidden_states=True)
    ref_hidden = out.hidden_states[-1].numpy()
    ref_logits = out.logits.numpy()

    cfg = TextConfig(position_scheme="bert_abs", vocab_size=VOCAB, hidden_size=H, num_heads=HEADS,
                     num_layers=LAYERS, mlp_dim=MLP, max_position_embeddings=64)
    model = TextForMaskedLM(cfg)
    init = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, mask)["params"])
    params = bert_params(sd)
    assert jax.tree.structure(init) == jax.tree.structure(params)
    assert jax.tree.map(lambda a: a.shape, init) == jax.tree.map(lambda a: a.shape, params)
    logits = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    hidden = TextEncoder(cfg).apply({"params": params["encoder"]}, jnp.asarray(ids),
                                    jnp.asarray(mask), jnp.asarray(types))
    keep = mask.astype(bool)
    assert np.abs(np.asarray(hidden)[keep] - ref_hidden[keep]).max() <= 1e-5
    assert np.abs(np.asarray(logits)[keep] - ref_logits[keep]).max() <= 1e-5
