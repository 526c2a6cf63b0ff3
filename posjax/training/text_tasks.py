"""Text tasks: masked-LM pretraining (``task='mlm'``) and GLUE fine-tuning (``task='glue'``).

Both build their model from ``config.model`` (TextConfig fields) and read ``config.data``
(``posjax.data.text`` for MLM, ``posjax.data.glue`` for GLUE). The encoder parameters live
under ``params['encoder']`` in both models, so ``config.init_from`` carries a pretrained MLM
encoder into a GLUE model (the MLM head is ignored, pooler and classifier are initialised).

MLM loss (per run, over every real masked slot m of the batch, w_m = masked_weights·mask):

    loss = Σ_m w_m · (−log softmax(z_m)[y_m]) / Σ_m w_m
    accuracy = Σ_m w_m · [argmax z_m = y_m] / Σ_m w_m

and evaluation reports ``loss``, ``accuracy`` and ``perplexity = exp(loss)``.

GLUE loss: softmax cross-entropy over ``num_labels`` classes, or for STS-B (one output) the
squared error (z − y)²; both averaged over real examples (``mask``). Evaluation reports the
task's official metrics (``posjax.data.glue.glue_metrics``) and writes the predictions in the
GLUE submission format (``write_predictions``).
"""
from __future__ import annotations

import functools
import logging
import math
import pathlib
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax.data import glue as glue_data
from posjax.data import text as text_data
from posjax.data.tokenizers import TextTokenizer, load_tokenizer
from posjax.models.config import TextConfig
from posjax.models.text import TextForMaskedLM, TextForSequenceClassification
from posjax.models import flops, position_tables
from posjax.models import params as params_lib
from posjax.training.tasks import Metrics, Task, model_config_from, register_task

Array = jax.Array


def token_cross_entropy(logits: Array, targets: Array) -> Array:
    """−log softmax(z)[y] in fp32: logits (..., V), targets (...) int -> (...)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def text_inputs(batch: Mapping[str, Array]) -> dict[str, Array]:
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "token_type_ids": batch["token_type_ids"]}


def mlm_head_flops(cfg: TextConfig, predictions: int, length: int) -> flops.Flops:
    """Forward FLOPs after the encoder for ``predictions`` masked slots of each sequence:
    dense H->E and tied logits E->V per slot; with EMD two more passes of the last layer for
    the slot queries over ``length`` keys (Q/out projections and MLP on the slots, K/V on all
    tokens, scores and weighted values, ``flops.emd_position_flops``)."""
    h, e, m, t = cfg.hidden_size, cfg.input_embedding_size, predictions, length
    per_sequence = 2.0 * m * h * e + 2.0 * m * e * cfg.vocab_size
    total = flops.Flops(per_example=per_sequence)
    if cfg.use_emd:
        layer = flops.attention_layer_flops(t, h, cfg.mlp_dim, queries=m)
        total += (flops.Flops(per_example=layer) + flops.emd_position_flops(cfg, m, t)).scaled(2)
    return total


class _TextTask(Task):
    """What MLM and GLUE share: the TextConfig and the tokenizer named by the data config."""

    @property
    def model_config(self) -> TextConfig:
        return model_config_from(TextConfig, self.config.model)

    @functools.cached_property
    def tokenizer(self) -> TextTokenizer:
        data = self.config.data
        return load_tokenizer(data.tokenizer, lowercase=bool(data.lowercase))

    def data_identity(self) -> dict[str, Any]:
        """The vocabulary the embedding rows stand for: a tokenizer file rewritten in place
        (another vocabulary under the same path) would silently remap every id."""
        return {"data.tokenizer": self.tokenizer.vocabulary_identity()}

    def init_params(self, model: nn.Module, rng: Array, batch: Mapping[str, Array]) -> Any:
        """Task's, on tokens cut to the absolute table (``position_tables.cut_to_table``)."""
        batch = position_tables.cut_to_table(self.model_config, batch)
        return super().init_params(model, rng, batch)

    def for_evaluation(self, model: nn.Module, params: Any) -> tuple[nn.Module, Any]:
        """Task's: the absolute table extended to the length (``position_tables.extend``)."""
        cfg, params = position_tables.extend(self.model_config, params,
                                             int(self.config.data.max_seq_length))
        return (model if cfg == self.model_config else self.build_model(cfg)), params

    def check_model(self) -> TextConfig:
        """``validate_model``'s checks, and the tokenizer's ids must fit the embedding table."""
        cfg, vocab = self.validate_model(), self.tokenizer
        if vocab.vocab_size > cfg.vocab_size:
            raise ValueError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                             f"{vocab.vocab_size} ids ({vocab.path}): set model.vocab_size "
                             f">= {vocab.vocab_size}")
        return cfg

    def validate_model(self) -> TextConfig:
        """Without the data: data.max_seq_length fits the position table (every scheme with a
        table looks positions up in it); no setting the position scheme does not read
        (``unread_scheme_settings``) and no label_smoothing (the text losses ignore it)."""
        smoothing = self.config.get("label_smoothing", 0.0)
        if smoothing:
            raise ValueError(f"label_smoothing={smoothing!r}: the {self.name} task trains on "
                             "plain cross-entropy and would ignore it; set it to 0")
        cfg = self.model_config
        if unread := params_lib.unread_scheme_settings(cfg):
            field, readers = unread[0]
            raise ValueError(
                f"model.{field}={getattr(cfg, field)!r} has no effect with position_scheme="
                f"{cfg.position_scheme!r} (only {', '.join(readers)} read it): remove the "
                "override, or choose one of those schemes")
        position_tables.check_length(cfg, int(self.config.data.max_seq_length),
                                     "data.max_seq_length")
        return cfg


