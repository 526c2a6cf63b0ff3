"""Shared pieces of the Hugging Face readers/writers: config.json access and activation names."""
from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Mapping, TypeVar

# HF ACT2FN name -> posjax activation ("gelu" is exact erf GELU in both).
ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "relu": "relu", "tanh": "tanh", "linear": "identity"}
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "tanh": "tanh",
             "identity": "linear"}


def config_path(weights: str | pathlib.Path) -> str:
    """The config.json beside a weights file (for error messages)."""
    return str(pathlib.Path(weights).parent / "config.json")


def read_config_json(folder: pathlib.Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json: pass a Hugging Face checkpoint folder "
                         "(config.json + model.safetensors or pytorch_model.bin) or a .npz file")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:   # UnicodeDecodeError and JSONDecodeError included
        raise ValueError(f"{path}: not valid JSON ({e}); the file is damaged or cut short: "
                         "download it again") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: must hold a JSON object (the model's settings), got a "
                         f"{type(cfg).__name__}: download it again")
    return cfg


def check_required_keys(config: Mapping[str, Any], keys: tuple[str, ...],
                        path: str | pathlib.Path) -> None:
    """One ValueError naming each of ``keys`` that ``config`` (a config.json's values) lacks or
    sets to null. They define the model's shape or its attention heads: transformers writes
    them with every model, and its class defaults (a base-size model's) would build another
    model than the weights' (heads: with the same tensor shapes)."""
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        one = len(missing) == 1
        raise ValueError(f"{path}: has no {', '.join(missing)}, which "
                         f"{'defines' if one else 'define'} the model; the file is incomplete "
                         f"or was edited: download it again, or add {'it' if one else 'them'} "
                         "with the values the weights were trained with")


# posjax model-config field -> the config.json key it comes from, where the names differ.
HF_KEYS = {"num_heads": "num_attention_heads", "num_layers": "num_hidden_layers",
           "mlp_dim": "intermediate_size", "dropout_rate": "hidden_dropout_prob",
           "attention_dropout_rate": "attention_probs_dropout_prob"}
ConfigT = TypeVar("ConfigT")


class HFConfig:
    """config.json values with the HF class defaults for keys the file omits."""

    def __init__(self, values: Mapping[str, Any], defaults: Mapping[str, Any], source: str):
        self.values, self.defaults, self.source = dict(values), defaults, source

    def __getitem__(self, key: str) -> Any:
        default = self.defaults.get(key)
        value = self.values.get(key, default)
        if value is None and key in self.defaults:
            return default
        if isinstance(value, str) and isinstance(default, (bool, int, float)):
            kind = "true or false" if isinstance(default, bool) else "a number"
            raise ValueError(f"{self.source}: {key}={value!r} is not valid: must be {kind} "
                             "(a JSON string here)")
        return value

    def build(self, cls: type[ConfigT], **fields: Any) -> ConfigT:
        """``cls(**fields)`` (a posjax model config); its error names this config.json and
        its keys."""
        try:
            return cls(**fields)
        except ValueError as e:
            message = re.sub(r"\b(\w+)=", lambda m: HF_KEYS.get(m[1], m[1]) + "=", str(e))
            raise ValueError(f"{self.source}: {message} (its values contradict each other or "
                             "are out of range: download it again, or correct it from the "
                             "model card)") from None

    def fail(self, key: str, allowed: str) -> ValueError:
        return ValueError(f"{self.source}: {key}={self[key]!r} is not supported: {allowed}")

    def activation(self, key: str) -> str:
        name = self[key]
        if name not in ACT_FROM_HF:
            raise self.fail(key, f"choose one of {', '.join(ACT_FROM_HF)}")
        return ACT_FROM_HF[name]


def activation_to_hf(name: str, field: str) -> str:
    if name not in ACT_TO_HF:
        raise ValueError(f"{field}={name!r} has no Hugging Face equivalent: use one of "
                         f"{', '.join(ACT_TO_HF)}")
    return ACT_TO_HF[name]


def labels_config(num_labels: int) -> dict[str, Any]:
    """HF reads num_labels from id2label."""
    return {"id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
            "label2id": {f"LABEL_{i}": i for i in range(num_labels)}}
