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
- ``image_folder``: ``root/<split>/<class>/*.png|jpg|jpeg``; classes are the sorted union of
  class folder names over all splits (so labels agree between splits); images are decoded
  to RGB with Pillow when read.

A split may carry a slice, as in TFDS: ``test[:8000]``, ``test[8000:]``, ``train[:80%]``
(see ``parse_split``).
"""
from __future__ import annotations

import functools
import gzip
import pathlib
import re
from typing import Any

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_SPLIT_RE = re.compile(r"^(?P<base>[\w\-]+)(\[(?P<start>-?\d*%?):(?P<stop>-?\d*%?)\])?$")
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


# ----------------------------------------------------------------------------- splits


def parse_split(spec: str) -> tuple[str, str, str]:
    """``'test[8000:]'`` -> ``('test', '8000', '')``; ``'train'`` -> ``('train', '', '')``.

    Bounds are kept as text (an int or a percentage) until the split's length is known.
    """
    match = _SPLIT_RE.match(spec.strip())
    if match is None:
        raise ValueError(
            f"split {spec!r} is not understood; write a split name, optionally with a slice, "
            "e.g. 'train', 'test[:8000]', 'test[8000:]' or 'train[:80%]'")
    return match["base"], match["start"] or "", match["stop"] or ""


def _bound(text: str, length: int) -> int | None:
    if not text:
        return None
    if text.endswith("%"):
        return round(int(text[:-1]) * length / 100)
    return int(text)


def split_range(spec: str, length: int) -> range:
    """The example indices selected by a split spec from a split of ``length`` examples."""
    _, start, stop = parse_split(spec)
    return range(length)[slice(_bound(start, length), _bound(stop, length))]


# ----------------------------------------------------------------------------- sources


class ArraySource:
    """In-memory source over ``images`` (N, H, W, C) uint8 and ``labels`` (N,)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, num_classes: int):
        if images.ndim != 4 or images.dtype != np.uint8 or len(images) != len(labels):
            raise ValueError(
                f"expected uint8 images (N, H, W, C) and N labels, got images {images.dtype}"
                f"{images.shape} and labels {labels.shape}")
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
        from PIL import Image  # Pillow is only needed for this source.

        with Image.open(self.files[index]) as image:
            pixels = np.asarray(image.convert("RGB"), np.uint8)
        return {"image": pixels, "label": self.labels[index]}

    def __repr__(self) -> str:
        return f"ImageFolderSource({len(self)} files, {self.num_classes} classes)"


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
    return ArraySource(images[keep], labels[keep], num_classes=10)


# ----------------------------------------------------------------------------- MNIST IDX

MNIST_PREFIX = {"train": "train", "test": "t10k"}
_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049


def mnist_files(root: pathlib.Path, split: str) -> tuple[pathlib.Path, pathlib.Path]:
    prefix = MNIST_PREFIX.get(split, split)
    return (root / f"{prefix}-images-idx3-ubyte.gz", root / f"{prefix}-labels-idx1-ubyte.gz")


def read_idx(path: pathlib.Path, magic: int) -> np.ndarray:
    """One gzipped IDX array of uint8: big-endian int32 magic, dims, then the data."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise ValueError(f"{path}: IDX magic number is {found}, expected {magic}")
    ndim = magic & 0xFF
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
    return ArraySource(images[..., None], labels, num_classes=10)


# ----------------------------------------------------------------------------- CIFAR npz


def npz_source(root: pathlib.Path, split: str) -> ArraySource:
    path = root / f"{split}.npz"
    with np.load(path) as npz:
        missing = {"image", "label"} - set(npz.files)
        if missing:
            raise ValueError(f"{path} lacks keys {sorted(missing)} (has {npz.files}); it needs "
                             "'image' (N, H, W, C) uint8 and 'label' (N,)")
        images, labels = npz["image"], npz["label"]
        num_classes = len(npz["classes"]) if "classes" in npz.files else int(labels.max()) + 1
    if images.ndim == 3:
        images = images[..., None]
    return ArraySource(images, labels, num_classes)


# ----------------------------------------------------------------------------- image folder


def folder_classes(root: pathlib.Path) -> list[str]:
    """Sorted union of ``root/<split>/<class>`` folder names over all splits."""
    return sorted({c.name for s in root.iterdir() if s.is_dir()
                   for c in s.iterdir() if c.is_dir()})


def image_folder_source(root: pathlib.Path, split: str) -> ImageFolderSource:
    classes = folder_classes(root)
    files, labels = [], []
    for label, name in enumerate(classes):
        folder = root / split / name
        found = sorted(f for f in folder.glob("*") if f.suffix.lower() in IMAGE_SUFFIXES) \
            if folder.is_dir() else []
        files += found
        labels += [label] * len(found)
    if not files:
        raise ValueError(f"image folder split {root / split} holds no "
                         f"{'/'.join(IMAGE_SUFFIXES)} files under <class>/ subfolders")
    return ImageFolderSource(files, labels, len(classes))


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