# ----------------------------------------------------------------------------- MLM


@register_task
class MaskedLanguageModel(_TextTask):
    """Masked-LM pretraining (BERT-A/R, TUPE-A/R, DeBERTa with EMD) on packed, masked text.

    Batch: ``posjax.data.text`` (input_ids, attention_mask, token_type_ids (B, L); masked_*
    (B, M); mask (B,)). Config: ``model`` (TextConfig), ``data`` (MLM data config).
    """

    name = "mlm"

    def validate(self) -> None:
        text_data.validate_mlm_data_config(self.config.data)
        self.check_model()

    def build_model(self, cfg: TextConfig | None = None) -> nn.Module:
        return TextForMaskedLM(cfg or self.model_config)

    def dummy_batch(self, batch_size: int) -> dict[str, np.ndarray]:
        length = int(self.config.data.max_seq_length)
        m = text_data.max_predictions(self.config.data)
        tokens = np.zeros((batch_size, length), np.int32)
        slots = np.zeros((batch_size, m), np.int32)
        return {"input_ids": tokens, "attention_mask": np.ones_like(tokens),
                "token_type_ids": tokens.copy(), "masked_positions": slots,
                "masked_ids": slots.copy(), "masked_weights": np.zeros((batch_size, m), np.float32),
                "mask": np.ones((batch_size,), bool)}

    def model_inputs(self, batch: Mapping[str, Array]) -> dict[str, Array]:
        return {**text_inputs(batch), "masked_positions": batch["masked_positions"]}

    def _per_slot(self, logits: Array, batch: Mapping[str, Array]
                  ) -> tuple[Array, Array, Array]:
        """(cross-entropy, correct, weight), each (B, M)."""
        weight = batch["masked_weights"] * batch["mask"][:, None].astype(jnp.float32)
        ce = token_cross_entropy(logits, batch["masked_ids"])
        correct = (jnp.argmax(logits, -1) == batch["masked_ids"]).astype(jnp.float32)
        return ce, correct, weight

    def train_metrics(self, model: nn.Module, params: Any, batch: Mapping[str, Array],
                      rng: Array) -> Metrics:
        logits = model.apply({"params": params}, **self.model_inputs(batch), train=True,
                             rngs={"dropout": rng})
        ce, correct, weight = self._per_slot(logits, batch)
        count = jnp.sum(weight)
        return {"loss": (jnp.sum(weight * ce), count),
                "accuracy": (jnp.sum(weight * correct), count)}

    def eval_outputs(self, model: nn.Module, params: Any,
                     batch: Mapping[str, Array]) -> dict[str, Array]:
        logits = model.apply({"params": params}, **self.model_inputs(batch), train=False)
        ce, correct, weight = self._per_slot(logits, batch)
        return {"loss_sum": jnp.sum(weight * ce, -1), "correct": jnp.sum(weight * correct, -1),
                "predictions": jnp.sum(weight, -1)}

    def summarize(self, outputs: Mapping[str, np.ndarray]) -> dict[str, float]:
        count = float(np.sum(outputs["predictions"]))
        loss = float(np.sum(outputs["loss_sum"])) / count if count else float("nan")
        return {"loss": loss,
                "accuracy": float(np.sum(outputs["correct"])) / count if count else float("nan"),
                "perplexity": math.exp(loss) if count and loss < 700 else float("inf"),
                "num_sequences": int(outputs["predictions"].shape[0]),
                "num_predictions": int(count)}

    def make_pipeline(self, split: str, batch_size: int, seed: int, train: bool,
                      shard_index: int, shard_count: int) -> text_data.TextPipeline:
        return text_data.make_mlm_pipeline(self.config.data, split=split, batch_size=batch_size,
                                           seed=seed, train=train, shard_index=shard_index,
                                           shard_count=shard_count, tokenizer=self.tokenizer)

    def train_flops(self) -> flops.Flops:
        cfg = self.model_config
        length = int(self.config.data.max_seq_length)
        m = text_data.max_predictions(self.config.data)
        forward = (flops.text_encoder_forward_flops(cfg, length)
                   + mlm_head_flops(cfg, m, length))
        return forward.scaled(flops.TRAIN_FACTOR)


# ----------------------------------------------------------------------------- GLUE


