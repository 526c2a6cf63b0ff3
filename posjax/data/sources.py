"""Local image sources: random access to ``(image, label)`` examples of one split.

Every source returns, for an index ``i``, a dict ``{'image': uint8 (H, W, C), 'label': int}``
and exposes ``num_classes`` and ``image_shape`` ``(H, W, C)``, where ``H``/``W`` are ``None``
when images in the split differ in size (they are then resized one by one in the pipeline).

Sources and their split names:

- ``digits``: scikit-learn's bundled 8x8 digits (1,797 images, grey levels 0..16, scaled to
  0..255 by ``round(v * 255 / 16)``). Splits ``train``/``test`` are a stratified 80/20 split:
  for each class, its indices are permuted by ``numpy.random.default_rng(0)`` and the first
  ``round(0.2 * n_class)`` go to ``test`` (359 test, 1,438 train).
- ``mnist``: a folder of IDX files ``<prefix>-images-idx3-ubyte.gz`` (magic 2051) and
  ``<prefix>-labels-idx1-ubyte.gz`` (magic 2049); split ``train`` reads prefix ``train``,
  split ``test`` reads prefix ``t10k``.
- ``cifar10``: a folder of ``<split>.npz`` files with keys ``image`` (N, H, W, C) uint8 and
  ``label`` (N,) (optional ``classes``); the split name is the file stem (``train_20k``).
  Every split has the folder's classes: the ``classes`` list, else the largest label of any
  split plus 1.
- ``image_folder``: ``root/<split>/<class>/*.png|jpg|jpeg``; classes are the sorted union of
  class folder names over all splits (so labels agree between splits); images are decoded
  to RGB with Pillow when read (16-bit grey scaled to 8 bits).

Labels must be integers in ``[0, num_classes)``, one per example; a file that cannot be read
is named in a ValueError.

A split may carry a slice, as in TFDS: ``test[:8000]``, ``test[8000:]``, ``train[:80%]``
(see ``parse_split``); as in TFDS, a bound past the split's end is refused. Beyond TFDS, a
slice may take every k-th example: ``test[::5]``, ``test[1000::10]``. Files ordered by class
(``cifar10`` packed from class folders, ``image_folder``) need a step to sample every class:
their ``test[:2000]`` is the first two classes only, and the image pipeline refuses a slice
that drops classes of its split. The MLM text-file pipeline also reads a complement: ``~`` in
front takes every example the slice leaves out (``valid[::20]`` holds out every 20th document,
spread over the corpus; ``~valid[::20]`` is the rest).
"""
from __future__ import annotations

import functools
import gzip
import logging
import pathlib
import re
import zipfile
import zlib
from typing import Any

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_SPLIT_RE = re.compile(r"^(?P<complement>~)?(?P<base>[\w\-]+)"
                       r"(\[(?P<start>(-?\d+%?)?):(?P<stop>(-?\d+%?)?)(:(?P<step>\d*))?\])?$")
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


# ----------------------------------------------------------------------------- splits


def _match_split(spec: str) -> re.Match:
    match = _SPLIT_RE.match(spec.strip())
    if match is None:
        raise ValueError(
            f"split {spec!r} is not understood; write a split name, optionally with a slice, "
            "e.g. 'train', 'test[:8000]', 'test[8000:]', 'train[:80%]' or 'test[::5]'")
    if match["step"] and int(match["step"]) < 1:
        raise ValueError(f"split {spec!r}: the step (after the second ':') must be an integer "
                         ">= 1, e.g. 'test[::5]' for every 5th example")
    return match


def parse_split(spec: str) -> tuple[str, str, str]:
    """``'test[8000:]'`` -> ``('test', '8000', '')``; ``'train'`` -> ``('train', '', '')``.

    Bounds are kept as text (an int or a percentage) until the split's length is known; the
    step, if any, is checked here and read by ``split_range``.
    """
    match = _match_split(spec)
    return match["base"], match["start"] or "", match["stop"] or ""


def is_complement(spec: str) -> bool:
    """``'~train[::20]'``: every example of ``train`` that ``train[::20]`` does not select."""
    return bool(_match_split(spec)["complement"])


def split_step(spec: str) -> int:
    """The slice's step: ``'test[::5]'`` -> 5; 1 without one."""
    return int(_match_split(spec)["step"] or 1)


