"""Name-and-layout links between a checkpoint's flat tensors and a posjax parameter tree.

A ``Link`` ties source tensors (Hugging Face / npz names) to posjax parameter paths with a pair
of inverse layout functions, so one table serves import and export. Layout conventions:

- torch ``Linear.weight`` is (out, in) and computes x Wᵀ; a Flax kernel is (in, out):
  kernel = Wᵀ, reshaped to (in, h, d) for per-head projections and (h, d, out) for the output
  projection; biases (h·d,) <-> (h, d).
- LayerNorm ``weight`` <-> ``scale``; ``Embedding.weight`` <-> ``embedding``.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from posjax.models.params import Path, Tree, flatten, unflatten


@dataclasses.dataclass(frozen=True)
class Link:
    """``to_posjax(*source arrays) -> target arrays``; ``to_source`` is its inverse."""

    source: tuple[str, ...]
    target: tuple[Path, ...]
    to_posjax: Callable[..., tuple[np.ndarray, ...]]
    to_source: Callable[..., tuple[np.ndarray, ...]]


def _one(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[..., tuple[np.ndarray, ...]]:
    return lambda x: (fn(x),)


def copy(source: str, target: Path) -> Link:
    """Same layout on both sides."""
    return Link((source,), (target,), _one(np.asarray), _one(np.asarray))


def transposed(source: str, target: Path, axes: tuple[int, ...]) -> Link:
    """target = source.transpose(axes) (convolution kernels)."""
    inverse = tuple(np.argsort(axes))
    return Link((source,), (target,), _one(lambda x: x.transpose(axes)),
                _one(lambda x: x.transpose(inverse)))


def embedding(source: str, target: Path) -> Link:
    return copy(f"{source}.weight", target + ("embedding",))


def layer_norm(source: str, target: Path) -> list[Link]:
    return [copy(f"{source}.weight", target + ("scale",)),
            copy(f"{source}.bias", target + ("bias",))]


def head_bias(source: str, target: Path, heads: int) -> Link:
    """Bias (h·d,) <-> (h, d)."""
    return Link((source,), (target,), _one(lambda b: b.reshape(heads, -1)),
                _one(lambda b: b.reshape(-1)))


def linear(source: str, target: Path, *, heads: int = 0, bias: bool = True) -> list[Link]:
    """torch Linear (out, in) -> kernel (in, out), or (in, h, d) when ``heads``; bias likewise."""
    def kernel(w):
        k = w.T
        return k.reshape(k.shape[0], heads, -1) if heads else k

    def weight(k):
        return k.reshape(k.shape[0], -1).T

    links = [Link((f"{source}.weight",), (target + ("kernel",),), _one(kernel), _one(weight))]
    if bias:
        links.append(head_bias(f"{source}.bias", target + ("bias",), heads) if heads
                     else copy(f"{source}.bias", target + ("bias",)))
    return links


def linear_from_heads(source: str, target: Path, heads: int) -> list[Link]:
    """Output projection: torch (out, h·d) -> kernel (h, d, out); bias unchanged."""
    return [Link((f"{source}.weight",), (target + ("kernel",),),
                 _one(lambda w: w.T.reshape(heads, -1, w.shape[0])),
                 _one(lambda k: k.reshape(-1, k.shape[-1]).T)),
            copy(f"{source}.bias", target + ("bias",))]


def _name(path: Path) -> str:
    return "/".join(path)


def import_tensors(links: Iterable[Link], tensors: Mapping[str, np.ndarray],
                   expected: Mapping[str, Any], source: str | pathlib.Path,
                   ignored: Iterable[str] = (), task: str = "encoder") -> Tree:
    """Build the posjax tree ``expected`` (a tree of arrays/ShapeDtypeStructs) from ``tensors``.

    Every link's source tensors must exist and be floating point, every tensor must be used
    (or listed in ``ignored``) and every produced array must have the expected shape; each
    violation is one ValueError naming ``source`` and the tensor. ``task``: the model built,
    for the advice on unused tensors.
    """
    links = list(links)
    want = flatten(expected)
    needed = {n: link for link in links for n in link.source}
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:8]}"
                         f"{' …' if len(missing) > 8 else ''}; they are needed for posjax "
                         f"parameter {_name(needed[missing[0]].target[0])}. The checkpoint does "
                         "not match its config.json (or is incomplete)")
    unused = sorted(set(tensors) - set(needed) - set(ignored))
    if unused:
        raise ValueError(f"{source}: tensor(s) {unused[:8]}{' …' if len(unused) > 8 else ''} "
                         "have no place in the posjax model built from its config: unknown "
                         "model variant or head" + (" (a head can be dropped with "
                                                    "task='encoder')" if task != "encoder" else ""))
    flat: dict[Path, np.ndarray] = {}
    for link in links:
        arrays = [np.asarray(tensors[n]) for n in link.source]
        for name, a in zip(link.source, arrays):
            if not (np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16"):
                raise ValueError(f"{source}: tensor {name!r} has dtype {a.dtype}, not floating "
                                 "point (a quantized checkpoint?): give the float weights")
        shapes = ", ".join(f"{n!r} of shape {a.shape}" for n, a in zip(link.source, arrays))
        try:
            outs = link.to_posjax(*arrays)
        except (ValueError, IndexError) as e:   # IndexError: fewer dimensions than a layout
            raise ValueError(f"{source}: tensor {shapes} cannot be laid out as posjax "
                             f"{[_name(t) for t in link.target]}: {e}") from e
        for path, out in zip(link.target, outs):
            if path not in want:
                raise ValueError(f"{source}: tensor(s) {list(link.source)} map to posjax "
                                 f"parameter {_name(path)}, which the configured model lacks")
            if tuple(out.shape) != tuple(want[path].shape):
                raise ValueError(
                    f"{source}: tensor {shapes} gives shape {tuple(out.shape)} for posjax "
                    f"parameter {_name(path)}, which needs {tuple(want[path].shape)}: the "
                    "tensor does not match config.json")
            flat[path] = np.ascontiguousarray(out, dtype=np.float32)
    unset = [p for p in want if p not in flat]
    if unset:
        raise ValueError(f"{source}: no tensor provides posjax parameter(s) "
                         f"{[_name(p) for p in unset[:8]]}")
    return unflatten(flat)


def check_tree(params: Mapping[str, Any], expected: Mapping[str, Any], what: str) -> None:
    """Same paths and shapes as ``expected``, else one ValueError naming the first difference."""
    have, want = flatten(params), flatten(expected)
    extra, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    if extra or missing:
        raise ValueError(f"{what}: parameter tree does not match the model config: "
                         f"unexpected {[_name(p) for p in extra[:5]]}, "
                         f"missing {[_name(p) for p in missing[:5]]}")
    for p, v in want.items():
        if tuple(np.shape(have[p])) != tuple(v.shape):
            raise ValueError(f"{what}: parameter {_name(p)} has shape {tuple(np.shape(have[p]))}, "
                             f"the model config needs {tuple(v.shape)}")


def export_tensors(links: Iterable[Link], params: Mapping[str, Any], what: str
                   ) -> dict[str, np.ndarray]:
    """Inverse of ``import_tensors``: flat source-named float32 arrays. Every parameter must be
    covered by a link (else the target format cannot represent the model)."""
    flat = {p: np.asarray(v, dtype=np.float32) for p, v in flatten(params).items()}
    out: dict[str, np.ndarray] = {}
    used: set[Path] = set()
    for link in links:
        missing = [p for p in link.target if p not in flat]
        if missing:
            raise ValueError(f"{what}: parameter {_name(missing[0])} is missing from the tree")
        used.update(link.target)
        for name, arr in zip(link.source, link.to_source(*[flat[p] for p in link.target])):
            out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    left = sorted(set(flat) - used)
    if left:
        raise ValueError(f"{what}: parameter(s) {[_name(p) for p in left[:5]]} have no "
                         "counterpart in the target format")
    return out
