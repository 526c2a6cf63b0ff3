"""The optimizer: learning-rate schedules, weight decay masks, SGD with momentum and
clipping, and the optimizer config's checks."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posjax import config_defaults
from posjax.training import optim


def _opt(**kw):
    return {**config_defaults.default_config().optimizer.to_dict(), **kw}


def test_schedule_warmup_then_cosine_and_linear():
    s = optim.learning_rate_schedule(_opt(learning_rate=1.0, warmup_steps=10,
                                          schedule="cosine", end_learning_rate=0.1), 110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5)
    assert float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)
    assert float(s(110)) == pytest.approx(0.1, abs=1e-6)
    lin = optim.learning_rate_schedule(_opt(learning_rate=2.0, schedule="linear"), 100)
    assert float(lin(50)) == pytest.approx(1.0)


def test_weight_decay_skips_biases_and_norms():
    params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
              "norm": {"scale": jnp.ones(2), "bias": jnp.ones(2)}, "pos_embedding": jnp.ones(3)}
    mask = optim.decay_mask(params)
    assert mask == {"dense": {"kernel": True, "bias": False},
                    "norm": {"scale": False, "bias": False}, "pos_embedding": True}
    tx, _ = optim.make_optimizer(_opt(name="adamw", learning_rate=0.1, weight_decay=0.5,
                                      schedule="constant"), 10)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    assert float(updates["dense"]["kernel"][0, 0]) == pytest.approx(-0.1 * 0.5)
    assert float(updates["dense"]["bias"][0]) == 0.0 and float(updates["norm"]["scale"][0]) == 0


def test_sgd_momentum_and_clipping():
    tx, _ = optim.make_optimizer(_opt(name="sgd", learning_rate=1.0, momentum=0.9,
                                      schedule="constant", grad_clip_norm=1.0), 10)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    grads = {"w": jnp.array([3.0, 4.0])}     # norm 5 -> clipped to norm 1
    u1, state = tx.update(grads, state, params)
    u2, _ = tx.update(grads, state, params)
    np.testing.assert_allclose(u1["w"], [-0.6, -0.8], rtol=1e-6)
    np.testing.assert_allclose(u2["w"], [-0.6 * 1.9, -0.8 * 1.9], rtol=1e-6)


@pytest.mark.parametrize("field,value,match", [
    ("name", "lamb", "optimizer.name='lamb'"),
    ("warmup_steps", 10, "optimizer.warmup_steps=10"),
    ("learning_rate", 0.0, "optimizer.learning_rate=0.0"),
    ("b1", 1.0, r"optimizer.b1=1.0 is not valid: must lie in \[0, 1\)"),
    ("b2", 1.5, r"optimizer.b2=1.5 is not valid: must lie in \[0, 1\)"),
    ("eps", 0.0, "optimizer.eps=0.0 is not valid: must be > 0"),
    ("nesterov", True, "optimizer.nesterov=True is not valid: needs momentum > 0"),
    ("grad_clip_norm", math.nan, "optimizer.grad_clip_norm=nan is not valid: must be a finite"),
    ("weight_decay", math.nan, "optimizer.weight_decay=nan is not valid: must be a finite"),
    ("learning_rate", math.inf, "optimizer.learning_rate=inf is not valid: must be a finite"),
    ("end_learning_rate", math.nan, "optimizer.end_learning_rate=nan is not valid: must be a "),
    ("eps", math.inf, "optimizer.eps=inf is not valid: must be a finite"),
])
def test_bad_optimizer_config(field, value, match):
    name = "sgd" if field == "nesterov" else "adamw"
    with pytest.raises(ValueError, match=match):
        optim.validate(_opt(**{"name": name, "momentum": 0.0, field: value}), 10)