def without_step(spec: str) -> str:
    """The spec without its step (``'test[:50%:4]'`` -> ``'test[:50%]'``): what TFDS reads."""
    base, start, stop = parse_split(spec)
    return f"{base}[{start}:{stop}]" if start or stop else base


def _bound(text: str, length: int, spec: str) -> int | None:
    if not text:
        return None
    if text.endswith("%"):
        percent = int(text[:-1])
        if not -100 <= percent <= 100:
            raise ValueError(f"split {spec!r}: a percentage bound lies in -100%..100%, not "
                             f"{percent}%")
        return round(percent * length / 100)
    if not -length <= int(text) <= length:   # as TFDS: a bound past the end is refused
        raise ValueError(f"split {spec!r}: bound {int(text)} lies outside the split's {length} "
                         f"examples; give one in -{length}..{length}, or a percentage")
    return int(text)


def split_range(spec: str, length: int) -> range:
    """The example indices selected by a split spec from a split of ``length`` examples."""
    if is_complement(spec):
        raise ValueError(f"split {spec!r}: a complement ('~', every example the slice leaves "
                         "out) is read by the MLM text-file pipeline only; give a slice here")
    _, start, stop = parse_split(spec)
    return range(length)[slice(_bound(start, length, spec), _bound(stop, length, spec),
                               split_step(spec))]


def split_indices(spec: str, length: int) -> np.ndarray:
    """The indices (int64, ascending) a spec selects, a complement (``~``) included."""
    selected = split_range(spec.lstrip().removeprefix("~"), length)
    if not is_complement(spec):
        return np.arange(length)[selected.start:selected.stop:selected.step]
    keep = np.ones(length, bool)
    keep[selected.start:selected.stop:selected.step] = False
    return np.flatnonzero(keep)


# ----------------------------------------------------------------------------- sources


