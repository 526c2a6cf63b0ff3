"""init_from's pieces: an unreadable params folder, the summary of what was not loaded
as saved, and position tables resampled or interpolated to the new model."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax.training import init_from_checks
from posjax.training import init_from as init_from_lib


def test_init_from_with_an_empty_params_folder_is_one_error(tmp_path):
    (tmp_path / "params").mkdir()          # a converter folder whose save never happened
    with pytest.raises(ValueError, match=r"^init_from='.*': .*params: cannot read this "
                                         r"checkpoint \(FileNotFoundError: "):
        init_from_checks.check_init_from(tmp_path, {})


def test_init_from_summary_counts_and_shows_the_first_notes():
    notes = [f"['p{i}']: not in the checkpoint, keeps its init (2,)" for i in range(6)]
    notes += ["['pos_embedding']: [CLS] row dropped (this model pools without [CLS]); "
              "resampled grid (4, 4) -> (2, 2)",
              "['encoder']['layers']['fc']: the first 1 of the saved layers (2)",
              "['cls']: in the checkpoint but not in this model, ignored"]
    text = init_from_lib.init_from_summary("/ckpt", notes, shown=3)
    assert text.splitlines() == [
        "init_from /ckpt: 9 parameter(s) not loaded as they are (7 skipped, 2 adapted):",
        *(f"  {n}" for n in notes[:3]), "  ... and 6 more"]


def test_a_hybrid_position_table_is_resampled_from_its_real_grid():
    """A hybrid ViT (ResNet stem, stride 16) on 64 x 256 images with 1 x 1 patches has a 4 x 16
    grid, not image_size / patch_size; its 64 rows are not a square 8 x 8 grid either."""
    from posjax.layers.positions import resample_position_table
    saved_cfg = {"config": {"image_size": [64, 256], "patch_size": 1,
                            "resnet_layers": [1, 1, 1]}}
    table = np.random.default_rng(0).normal(size=(1, 64, 4)).astype(np.float32)
    target = {"pos_embedding": jnp.zeros((1, 8 * 32, 4))}
    replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    merged, notes = init_from_lib.merge_pretrained(target, {"['pos_embedding']": table},
                                               {"pos_embedding": replicated}, saved_cfg, (8, 32))
    assert notes == ["['pos_embedding']: resampled grid (4, 16) -> (8, 32)"]
    np.testing.assert_array_equal(merged["pos_embedding"],
                                  resample_position_table(table, (4, 16), (8, 32),
                                                          num_prefix_tokens=0))


def test_a_text_position_table_is_interpolated_to_more_rows():
    """interpolate_position_rows: prefix rows kept; position rows corner-aligned linear (the
    old first and last rows at the ends, row j at old position j·(R − 1)/(rows − 1))."""
    from posjax.layers.positions import interpolate_position_rows
    table = np.array([[9.0, -9.0], [0.0, 10.0], [1.0, 20.0], [2.0, 40.0]], np.float32)
    out = np.asarray(interpolate_position_rows(table, 5, num_prefix_rows=1))
    np.testing.assert_allclose(out, [[9, -9], [0, 10], [0.5, 15], [1, 20], [1.5, 30],
                                     [2, 40]], rtol=1e-6)
    out = np.asarray(interpolate_position_rows(table[1:], 7))
    np.testing.assert_allclose(out[:, 0], [0, 1 / 3, 2 / 3, 1, 4 / 3, 5 / 3, 2], rtol=1e-6)
    assert out.dtype == np.float32
