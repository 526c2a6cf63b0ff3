"""Reading and writing named weight tensors as float32 numpy arrays.

Formats: safetensors (read with numpy, no torch), PyTorch ``.bin`` pickles (need torch, imported
only when such a file is given), sharded folders (``*.index.json`` with a ``weight_map``), and
``.npz`` archives. Every failure is one ``ValueError`` naming the file (and tensor).
"""
from __future__ import annotations

import json
import pathlib
import zipfile
from typing import Mapping

import ml_dtypes   # installed with jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _as_float32(name: str, array: np.ndarray, source: pathlib.Path) -> np.ndarray:
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"):
        return np.asarray(array)   # integer buffers (e.g. position_ids) keep their dtype
    out = np.asarray(array, dtype=np.float32)
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{source}: tensor {name!r} contains NaN or Inf values; the file is "
                         "corrupt or was saved from a diverged model")
    return out


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file, as float32 numpy arrays (bf16/fp16 upcast)."""
    out = {}
    try:
        with safe_open(str(path), framework="np") as f:
            names = list(f.keys())
            for name in names:
                try:
                    out[name] = _as_float32(name, f.get_tensor(name), path)
                except SafetensorError as e:
                    raise ValueError(f"{path}: cannot read tensor {name!r} ({e}); the file is "
                                     "truncated or corrupt: download it again") from e
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}); it is truncated or "
                         "corrupt: download it again") from e
    return out


def read_torch_bin(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of a PyTorch ``pytorch_model.bin`` (a pickle: reading it needs torch)."""
    try:
        import torch  # noqa: PLC0415 — only .bin checkpoints need it
    except ImportError as e:
        raise ValueError(
            f"{path}: reading PyTorch .bin checkpoints needs torch, which is not installed. "
            "Install torch (CPU build is enough), or use the folder's model.safetensors "
            "(Hugging Face serves it for most models)") from e
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # torch raises RuntimeError/EOFError/UnpicklingError for bad files
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e}); "
                         "it is truncated or corrupt: download it again") from e
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    out = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{path}: entry {name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        out[name] = _as_float32(name, (t.float() if t.is_floating_point() else t).numpy(), path)
    return out


def read_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` archive (official vit_jax / big_vision checkpoints; numpy
    stores bfloat16 arrays as 2-byte void, read back as bfloat16)."""
    out = {}
    try:
        with np.load(path, allow_pickle=False) as z:
            for name in z.files:
                try:
                    array = z[name]
                    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
                        array = array.view(ml_dtypes.bfloat16)   # numpy saves bf16 as void
                    out[name] = _as_float32(name, array, path)
                except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
                    raise ValueError(f"{path}: cannot read array {name!r} ({e}); the file is "
                                     "truncated or corrupt: download it again") from e
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable .npz archive ({e}); it is truncated or "
                         "corrupt: download it again") from e
    return out


def _read_file(path: pathlib.Path) -> dict[str, np.ndarray]:
    if path.name.endswith(".safetensors"):
        return read_safetensors(path)
    if path.name.endswith(".bin"):
        return read_torch_bin(path)
    raise ValueError(f"{path}: unknown weight file type: expected .safetensors or .bin")


def read_folder_weights(folder: pathlib.Path) -> tuple[dict[str, np.ndarray], pathlib.Path]:
    """Tensors of a Hugging Face checkpoint folder and the file (or index) they came from.

    Prefers safetensors; follows ``*.index.json`` shard maps. Raises when no weight file exists.
    """
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return _read_file(path), path
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a valid shard index (needs a 'weight_map' object: "
                             f"tensor name -> shard file): {e}") from e
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = folder / shard
            if not shard_path.is_file():
                raise ValueError(f"{path}: shard {shard!r} is listed but {shard_path} is missing")
            tensors.update(_read_file(shard_path))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{path}: tensor(s) {missing[:5]} are listed but absent from their "
                             "shards: the download is incomplete")
        return tensors, path
    raise ValueError(f"{folder}: no weights found: expected one of {', '.join(WEIGHT_FILES)}")


def write_safetensors(tensors: Mapping[str, np.ndarray], path: pathlib.Path) -> None:
    """Write float32 tensors (contiguous copies) to ``path``."""
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              str(path), metadata={"format": "pt"})
