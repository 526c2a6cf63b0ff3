"""Tasks: what a training run optimises, independent of sharding, steps and checkpoints.

A task is a class bound to one run's config (``task = make_task(config)`` picks the class
registered under ``config.task`` and calls ``cls(config)``). Subclass :class:`Task`, decorate it
with ``@register_task``, and implement:

``validate()``, ``validate_model()`` (optional)
    Raise one ``ValueError`` for a bad model/data/task config (naming field, value and fix),
    before anything is compiled or written; ``validate_model`` only the checks that need no
    data files (``python -m posjax.plan``'s; default none). The constructor must not raise.
``build_model() -> nn.Module``
    The Flax module, from ``config.model``.
``dummy_batch(batch_size) -> dict[str, np.ndarray]``
    Zeros with the exact keys, shapes and dtypes the input pipeline yields (used for init and
    for shardings). Every array has the batch as its leading axis.
``model_inputs(batch) -> dict``
    Keyword arguments of ``model.__call__`` (without ``train``) taken from a batch.
``train_metrics(model, params, batch, rng) -> Metrics``
    ``Metrics = {name: (sum, weight)}``, scalars summed over the (micro)batch. It must hold
    ``'loss'``: the train step differentiates the loss sum and divides the gradient by the total
    loss weight over all microbatches, so gradient accumulation is exact for any weighting
    (masked tokens, padded examples). A metric is logged as Σsum / Σweight. ``rng`` feeds
    dropout (``rngs={'dropout': ...}``) and any stochastic augmentation.
``eval_outputs(model, params, batch) -> dict[str, Array]``
    Per-example arrays (leading batch axis) computed with ``train=False``. The evaluator gathers
    them over the whole split, drops padded examples (``batch['mask']`` False) and hands the
    concatenation (numpy) to ``summarize``.
``summarize(outputs) -> dict[str, float]``
    Eval metrics over the whole split (accuracy, Matthews correlation, Spearman, ...).
``write_predictions(outputs, directory)`` (optional)
    Write the gathered ``eval_outputs`` of an evaluation as files in ``directory`` (eval.py
    passes ``<workdir>/predictions/step_<N>``); returns their paths. Default: nothing.
``data_identity() -> dict[str, dict]`` (optional)
    ``{config key: identity}`` of what gives the data its meaning beyond that key's value, a
    path (a text task's vocabulary: which token each id is, ``posjax.data.identity``). A run
    records it at its start; resuming or evaluating the run with other content under the same
    path is refused. Default: {}.
``for_evaluation(model, params) -> (model, params)`` (optional)
    The model and params that evaluate a checkpoint eval.py restored into ``build_model``'s
    layout. Default: the same. Text tasks evaluated beyond their absolute position table with
    ``model.extend_positions`` extend the table (``text_tasks._TextTask.for_evaluation``).
``patch_grid`` (optional property)
    The model's patch grid (rows, cols) when it runs on images, else None (the default).
    ``init_from`` resamples pretrained position tables of another grid to it.
``make_pipeline(split, batch_size, seed, train, shard_index, shard_count)``
    The input pipeline: an object with ``.iterator`` (checkpointable grain iterator yielding
    numpy batches of ``batch_size`` examples for this process; train: infinite; eval: one pass
    with the last batch padded, ``mask`` False), ``.dataset`` (the grain IterDataset behind it:
    ``iter(dataset)`` is a fresh pass, as a closable grain iterator; training evaluates the
    test split that way, opened once), ``.num_examples`` and ``.num_batches`` (eval: batches
    per process, for the progress line's ETA; None or absent: unknown). Train: the state is
    one global position, equal on every shard (``checkpointing.input_position``).
``train_flops() -> flops.Flops``
    Analytic forward+backward model FLOPs (for MFU), see ``posjax.models.flops``: per
    example, plus the per-step work on shared position tables; a step of B examples costs
    ``.total(B)``.

Text tasks live in their own module listed in ``TASK_MODULES``; it is imported the first time
``make_task`` is asked for a name not registered yet.
"""
from __future__ import annotations

import abc
import importlib
import pathlib
import re
from typing import Any, ClassVar, Mapping, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax.models.config import ViTConfig
from posjax.models.vit import ViT
from posjax.models import flops

Array = jax.Array
Metrics = dict[str, tuple[Array, Array]]
ConfigT = TypeVar("ConfigT")

# Modules that call register_task(...) at import; imported lazily by get_task.
TASK_MODULES: tuple[str, ...] = ("posjax.training.text_tasks",)


