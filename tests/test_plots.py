"""Attention maps: collected in layer order, rows sum to one over real keys, PNG written;
figures are written atomically."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import TextConfig, TextForMaskedLM, ViT, ViTConfig
from posjax.plots import attention_labels, attention_maps, save_attention_png


def test_text_attention_maps_and_png(tmp_path):
    cfg = TextConfig(position_scheme="deberta_v2", vocab_size=40, hidden_size=16, num_heads=2,
                     num_layers=3, mlp_dim=32, max_position_embeddings=16, use_emd=True,
                     position_buckets=4, max_relative_positions=16, position_biased_input=False)
    model = TextForMaskedLM(cfg)
    ids = jnp.arange(1, 11)[None].repeat(2, 0)
    mask = jnp.ones((2, 10), jnp.int32).at[1, 6:].set(0)
    masked = jnp.array([[1, 2], [3, 4]])
    variables = model.init(jax.random.PRNGKey(0), ids, mask, masked_positions=masked)
    maps = attention_maps(model, variables, ids, mask, masked_positions=masked)
    # 3 encoder layers, then the two EMD passes through the last layer (queries = masked positions).
    assert [m.shape for m in maps] == [(2, 2, 10, 10)] * 3 + [(2, 2, 2, 10)] * 2
    np.testing.assert_allclose(maps[0][1, :, :6].sum(-1), 1.0, rtol=1e-5)
    assert np.all(maps[0][1, :, :, 6:] == 0)   # padded keys get no weight
    labels = attention_labels(model, len(maps))
    assert labels == ["layer 0", "layer 1", "layer 2", "EMD pass 0", "EMD pass 1"]
    png = save_attention_png(maps, tmp_path / "attention.png", example=1, row_labels=labels)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"^example=2 is not in the batch of 2 maps$"):
        save_attention_png(maps, tmp_path / "other.png", example=2)
    with pytest.raises(ValueError, match=r"^tokens has 3 labels for the 10 keys of the maps$"):
        save_attention_png(maps, tmp_path / "other.png", tokens=["a", "b", "c"])
    assert not (tmp_path / "other.png").exists()


def test_vit_attention_maps_in_layer_order():
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_heads=2,
                    num_layers=11, mlp_dim=32, num_classes=3)
    model = ViT(cfg)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 8, 8, 1))
    variables = model.init(jax.random.PRNGKey(0), x)
    maps = attention_maps(model, variables, x)
    assert len(maps) == 11 and maps[0].shape == (1, 2, 5, 5)
    # layer_10 must come last (numeric, not lexicographic, order): compare with a direct run.
    _, state = model.apply(variables, x, mutable=["intermediates"])
    last = state["intermediates"]["encoder"]["layer_10"]
    np.testing.assert_array_equal(maps[-1], np.asarray(last["attention"]["attention_weights"][0]))


def test_map_head_attention_is_labelled():
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_heads=2,
                    num_layers=2, mlp_dim=32, num_classes=3, pooling="map")
    model = ViT(cfg)
    images = jnp.zeros((1, 8, 8, 1))
    maps = attention_maps(model, model.init(jax.random.PRNGKey(0), images), images)
    assert [m.shape for m in maps] == [(1, 2, 4, 4)] * 2 + [(1, 2, 1, 4)]
    assert attention_labels(model, len(maps)) == ["layer 0", "layer 1", "MAP head"]


def test_a_figure_write_cut_short_leaves_the_previous_file(tmp_path, monkeypatch):
    """loss_curve.png is rewritten at the end of every run: a crash mid-write keeps the old
    image (it left a truncated PNG) and no temporary file."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.figure
    import matplotlib.pyplot as plt
    from posjax.plots import save_figure

    path = tmp_path / "loss_curve.png"
    save_figure(plt.figure(), path)
    before = path.read_bytes()
    assert before.startswith(b"\x89PNG")

    def cut_short(self, fname, **kwargs):
        pathlib.Path(fname).write_bytes(before[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut_short)
    with pytest.raises(KeyboardInterrupt):
        save_figure(plt.figure(), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["loss_curve.png"]


def test_the_loss_curve_shows_every_eval_with_its_score(tmp_path):
    """Eval loss on the loss axis, and GLUE's task score (CoLA: the MCC, no accuracy) or else
    accuracy on the other; it plotted only an eval accuracy, so GLUE CoLA/STS-B and MLM
    eval losses were left out."""
    import json

    from posjax.training import metrics

    train = [{"step": s, "split": "train", "loss": 1.0 / s} for s in (1, 2, 3, 4)]
    cola = [{"step": s, "split": "eval", "loss": 0.6, "mcc": 0.1 * s, "score": 0.1 * s}
            for s in (2, 4)]
    assert metrics.curve_series(train + cola) == {
        "train loss": [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25)],
        "eval loss": [(2, 0.6), (4, 0.6)], "eval score": [(2, 0.2), (4, 0.4)]}
    images = [{"step": 4, "split": "eval", "loss": float("nan"), "accuracy": 0.9}]
    assert metrics.curve_series(train + images) == {"train loss": metrics.curve_series(
        train)["train loss"], "eval accuracy": [(4, 0.9)]}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train + cola))
    assert metrics.plot_curves(tmp_path).read_bytes().startswith(b"\x89PNG")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(cola[0]) + "\n")
    assert metrics.plot_curves(tmp_path) is None   # no train loss yet: nothing to draw
