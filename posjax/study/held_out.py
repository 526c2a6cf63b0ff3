"""The text study's held-out measurement: the same target tokens, with the same masks, scored
inside windows of L, 2L and 4L tokens, for every run; and the unigram and bigram baselines
on exactly those targets.

The held-out documents (``data.test_split``, whole documents spread over the corpus) are
joined into one stream ``d1 [SEP] d2 [SEP] ...`` and cut into cores of C = L − 2 tokens
(core j = stream[j·C, (j + 1)·C)). Draw ``d`` masks core j with
``numpy.random.default_rng([MASK_SEED, d, j])`` as training masks a sequence (15 % of the
non-special tokens; 80 % [MASK], 10 % random, 10 % kept): the masks are the same for every
seed, scheme and window. At factor f the model reads ``[CLS] window [SEP]`` with a window of
f·L − 2 stream tokens around the core (centred, shifted inside the stream at its ends); only
the core's masked tokens are scored, the context outside the core is not masked. Factor 1 is
the ordinary MLM evaluation at the training length. A model whose absolute table has L rows
reads 2L/4L with the table interpolated (``model.extend_positions='interpolate'``).

Baselines, fitted on the training split's tokens (documents joined the same way): unigram and
bigram (the true preceding token, masked or not) cross-entropies of the same targets, each
with its smoothing chosen to minimise that cross-entropy (the strongest baseline of its kind,
so "below the bigram" is a conservative gate).
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from posjax.data import text as text_data
from posjax.data.tokenizers import TextTokenizer, load_tokenizer
from posjax.study.spec import at_length

MASK_SEED = 20_211   # the study's held-out masks (any fixed number; never a run's seed)


def stream(data: ml_collections.ConfigDict, split: str, tokenizer: TextTokenizer) -> np.ndarray:
    """The documents of ``split`` tokenised and joined as ``d1 [SEP] d2 [SEP] ...`` (int32)."""
    sep = np.asarray([tokenizer.special.sep], np.int32)
    parts = []
    for document in text_data.open_documents(data, split):
        parts += [text_data.encode_document(document, tokenizer, data.unk_marker).ids, sep]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def masked_cores(tokens: np.ndarray, length: int, draw: int, spec: text_data.MaskSpec
                 ) -> list[dict[str, np.ndarray]]:
    """Every core of ``length − 2`` tokens of the stream, masked by draw ``draw``."""
    core = length - 2
    out = []
    for j in range(len(tokens) // core):
        ids = tokens[j * core:(j + 1) * core]
        example = {"input_ids": ids, "length": core, "word_starts": np.ones(core, bool)}
        out.append(text_data.mask_example(example, spec, np.random.default_rng(
            [MASK_SEED, draw, j])))
    return out


def window_batch(tokens: np.ndarray, cores: list[dict[str, np.ndarray]], length: int,
                 factor: int, special: Any) -> dict[str, np.ndarray]:
    """(N, factor·L) inputs holding each masked core inside its window, masked slots moved to
    the window's positions."""
    core, width = length - 2, factor * length - 2
    if width > len(tokens):
        raise ValueError(f"the held-out split holds {len(tokens)} tokens, fewer than a window "
                         f"of {width}: widen data.test_split or lower the factors")
    rows, positions = [], []
    for j, masked in enumerate(cores):
        start = min(max(j * core - (width - core) // 2, 0), len(tokens) - width)
        window = tokens[start:start + width].copy()
        offset = j * core - start
        window[offset:offset + core] = masked["input_ids"]
        rows.append(np.concatenate([[special.cls], window, [special.sep]]))
        positions.append(np.where(masked["masked_weights"] > 0,
                                  masked["masked_positions"] + 1 + offset, 0))
    ids = np.stack(rows).astype(np.int32)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids),
            "masked_positions": np.stack(positions).astype(np.int32),
            "masked_ids": np.stack([c["masked_ids"] for c in cores]),
            "masked_weights": np.stack([c["masked_weights"] for c in cores]),
            "mask": np.ones(len(cores), bool)}


def _setup(config: ml_collections.ConfigDict) -> tuple[TextTokenizer, text_data.MaskSpec, int]:
    tokenizer = load_tokenizer(config.data.tokenizer, lowercase=bool(config.data.lowercase))
    return (tokenizer, text_data.mask_spec(config.data, tokenizer),
            int(config.data.max_seq_length))


@functools.lru_cache(maxsize=4)
def _cores_cached(data_json: str, draws: int) -> tuple[np.ndarray, list[list[dict]]]:
    config = ml_collections.ConfigDict({"data": json.loads(data_json)})
    tokenizer, spec, length = _setup(config)
    tokens = stream(config.data, config.data.test_split, tokenizer)
    return tokens, [masked_cores(tokens, length, d, spec) for d in range(draws)]