class Task(abc.ABC):
    """A run's task, bound to its config (see the module docstring for each method's contract)."""

    name: ClassVar[str]

    def __init__(self, config: Any):
        self.config = config

    @abc.abstractmethod
    def validate(self) -> None: ...

    def validate_model(self) -> Any:
        return None

    @abc.abstractmethod
    def build_model(self) -> nn.Module: ...

    @abc.abstractmethod
    def dummy_batch(self, batch_size: int) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def model_inputs(self, batch: Mapping[str, Array]) -> dict[str, Array]: ...

    @abc.abstractmethod
    def train_metrics(self, model: nn.Module, params: Any, batch: Mapping[str, Array],
                      rng: Array) -> Metrics: ...

    @abc.abstractmethod
    def eval_outputs(self, model: nn.Module, params: Any,
                     batch: Mapping[str, Array]) -> dict[str, Array]: ...

    @abc.abstractmethod
    def summarize(self, outputs: Mapping[str, np.ndarray]) -> dict[str, float]: ...

    def write_predictions(self, outputs: Mapping[str, np.ndarray],
                          directory: pathlib.Path) -> list[pathlib.Path]:
        return []

    def data_identity(self) -> dict[str, Any]:
        return {}

    def for_evaluation(self, model: nn.Module, params: Any) -> tuple[nn.Module, Any]:
        return model, params

    @property
    def patch_grid(self) -> tuple[int, int] | None:
        return None

    @abc.abstractmethod
    def make_pipeline(self, split: str, batch_size: int, seed: int, train: bool,
                      shard_index: int, shard_count: int) -> Any:
        """This shard's batches of ``split`` ('train' or 'test'): ``.iterator``, ``.dataset``,
        ``.num_examples`` (module docstring)."""

    @abc.abstractmethod
    def train_flops(self) -> flops.Flops: ...

    def init_params(self, model: nn.Module, rng: Array, batch: Mapping[str, Array]) -> Any:
        """Freshly initialised ``params`` collection (boxed with logical axis names)."""
        params_rng, dropout_rng = jax.random.split(rng)
        variables = model.init({"params": params_rng, "dropout": dropout_rng},
                               **self.model_inputs(batch), train=False)
        return variables["params"]