@register_task
class Glue(_TextTask):
    """GLUE fine-tuning: classification (cross-entropy) or STS-B regression (squared error).

    Batch: ``posjax.data.glue`` (input_ids, attention_mask, token_type_ids (B, L); label (B,)
    int32 or float32; idx (B,); mask (B,)). Config: ``model`` (TextConfig), ``data`` (GLUE
    data config; ``data.task`` picks the GLUE task and the number of outputs).
    """

    name = "glue"

    @property
    def glue_task(self) -> glue_data.GlueTask:
        return glue_data.get_task(self.config.data.task)

    def validate(self) -> None:
        glue_data.validate_glue_data_config(self.config.data)
        cfg = self.check_model()
        if cfg.use_emd:
            raise ValueError("model.use_emd=True is an MLM decoder: set it to False for GLUE")

    def build_model(self, cfg: TextConfig | None = None) -> nn.Module:
        return TextForSequenceClassification(cfg or self.model_config,
                                             num_labels=self.glue_task.num_labels)

    def dummy_batch(self, batch_size: int) -> dict[str, np.ndarray]:
        tokens = np.zeros((batch_size, int(self.config.data.max_seq_length)), np.int32)
        label_dtype = np.float32 if self.glue_task.is_regression else np.int32
        return {"input_ids": tokens, "attention_mask": np.ones_like(tokens),
                "token_type_ids": tokens.copy(), "label": np.zeros((batch_size,), label_dtype),
                "idx": np.zeros((batch_size,), np.int32), "mask": np.ones((batch_size,), bool)}

    def model_inputs(self, batch: Mapping[str, Array]) -> dict[str, Array]:
        return text_inputs(batch)

    def _loss(self, logits: Array, labels: Array) -> Array:
        """Per-example loss (B,): cross-entropy, or (z − y)² for regression."""
        if self.glue_task.is_regression:
            return jnp.square(logits[:, 0].astype(jnp.float32) - labels.astype(jnp.float32))
        return token_cross_entropy(logits, labels)

    def _predictions(self, logits: Array) -> Array:
        if self.glue_task.is_regression:
            return logits[:, 0].astype(jnp.float32)
        return jnp.argmax(logits, -1).astype(jnp.int32)

    def train_metrics(self, model: nn.Module, params: Any, batch: Mapping[str, Array],
                      rng: Array) -> Metrics:
        logits = model.apply({"params": params}, **self.model_inputs(batch), train=True,
                             rngs={"dropout": rng})
        weight = batch["mask"].astype(jnp.float32)
        count = jnp.sum(weight)
        metrics = {"loss": (jnp.sum(weight * self._loss(logits, batch["label"])), count)}
        if not self.glue_task.is_regression:
            correct = (self._predictions(logits) == batch["label"]).astype(jnp.float32)
            metrics["accuracy"] = (jnp.sum(weight * correct), count)
        return metrics

    def eval_outputs(self, model: nn.Module, params: Any,
                     batch: Mapping[str, Array]) -> dict[str, Array]:
        logits = model.apply({"params": params}, **self.model_inputs(batch), train=False)
        return {"prediction": self._predictions(logits), "label": batch["label"],
                "idx": batch["idx"], "loss": self._loss(logits, batch["label"])}

    @property
    def labelled(self) -> bool:
        return not glue_data.is_test_split(self.config.data.test_split)

    def summarize(self, outputs: Mapping[str, np.ndarray]) -> dict[str, float]:
        out: dict[str, float] = {"num_examples": int(outputs["prediction"].shape[0])}
        if self.labelled:
            out.update(glue_data.glue_metrics(self.glue_task, outputs["prediction"],
                                              outputs["label"]))
            out["loss"] = float(np.mean(outputs["loss"]))
        return out

    def write_predictions(self, outputs: Mapping[str, np.ndarray],
                          directory: str | pathlib.Path) -> list[pathlib.Path]:
        """The evaluated split's predictions as a GLUE submission file in ``directory``."""
        path = glue_data.write_submission(self.glue_task, self.config.data.test_split,
                                          outputs["idx"], outputs["prediction"], directory)
        logging.info("GLUE predictions written to %s", path)
        return [path]

    def make_pipeline(self, split: str, batch_size: int, seed: int, train: bool,
                      shard_index: int, shard_count: int) -> glue_data.GluePipeline:
        return glue_data.make_glue_pipeline(self.config.data, split=split,
                                            batch_size=batch_size, seed=seed, train=train,
                                            shard_index=shard_index, shard_count=shard_count,
                                            tokenizer=self.tokenizer)

    def train_flops(self) -> flops.Flops:
        cfg = self.model_config
        h = cfg.hidden_size
        head = flops.Flops(per_example=2.0 * h * h + 2.0 * h * self.glue_task.num_labels)
        forward = flops.text_encoder_forward_flops(cfg, int(self.config.data.max_seq_length),
                                                   first_only=True)
        return (forward + head).scaled(flops.TRAIN_FACTOR)