class ArraySource:
    """In-memory source over ``images`` (N, H, W, C) uint8 and ``labels`` (N,) in
    ``[0, num_classes)``, read from ``origin`` (named in errors)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, num_classes: int, origin: str):
        if images.ndim != 4 or images.dtype != np.uint8 or len(images) != len(labels):
            raise ValueError(
                f"{origin}: expected uint8 images (N, H, W, C) and N labels, got images "
                f"{images.dtype}{images.shape} and labels {labels.shape}")
        check_labels(labels, num_classes, origin)
        self.images = images
        self.labels = labels.astype(np.int32)
        self.num_classes = num_classes
        self.image_shape: tuple[int | None, int | None, int] = images.shape[1:]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "label": self.labels[index]}

    def __repr__(self) -> str:
        return f"ArraySource({len(self)} x {self.image_shape}, {self.num_classes} classes)"


class ImageFolderSource:
    """Lazily decoded ``files`` with integer ``labels``; images come out RGB (H, W, 3)."""

    def __init__(self, files: list[pathlib.Path], labels: list[int], num_classes: int):
        self.files = [str(f) for f in files]
        self.labels = np.asarray(labels, np.int32)
        self.num_classes = num_classes
        self.image_shape: tuple[int | None, int | None, int] = (None, None, 3)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": decode_rgb(self.files[index]), "label": self.labels[index]}

    def __repr__(self) -> str:
        return f"ImageFolderSource({len(self)} files, {self.num_classes} classes)"


def check_labels(labels: np.ndarray, num_classes: int, origin: str) -> None:
    """``labels`` must be one integer class index per example, in ``[0, num_classes)``."""
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{origin}: labels must be one integer class index per example, shape "
                         f"(N,); got {labels.dtype}{labels.shape} (for (N, 1) labels, store "
                         "labels.reshape(-1))")
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.size:
        raise ValueError(f"{origin}: {bad.size} label(s) outside 0..{num_classes - 1} (the "
                         f"{num_classes} classes), e.g. {sorted(set(bad[:1000].tolist()))[:5]}; "
                         "fix the labels (or, for an npz folder, its 'classes')")


# Pillow's modes of a 16-bit grey PNG: "I;16*", or "I" (32-bit signed) in older Pillow.
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def decode_rgb(path: str) -> np.ndarray:
    """The image at ``path`` as uint8 RGB (H, W, 3); 16-bit grey is scaled to 8 bits
    (round(v / 257)), not clipped at 255 as Pillow's ``convert('RGB')`` does."""
    from PIL import Image  # Pillow is only needed for image folders.

    try:
        with Image.open(path) as image:
            if image.mode not in _SIXTEEN_BIT_MODES:
                return np.asarray(image.convert("RGB"), np.uint8)
            grey = np.asarray(image).astype(np.int64)
    except (OSError, SyntaxError, ValueError,   # Pillow's ways of saying "not decodable",
            Image.DecompressionBombError) as e:  # and "too large to decode safely"
        raise ValueError(f"{path}: cannot be decoded as an image ({type(e).__name__}: {e}); "
                         "replace or remove the file") from e
    if grey.min(initial=0) < 0 or grey.max(initial=0) > 65535:
        raise ValueError(f"{path}: {image.mode} pixel values span {grey.min()}..{grey.max()}, "
                         "outside 16 bits; store it as 8- or 16-bit PNG")
    grey8 = ((grey * 255 + 32767) // 65535).astype(np.uint8)
    return np.repeat(grey8[..., None], 3, axis=-1)


# ----------------------------------------------------------------------------- digits


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    return images, digits.target.astype(np.int32)


def digits_test_indices(labels: np.ndarray) -> np.ndarray:
    """Stratified test indices: per class, the first round(0.2 n_c) of a seed-0 permutation."""
    rng = np.random.default_rng(DIGITS_SPLIT_SEED)
    test = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        test.append(members[:round(DIGITS_TEST_FRACTION * len(members))])
    return np.sort(np.concatenate(test))


def digits_source(split: str) -> ArraySource:
    """sklearn digits, split ``train`` or ``test`` (stratified 80/20, fixed seed)."""
    images, labels = _digits_arrays()
    in_test = np.zeros(len(labels), bool)
    in_test[digits_test_indices(labels)] = True
    keep = in_test if split == "test" else ~in_test
    return ArraySource(images[keep], labels[keep], num_classes=10, origin="digits")


# ----------------------------------------------------------------------------- MNIST IDX

MNIST_PREFIX = {"train": "train", "test": "t10k"}
_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049


def mnist_files(root: pathlib.Path, split: str) -> tuple[pathlib.Path, pathlib.Path]:
    prefix = MNIST_PREFIX.get(split, split)
    return (root / f"{prefix}-images-idx3-ubyte.gz", root / f"{prefix}-labels-idx1-ubyte.gz")


def read_idx(path: pathlib.Path, magic: int) -> np.ndarray:
    """One gzipped IDX array of uint8: big-endian int32 magic, dims, then the data."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:   # not gzip, cut short, unreadable
        raise ValueError(f"{path}: cannot be read as a gzipped IDX file ({type(e).__name__}: "
                         f"{e}); download it again (gzip it if it is the plain IDX file)") from e
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise ValueError(f"{path}: IDX magic number is {found}, expected {magic}")
    ndim = magic & 0xFF
    if len(data) < 4 + 4 * ndim:
        raise ValueError(f"{path}: {len(data)} bytes, shorter than the IDX header "
                         f"({4 + 4 * ndim}); download it again")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but holds {body.size} bytes")
    return body.reshape(shape)


def mnist_source(root: pathlib.Path, split: str) -> ArraySource:
    images_path, labels_path = mnist_files(root, split)
    images = read_idx(images_path, _IDX_IMAGES_MAGIC)
    labels = read_idx(labels_path, _IDX_LABELS_MAGIC)
    if len(images) != len(labels):
        raise ValueError(f"{images_path} has {len(images)} images but {labels_path} has "
                         f"{len(labels)} labels")
    return ArraySource(images[..., None], labels, num_classes=10, origin=str(labels_path))


# ----------------------------------------------------------------------------- CIFAR npz


def npz_source(root: pathlib.Path, split: str) -> ArraySource:
    """``root/<split>.npz``; its classes are those of the whole folder (``npz_num_classes``)."""
    path = root / f"{split}.npz"
    arrays = read_npz(path, ("image", "label"), required=("image", "label"))
    images = arrays["image"][..., None] if arrays["image"].ndim == 3 else arrays["image"]
    return ArraySource(images, arrays["label"], npz_num_classes(root), origin=str(path))


def read_npz(path: pathlib.Path, keys: tuple[str, ...], required: tuple[str, ...] = ()
             ) -> dict[str, np.ndarray]:
    """Those of the arrays ``keys`` that the npz file ``path`` holds; one ValueError naming
    the file when it cannot be read or lacks one of ``required``."""
    try:
        npz = np.load(path)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError("it holds one array (.npy), not named arrays (.npz)")
        with npz:
            missing = sorted(set(required) - set(npz.files))
            arrays = {} if missing else {k: npz[k] for k in keys if k in npz.files}
            names = list(npz.files)
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as e:
        raise ValueError(f"{path}: cannot be read as an npz file ({type(e).__name__}: {e}); "
                         "write it again with numpy.savez, numeric arrays only") from e
    if missing:
        raise ValueError(f"{path} lacks keys {missing} (has {names}); it needs 'image' "
                         "(N, H, W, C) uint8 and 'label' (N,)")
    return arrays


def npz_num_classes(root: pathlib.Path) -> int:
    """The folder's class count, the same for all its splits (a split may lack some classes):
    the length of its ``classes`` (every file that has one must agree), else the largest
    integer label of any ``<split>.npz`` plus 1. Files without labels (other data kept in the
    folder) do not count."""
    arrays = {p.name: read_npz(p, ("label", "classes")) for p in sorted(root.glob("*.npz"))}
    named = {name: [str(c) for c in a["classes"]] for name, a in arrays.items() if "classes" in a}
    if named:
        lists = list(named.values())
        if any(c != lists[0] for c in lists):
            raise ValueError(f"{root}: its npz files name different 'classes' ("
                             + "; ".join(f"{n}: {len(c)}" for n, c in named.items())
                             + "); give every split the same list")
        return len(lists[0])
    return 1 + max((int(a["label"].max(initial=-1)) for a in arrays.values()
                    if "label" in a and np.issubdtype(a["label"].dtype, np.integer)), default=-1)


# ----------------------------------------------------------------------------- image folder


def folder_classes(root: pathlib.Path) -> list[str]:
    """Sorted union of ``root/<split>/<class>`` folder names over all splits."""
    return sorted({c.name for s in root.iterdir() if s.is_dir()
                   for c in s.iterdir() if c.is_dir()})


def image_folder_source(root: pathlib.Path, split: str) -> ImageFolderSource:
    classes = folder_classes(root)
    files, labels, empty = [], [], []
    for label, name in enumerate(classes):
        folder = root / split / name
        found = sorted(f for f in folder.glob("*") if f.suffix.lower() in IMAGE_SUFFIXES) \
            if folder.is_dir() else []
        files += found
        labels += [label] * len(found)
        if not found:
            empty.append(name)
    if empty and files:
        _warn_missing_classes(root / split, tuple(empty))
    if not files:
        raise ValueError(f"image folder split {root / split} holds no "
                         f"{'/'.join(IMAGE_SUFFIXES)} files under <class>/ subfolders")
    return ImageFolderSource(files, labels, len(classes))


@functools.lru_cache(maxsize=None)   # once per split, not at every evaluation
def _warn_missing_classes(folder: pathlib.Path, classes: tuple[str, ...]) -> None:
    logging.warning("image folder split %s has no images of class(es) %s; the classes are the "
                    "<class> folders of all splits, and the model has an output for each",
                    folder, ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else ""))


# ----------------------------------------------------------------------------- lookup


def local_split_names(name: str, root: pathlib.Path) -> list[str]:
    """The split names a local source offers (what ``validate_data_config`` checks against)."""
    if name == "digits":
        return ["train", "test"]
    if not root.is_dir():
        return []
    if name == "mnist":
        prefixes = {p.name.split("-")[0] for p in root.glob("*-images-idx3-ubyte.gz")}
        splits = {"test" if prefix == "t10k" else prefix for prefix in prefixes}
        return sorted(s for s in splits if all(f.is_file() for f in mnist_files(root, s)))
    if name == "cifar10":
        return sorted(p.stem for p in root.glob("*.npz"))
    if name == "image_folder":
        return sorted(p.name for p in root.iterdir() if p.is_dir())
    raise ValueError(f"unknown local source {name!r}")


def open_local_split(name: str, root: pathlib.Path, split: str):
    """The whole named split (without its slice) of a local source."""
    base, _, _ = parse_split(split)
    if name == "digits":
        return digits_source(base)
    if name == "mnist":
        return mnist_source(root, base)
    if name == "cifar10":
        return npz_source(root, base)
    if name == "image_folder":
        return image_folder_source(root, base)
    raise ValueError(f"unknown local source {name!r}")