_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make ``cls`` selectable as ``config.task = cls.name``."""
    other = _TASKS.get(cls.name)
    if other is not None and other.__qualname__ != cls.__qualname__:
        raise ValueError(f"task name {cls.name!r} is already registered by {other.__qualname__}")
    _TASKS[cls.name] = cls
    return cls


def make_task(config: Any) -> Task:
    """The task ``config.task`` names, bound to ``config`` (not yet validated)."""
    name = config.get("task", None)
    if name not in _TASKS:
        for module in TASK_MODULES:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
    if name not in _TASKS:
        raise ValueError(f"config.task={name!r} is not a registered task: choose one of "
                         f"{sorted(_TASKS)}")
    return _TASKS[name](config)


def soft_cross_entropy(logits: Array, targets: Array) -> Array:
    """−Σ_c t_c log softmax(z)_c per example: (B, C), (B, C) -> (B,), in fp32."""
    return -jnp.sum(targets * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def smooth_labels(targets: Array, smoothing: float) -> Array:
    """Label smoothing of (soft) targets (B, C): (1 − ε)·t + ε/C."""
    return targets * (1.0 - smoothing) + smoothing / targets.shape[-1]


@register_task
class ImageClassification(Task):
    """ViT on images: softmax cross-entropy with optional label smoothing, and accuracy.

    Batch: ``image`` float32 (B, H, W, C), ``label`` int32 (B,), ``mask`` bool (B,) (False for
    padding), and with ``data.mixup_alpha > 0`` (mixup is done by the input pipeline)
    ``label_soft`` float32 (B, classes), the mixed one-hot targets. Config keys: ``model``
    (ViTConfig fields), ``data`` (posjax.data), ``label_smoothing`` (ε, default 0).
    """

    name = "image_classification"

    @property
    def model_config(self) -> ViTConfig:
        return model_config_from(ViTConfig, self.config.model)

    @property
    def patch_grid(self) -> tuple[int, int]:
        return self.model_config.grid_size

    @property
    def label_smoothing(self) -> float:
        return float(self.config.get("label_smoothing", 0.0))

    @property
    def mixup(self) -> bool:
        return float(self.config.data.get("mixup_alpha", 0.0)) > 0

    def validate(self) -> None:
        from posjax.data import validate_data_config
        self.validate_model()
        validate_data_config(self.config.data)

    def validate_model(self) -> ViTConfig:
        cfg = self.model_config
        if cfg.num_classes < 1:
            raise ValueError(f"model.num_classes={cfg.num_classes} is not valid for "
                             "image_classification: set it to the number of classes")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={self.label_smoothing} is not valid: "
                             "must lie in [0, 1)")
        size = self.config.data.get("image_size", None)
        if size is not None:
            pair = (size, size) if isinstance(size, int) else tuple(size)
            if pair != cfg.image_size:
                raise ValueError(f"data.image_size={size} differs from model.image_size="
                                 f"{cfg.image_size}: set both to the same size")
        return cfg

    def build_model(self) -> nn.Module:
        return ViT(self.model_config)

    def dummy_batch(self, batch_size: int) -> dict[str, np.ndarray]:
        cfg = self.model_config
        batch = {"image": np.zeros((batch_size, *cfg.image_size, cfg.num_channels), np.float32),
                 "label": np.zeros((batch_size,), np.int32),
                 "mask": np.ones((batch_size,), bool)}
        if self.mixup:
            batch["label_soft"] = np.zeros((batch_size, cfg.num_classes), np.float32)
        return batch

    def model_inputs(self, batch: Mapping[str, Array]) -> dict[str, Array]:
        return {"images": batch["image"]}

    def train_metrics(self, model: nn.Module, params: Any, batch: Mapping[str, Array],
                      rng: Array) -> Metrics:
        targets = batch.get("label_soft")
        if targets is None:
            targets = jax.nn.one_hot(batch["label"], model.cfg.num_classes)
        logits = model.apply({"params": params}, batch["image"], train=True,
                             rngs={"dropout": rng})
        weight = batch["mask"].astype(jnp.float32)
        # Against the dominant class of the (mixed) targets: the label itself without mixup.
        correct = (jnp.argmax(logits, -1) == jnp.argmax(targets, -1)).astype(jnp.float32)
        targets = smooth_labels(targets, self.label_smoothing)
        count = jnp.sum(weight)
        return {"loss": (jnp.sum(weight * soft_cross_entropy(logits, targets)), count),
                "accuracy": (jnp.sum(weight * correct), count)}

    def eval_outputs(self, model: nn.Module, params: Any,
                     batch: Mapping[str, Array]) -> dict[str, Array]:
        logits = model.apply({"params": params}, batch["image"], train=False)
        targets = jax.nn.one_hot(batch["label"], logits.shape[-1])
        return {"correct": jnp.argmax(logits, -1) == batch["label"],
                "loss": soft_cross_entropy(logits, targets)}

    def summarize(self, outputs: Mapping[str, np.ndarray]) -> dict[str, float]:
        return {"accuracy": float(np.mean(outputs["correct"])),
                "loss": float(np.mean(outputs["loss"])),
                "num_examples": int(outputs["correct"].shape[0])}

    def make_pipeline(self, split: str, batch_size: int, seed: int, train: bool,
                      shard_index: int, shard_count: int) -> Any:
        from posjax.data import make_image_pipeline
        pipeline = make_image_pipeline(self.config.data, split=split, batch_size=batch_size,
                                       seed=seed, train=train, shard_index=shard_index,
                                       shard_count=shard_count)
        # The dataset's classes and image channels must be the model's (validate: the size).
        cfg, data = self.model_config, self.config.data.get("name", "the dataset")
        classes, channels = pipeline.num_classes, pipeline.image_shape[2]
        if classes != cfg.num_classes:
            raise ValueError(f"model.num_classes={cfg.num_classes} but {data} has {classes} "
                             f"classes: set --config.model.num_classes={classes}")
        if channels != cfg.num_channels:
            raise ValueError(f"model.num_channels={cfg.num_channels} but {data} images have "
                             f"{channels} channel{'s' if channels != 1 else ''}: set "
                             f"--config.model.num_channels={channels}")
        return pipeline

    def train_flops(self) -> flops.Flops:
        return flops.vit_train_flops(self.model_config)


def model_config_from(cls: type[ConfigT], model: Any) -> ConfigT:
    """``cls.from_dict(config.model)``; a field its ValueError names is given as
    ``model.<field>``, the key to override (``--config.model.<field>=...``)."""
    try:
        return cls.from_dict(model.to_dict() if hasattr(model, "to_dict") else dict(model))
    except ValueError as e:
        message = str(e)
        raise ValueError(f"model.{message}" if re.match(r"\w+=", message) else message) \
            from None
