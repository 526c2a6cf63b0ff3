"""TFDS image datasets read as array_record, without TensorFlow.

Reading: ``tfds.data_source(name, split=..., data_dir=...)`` opens a prepared array_record
dataset for random access; TFDS decodes its PNG/JPEG images with OpenCV or Pillow, so no
TensorFlow is imported. The dataset must already be prepared in ``data_dir`` with
``file_format='array_record'`` (``tfds.load``/tf.data and tfrecord files need TensorFlow and
cannot be read here). Catalog builders such as ``cifar10`` or ``imagenet2012`` encode numpy
images with ``tf.image.encode_png`` while preparing, so prepare those on a machine with
TensorFlow (``tfds build cifar10 --file_format=array_record --data_dir=DIR``) and copy DIR.

Writing without TensorFlow: ``ImageArrays`` is a ``GeneratorBasedBuilder`` that stores uint8
image arrays as array_record. It hands TFDS Pillow images, which TFDS encodes to PNG with
Pillow, avoiding the TensorFlow encoder that numpy inputs would go through.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import tensorflow_datasets as tfds

PREPARE_HINT = ("prepare it as array_record first, e.g. `tfds build {name} "
                "--file_format=array_record --data_dir={data_dir}` on a machine with TensorFlow")


class TfdsImageSource:
    """Random access to a TFDS split: index -> {'image': uint8 (H, W, C), 'label': int32}."""

    def __init__(self, name: str, split: str, data_dir: str = ""):
        self.data_source = tfds.data_source(name, split=split, data_dir=data_dir or None)
        features = self.data_source.dataset_info.features
        self.num_classes = int(features["label"].num_classes)
        self.image_shape: tuple[int | None, int | None, int] = tuple(features["image"].shape)

    def __len__(self) -> int:
        return len(self.data_source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.data_source[index]
        return {"image": np.asarray(record["image"], np.uint8),
                "label": np.int32(record["label"])}

    def __repr__(self) -> str:
        return f"TfdsImageSource({self.data_source!r})"


def tfds_source(name: str, split: str, data_dir: str = "") -> TfdsImageSource:
    """The prepared array_record split ``split`` (TFDS slicing allowed) of dataset ``name``."""
    return TfdsImageSource(name, split, data_dir)


def problems(name: str, data_dir: str, splits: Mapping[str, str]) -> list[str]:
    """What stops ``tfds_source`` from reading ``name``: missing, unprepared, wrong format,
    features or splits; one 'data.field=value: fix' line each (empty when readable)."""
    if not name:
        return ["data.tfds_name='': name the TFDS catalog dataset, e.g. "
                "--config.data.tfds_name=cifar10"]
    hint = PREPARE_HINT.format(name=name, data_dir=data_dir or "~/tensorflow_datasets")
    try:
        builder = tfds.builder(name, data_dir=data_dir or None)
    except Exception as e:  # noqa: BLE001 - TFDS raises several types for "not there"
        return [f"data.tfds_name={name!r} (data_dir={data_dir!r}): not found "
                f"({type(e).__name__}); {hint}"]
    if not builder.is_prepared():
        return [f"data.tfds_name={name!r}: not prepared in data.data_dir={data_dir!r}; {hint}"]
    info = builder.info
    if info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
        return [f"data.tfds_name={name!r}: prepared as {info.file_format.value}, which needs "
                f"TensorFlow to read; {hint}"]
    features = info.features
    if "image" not in features or "label" not in features or not isinstance(
            features["label"], tfds.features.ClassLabel):
        return [f"data.tfds_name={name!r}: needs features 'image' and 'label' (ClassLabel), "
                f"has {list(features)}"]
    out = []
    for field, spec in splits.items():
        try:
            info.splits[spec]
        except (KeyError, ValueError, AssertionError) as e:
            out.append(f"data.{field}={spec!r}: not a split of {name} ({e}); it offers "
                       f"{sorted(info.splits)}")
    return out


class ImageArrays(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Stores in-memory uint8 images (N, H, W, C) and labels per split as a TFDS dataset.

    ``ImageArrays(splits={'train': (images, labels), ...}, num_classes=k, data_dir=DIR,
    file_format='array_record').download_and_prepare()``; read back with
    ``tfds.data_source('image_arrays', split='train', data_dir=DIR)`` in any process.
    """

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, splits: Mapping[str, tuple[np.ndarray, np.ndarray]],
                 num_classes: int, **kwargs: Any):
        shapes = {images.shape[1:] for images, _ in splits.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 3:
            raise ValueError(f"every split needs uint8 images (N, H, W, C) of one shape, got "
                             f"{sorted(map(str, shapes))}")
        self._splits = splits
        self._num_classes = num_classes
        self._image_shape = next(iter(shapes))
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="uint8 image arrays with integer labels, stored as PNG",
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=self._image_shape),
                "label": tfds.features.ClassLabel(num_classes=self._num_classes)}),
            supervised_keys=("image", "label"),
            disable_shuffling=True)  # keep array order: record i is arrays[i]

    def _split_generators(self, dl_manager):
        del dl_manager
        return {name: self._generate_examples(images, labels)
                for name, (images, labels) in self._splits.items()}

    def _generate_examples(self, images: np.ndarray, labels: np.ndarray):
        from PIL import Image

        for index, (image, label) in enumerate(zip(images, labels)):
            pixels = image[..., 0] if image.shape[-1] == 1 else image
            yield index, {"image": Image.fromarray(np.asarray(pixels, np.uint8)),
                          "label": int(label)}