def _held_out_cores(config: ml_collections.ConfigDict, draws: int
                    ) -> tuple[np.ndarray, list[list[dict]]]:
    """The held-out stream and its masked cores per draw, computed once per data config in a
    grid process (every cell of a study shares them)."""
    return _cores_cached(json.dumps(config.data.to_dict(), sort_keys=True, default=str), draws)


def _padded(rows: np.ndarray, size: int, key: str) -> np.ndarray:
    """``rows`` padded to ``size`` rows (one compiled step for every batch): copies of the
    first row, with no weight on their targets and ``mask`` False."""
    extra = size - len(rows)
    if extra <= 0:
        return rows
    fill = np.zeros_like(rows[:1]) if key in ("masked_weights", "mask") else rows[:1]
    return np.concatenate([rows, np.repeat(fill, extra, axis=0)])


def evaluate(config: ml_collections.ConfigDict, params: Any, factors: list[int], draws: int,
             batch_size: int = 16) -> dict[str, Any]:
    """Held-out MLM metrics of ``params`` at each factor: ``{str(f): {length, loss, accuracy,
    num_predictions, loss_by_draw, extended}}`` (loss: mean cross-entropy over every draw's
    targets)."""
    from posjax.study import runner

    tokenizer, spec, length = _setup(config)
    tokens, cores = _held_out_cores(config, draws)
    out: dict[str, Any] = {}
    for f in factors:
        cfg = at_length(config, f * length)
        task, model = runner.build(cfg)
        model, p = task.for_evaluation(model, params)
        step = jax.jit(lambda p, b: task.eval_outputs(model, p, b))
        losses, correct, counts = [], 0.0, 0.0
        for d in range(draws):
            batch = window_batch(tokens, cores[d], length, f, tokenizer.special)
            loss_sum = n = 0.0
            for i in range(0, len(batch["input_ids"]), batch_size):
                part = {k: jnp.asarray(_padded(v[i:i + batch_size], batch_size, k))
                        for k, v in batch.items()}
                r = jax.device_get(step(p, part))
                loss_sum += float(np.sum(r["loss_sum"]))
                correct += float(np.sum(r["correct"]))
                n += float(np.sum(r["predictions"]))
            losses.append(loss_sum / n)
            counts += n
        out[str(f)] = {"length": f * length, "loss": float(np.mean(losses)),
                       "accuracy": correct / counts, "num_predictions": int(counts),
                       "loss_by_draw": losses, "extended": bool(cfg.model.extend_positions)}
    return out


def _best(scores: dict[float, float]) -> tuple[float, float]:
    smoothing = min(scores, key=scores.get)
    return smoothing, scores[smoothing]


def baselines(config: ml_collections.ConfigDict, draws: int) -> dict[str, Any]:
    """Unigram and bigram cross-entropy (nats) of the held-out targets of ``evaluate``."""
    tokenizer, spec, length = _setup(config)
    train = stream(config.data, config.data.train_split, tokenizer)
    held_out = stream(config.data, config.data.test_split, tokenizer)
    v = tokenizer.vocab_size
    unigram = np.bincount(train, minlength=v).astype(np.float64)
    previous = np.concatenate([[tokenizer.special.sep], train[:-1]])
    bigram = np.zeros((v, v))
    np.add.at(bigram, (previous, train), 1.0)
    targets, contexts = [], []
    for d in range(draws):
        for j, c in enumerate(masked_cores(held_out, length, d, spec)):
            k = int(c["masked_weights"].sum())
            at = j * (length - 2) + c["masked_positions"][:k]
            targets.append(held_out[at])
            contexts.append(np.where(at > 0, held_out[np.maximum(at - 1, 0)],
                                     tokenizer.special.sep))
    y, x = np.concatenate(targets), np.concatenate(contexts)

    def unigram_p(alpha: float) -> np.ndarray:
        return (unigram + alpha) / (unigram.sum() + alpha * v)

    uni = {a: float(-np.mean(np.log(unigram_p(a)[y]))) for a in (0.01, 0.1, 0.5, 1.0)}
    alpha, uni_ce = _best(uni)
    p_uni = unigram_p(alpha)
    rows = bigram.sum(1)

    def bigram_ce(lam: float) -> float:   # Jelinek-Mercer: lam·P(y|x) + (1 − lam)·P(y)
        ml = np.divide(bigram[x, y], rows[x], out=np.zeros(len(y)), where=rows[x] > 0)
        return float(-np.mean(np.log(lam * ml + (1 - lam) * p_uni[y])))

    lam, bi_ce = _best({lam: bigram_ce(lam) for lam in np.round(np.arange(0.5, 1.0, 0.02), 2)})
    return {"unigram": uni_ce, "bigram": bi_ce, "unigram_alpha": alpha,
            "bigram_lambda": float(lam), "num_predictions": int(len(y)),
            "train_tokens": int(len(train)), "held_out_tokens": int(len(held_out)),
            "unigram_perplexity": math.exp(uni_ce), "bigram_perplexity": math.exp(bi_ce)}
