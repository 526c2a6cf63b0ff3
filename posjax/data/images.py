"""Image classification input: Grain pipelines with ViT preprocessing, deterministic per seed.

Configuration (``default_data_config(name)`` returns every key; ``validate_data_config``
checks them before anything is opened, compiled or written):

==================== ========================================================================
key                  meaning
==================== ========================================================================
name                 ``digits`` (scikit-learn's bundled 8x8 digits, no files needed),
                     ``mnist`` (IDX .gz folder), ``cifar10`` (folder of ``<split>.npz``),
                     ``image_folder`` (``root/<split>/<class>/*.png|jpg``) or ``tfds``
                     (a TFDS catalog dataset prepared as array_record; no TensorFlow)
path                 folder of the local files (unused for ``digits`` and ``tfds``)
tfds_name            TFDS catalog name, e.g. ``cifar10``, ``imagenet2012`` (``tfds`` only)
data_dir             TFDS data dir ('' = TFDS default ``~/tensorflow_datasets``)
train_split          split used for ``split='train'``; a name with an optional slice in TFDS
                     syntax, plus a step: ``train``, ``test[:8000]``, ``train[:80%]``,
                     ``test[::5]``; a slice that drops classes of the split is refused
test_split           split used for ``split='test'``
image_size           side S of the square output images (S, S, C); resized bilinearly
random_resized_crop  train only: crop a random box of area fraction in ``crop_scale`` and
                     aspect ratio (w/h, log-uniform) in ``crop_ratio``, resized to S x S
                     (Inception-style; 10 tries, else the whole image)
crop_scale           (min, max) area fraction of the random crop, within (0, 1]
crop_ratio           (min, max) aspect ratio w/h of the random crop
flip                 train only: mirror left-right with probability 1/2
mixup_alpha          train only: 0 = off; else one lam ~ Beta(a, a) per global batch and
                     each pair of rows (2k, 2k+1) of the global batch is mixed,
                     x_2k = lam x_2k + (1 - lam) x_2k+1 and x_2k+1 = lam x_2k+1 + (1 - lam) x_2k;
                     the batch then also has ``label_soft`` float32 (b, num_classes) = the same
                     mix of one-hot labels (``label`` keeps the unmixed integer label). With
                     several processes the per-process batch must be even (pairs stay local)
mean, std            per-channel (or one shared) normalisation of pixels scaled to [0, 1]:
                     x = (pixel / 255 - mean) / std
worker_count         Grain worker processes (0 = read in the main process); batches do not
                     depend on it, the saved iterator state does: a run resumes with the
                     worker_count it started with
==================== ========================================================================

Batches are dicts ``{'image': float32 (b, S, S, C), 'label': int32 (b,), 'mask': bool (b,)}``.

Training: one GLOBAL stream of examples, independent of how many processes read it. Position g
of the stream is example ``perm_e[g mod N]`` of the N selected examples, with ``perm_e`` Grain's
permutation for (seed, epoch e = g div N). Global batch t is positions [t·B, (t+1)·B) (B =
``batch_size · shard_count``); shard ``i`` of ``n`` yields rows [i·b, (i+1)·b) of every global
batch (b = ``batch_size``), so the global batch at step t is the same bit for bit for any number
of processes. Each example's augmentation RNG is ``numpy.random.default_rng([seed, 0, g])``
and mixup's of global batch t is ``default_rng([seed, 1, t])``: batches depend only on the seed
and the global batch size, never on ``shard_count`` or ``worker_count``. The iterator is a
Grain index over a random-access dataset, so its state is checkpointable.

Evaluation: one pass over the split, no augmentation; shard ``i`` reads examples ``i, i+n,
i+2n, ...`` and pads its last batch with ``mask=False`` examples so every shard yields the same
number of full batches.

Resampling convention: output pixel centre ``i + 1/2`` of S maps to source coordinate
``y0 + (i + 1/2) h / S - 1/2`` inside the box (y0, x0, h, w) (half-pixel centres, as in
``jax.image.resize``), bilinear, edges clamped, no antialiasing.

Worker processes (``worker_count > 0``) are spawned, so the calling script needs an
``if __name__ == '__main__':`` guard (absl.app.run scripts have one); call
``pipe.iterator.close()`` to stop them when done (Grain stops them at exit at the latest).
They ignore SIGTERM and SIGINT while the main process lives, which decides when they end
(``common.input_worker_init``); inside ``common.signals_to_receiver_thread`` (train.py, eval.py)
they are shielded from their first instruction, before that runs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
from typing import Any

import grain
import ml_collections
import numpy as np
from absl import flags

from posjax import config_defaults
from posjax.data import sources
from posjax.data.common import (check_pipeline_call, eval_batches_per_shard, input_worker_init,
                                key_problems, pad_to_full_batches, prepare_input_workers)

NAMES = ("digits", "mnist", "cifar10", "image_folder", "tfds")
LOCAL_WITH_PATH = ("mnist", "cifar10", "image_folder")
_CROP_TRIES = 10

Example = dict[str, Any]


# ----------------------------------------------------------------------------- config


def default_data_config(name: str = "digits") -> ml_collections.ConfigDict:
    """Every data key with the defaults for ``name`` (``config_defaults.image_data_config``)."""
    if name not in NAMES:
        raise ValueError(f"data name {name!r} is unknown; choose one of {', '.join(NAMES)}")
    return config_defaults.image_data_config(name)


def _problems(cfg: ml_collections.ConfigDict) -> list[str]:
    """Every problem with ``cfg`` as 'field=value: fix' lines (empty when valid)."""
    out = key_problems(cfg, default_data_config("digits"),
                       "posjax.data.default_data_config(name)")
    if out:
        return out

    def check(ok: bool, field: str, fix: str) -> None:
        if not ok:
            out.append(f"data.{field}={cfg[field]!r}: {fix}")

    def is_pair(v: Any) -> bool:
        return (isinstance(v, (tuple, list)) and len(v) == 2
                and all(isinstance(x, (int, float)) for x in v))

    check(cfg.name in NAMES, "name", f"choose one of {', '.join(NAMES)}")
    check(isinstance(cfg.image_size, int) and cfg.image_size > 0, "image_size",
          "must be a positive integer")
    check(is_pair(cfg.crop_scale) and 0 < cfg.crop_scale[0] <= cfg.crop_scale[1] <= 1,
          "crop_scale", "must be (min, max) with 0 < min <= max <= 1")
    check(is_pair(cfg.crop_ratio) and 0 < cfg.crop_ratio[0] <= cfg.crop_ratio[1],
          "crop_ratio", "must be (min, max) with 0 < min <= max")
    check(isinstance(cfg.mixup_alpha, (int, float)) and cfg.mixup_alpha >= 0, "mixup_alpha",
          "must be >= 0 (0 turns mixup off)")
    check(isinstance(cfg.worker_count, int) and cfg.worker_count >= 0, "worker_count",
          "must be an integer >= 0 (0 = no worker processes)")
    for field in ("mean", "std"):
        v = cfg[field]
        check(isinstance(v, (tuple, list)) and len(v) in (1, 3)
              and all(isinstance(x, (int, float)) for x in v), field,
              "must be a tuple of 1 (shared) or 3 (per channel) numbers")
    check(all(isinstance(x, (int, float)) and x > 0 for x in cfg.std), "std",
          "every entry must be > 0")
    for field in ("train_split", "test_split"):
        try:
            sources.parse_split(cfg[field])
        except (ValueError, AttributeError) as e:
            out.append(f"data.{field}={cfg[field]!r}: {e}")
    if out or cfg.name not in NAMES:
        return out
    if cfg.name == "tfds":
        from posjax.data import tfds_sources

        return tfds_sources.problems(
            cfg.tfds_name, cfg.data_dir,
            {f: sources.without_step(cfg[f]) for f in ("train_split", "test_split")})
    if cfg.name in LOCAL_WITH_PATH:
        root = pathlib.Path(cfg.path).expanduser() if cfg.path else None
        if root is None or not root.is_dir():
            return [f"data.path={cfg.path!r}: {cfg.name} needs the folder holding its files; "
                    "set --config.data.path=/path/to/folder"]
    root = pathlib.Path(cfg.path).expanduser()
    names = sources.local_split_names(cfg.name, root)
    for field in ("train_split", "test_split"):
        base, _, _ = sources.parse_split(cfg[field])
        missing = [p.name for p in sources.mnist_files(root, base) if not p.is_file()] \
            if cfg.name == "mnist" else []
        check(base in names, field, f"no such split in {cfg.path or cfg.name}"
              + (f" (no {' or '.join(missing)})" if missing else "")
              + f"; it offers {names or 'no splits (wrong folder?)'}")
    return out


def validate_data_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises one ValueError listing every problem (field, value, fix); checks files exist."""
    problems = _problems(cfg)
    if problems:
        raise ValueError("bad data config:\n  " + "\n  ".join(problems))


def open_split(cfg: ml_collections.ConfigDict, split: str):
    """The random-access source of one split spec, and the example range the spec selects."""
    if cfg.name == "tfds":
        from posjax.data import tfds_sources

        source = tfds_sources.tfds_source(cfg.tfds_name, sources.without_step(split),
                                          cfg.data_dir)
        return source, range(len(source))[::sources.split_step(split)]
    source = sources.open_local_split(cfg.name, pathlib.Path(cfg.path).expanduser(), split)
    return source, sources.split_range(split, len(source))


def check_classes_kept(source, selected: range, *, name: str, spec: str) -> None:
    """Raises one ValueError when the slice ``selected`` of a split drops some of its classes.

    Local files are often ordered by class (CIFAR-10 packed from class folders, image
    folders), so ``test[:2000]`` may be two classes of ten: accuracy on it says little about
    the model. Sources without a label array (TFDS, whose splits are shuffled) are not checked.
    """
    labels = getattr(source, "labels", None)
    if labels is None or len(selected) in (0, len(labels)):
        return
    present = np.unique(labels)
    kept = np.unique(labels[selected.start:selected.stop:selected.step])
    dropped = np.setdiff1d(present, kept)
    if dropped.size:
        base, _, _ = sources.parse_split(spec)
        step = max(1, len(labels) // len(selected))
        raise ValueError(
            f"{name}={spec!r} holds examples of {kept.size} of the {present.size} "
            f"classes of split {base!r} (none of {dropped.tolist()[:10]}"
            f"{'...' if dropped.size > 10 else ''}): its examples are grouped by class, so a "
            f"contiguous slice drops classes; take every k-th example instead, e.g. "
            f"'{base}[::{step}]' ({len(range(len(labels))[::step])} examples), or the whole "
            "split")


# ----------------------------------------------------------------------------- preprocessing


def sample_crop_box(rng: np.random.Generator, height: int, width: int,
                    scale: tuple[float, float], ratio: tuple[float, float]) -> np.ndarray:
    """Inception-style box (y0, x0, h, w) in pixels, float32 (4,).

    Area fraction ~ U(scale), aspect ratio w/h ~ exp U(log ratio); the first of 10 candidates
    that fits the image wins, placed uniformly; if none fits, the whole image.
    """
    u = rng.random(2 * _CROP_TRIES + 2).tolist()
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for i in range(_CROP_TRIES):
        area = height * width * (scale[0] + (scale[1] - scale[0]) * u[2 * i])
        aspect = math.exp(log_lo + (log_hi - log_lo) * u[2 * i + 1])
        h, w = math.sqrt(area / aspect), math.sqrt(area * aspect)
        if h <= height and w <= width:
            return np.array([u[-2] * (height - h), u[-1] * (width - w), h, w], np.float32)
    return full_box(height, width)


def full_box(height: int, width: int) -> np.ndarray:
    """The box (y0, x0, h, w) covering the whole image."""
    return np.array([0, 0, height, width], np.float32)


def train_view(example: Example, rng: np.random.Generator, *, crop: bool, flip: bool,
               scale: tuple[float, float], ratio: tuple[float, float]) -> Example:
    """Adds 'box' (4,) and 'flip' drawn from the example's own RNG, and mask=True."""
    height, width = example["image"].shape[:2]
    box = sample_crop_box(rng, height, width, scale, ratio) if crop else full_box(height, width)
    return {**example, "mask": np.bool_(True), "box": box,
            "flip": np.bool_(flip and rng.random() < 0.5)}


def full_view(example: Example, *, real: bool = True) -> Example:
    """Adds the identity view (whole image, not flipped) and 'mask' = ``real``."""
    height, width = example["image"].shape[:2]
    return {**example, "mask": np.bool_(real), "box": full_box(height, width),
            "flip": np.bool_(False)}


def bilinear_taps(start: np.ndarray, length: np.ndarray, extent: int,
                  size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Taps along one axis for boxes [start, start + length) of (b,) resampled to ``size``.

    Output i reads coordinate c = start + (i + 1/2) length / size - 1/2 clamped to
    [0, extent - 1]: lower index floor(c), upper index (clamped), upper weight c - floor(c);
    each (b, size).
    """
    t = (np.arange(size, dtype=np.float32) + 0.5) / size
    coord = np.clip(start[:, None] + t * length[:, None] - 0.5, 0, extent - 1)
    floor = np.floor(coord)
    lower = floor.astype(np.int32)
    return lower, np.minimum(lower + 1, extent - 1), (coord - floor).astype(np.float32)


def resample(images: np.ndarray, boxes: np.ndarray, flips: np.ndarray, size: int) -> np.ndarray:
    """Bilinear crop-and-resize of a batch: (b, H, W, C) -> float32 (b, S, S, C).

    ``boxes`` (b, 4) = (y0, x0, h, w) in source pixels; ``flips`` (b,) mirrors left-right.
    Separable: interpolate whole source rows first, then columns (row gathers are fast).
    """
    height, width = images.shape[1:3]
    y_lo, y_hi, wy = bilinear_taps(boxes[:, 0], boxes[:, 2], height, size)
    x_lo, x_hi, wx = bilinear_taps(boxes[:, 1], boxes[:, 3], width, size)
    mirror = flips[:, None]
    x_lo, x_hi, wx = (np.where(mirror, a[:, ::-1], a) for a in (x_lo, x_hi, wx))
    batch = np.arange(len(images))[:, None]
    top = images[batch, y_lo].astype(np.float32)                   # (b, S, W, C)
    rows = (top + wy[:, :, None, None] * (images[batch, y_hi] - top)).transpose(0, 2, 1, 3)
    left = rows[batch, x_lo]                                       # (b, S_x, S_y, C)
    out = left + wx[:, :, None, None] * (rows[batch, x_hi] - left)
    return out.transpose(0, 2, 1, 3)


def resample_example(example: Example, *, size: int) -> Example:
    """``resample`` for one example of any size (sources whose images differ in size)."""
    image = resample(example["image"][None], example["box"][None], example["flip"][None], size)
    return {**example, "image": image[0]}


def resample_batch(batch: Example, *, size: int) -> Example:
    """``resample`` over a batch whose images share one size (vectorised)."""
    return {**batch, "image": resample(batch["image"], batch["box"], batch["flip"], size)}


def finish_batch(batch: Example, *, mean: np.ndarray, std: np.ndarray) -> Example:
    """float32 x = (pixel / 255 - mean) / std; keeps only image, label, mask."""
    image = (batch["image"].astype(np.float32) * np.float32(1 / 255) - mean) / std
    return {"image": image, "label": batch["label"].astype(np.int32),
            "mask": batch["mask"].astype(bool)}


def pair_partners(size: int) -> np.ndarray:
    """Row 2k <-> 2k+1 (an odd last row is its own partner): int (size,)."""
    partners = np.arange(size) ^ 1
    return np.where(partners < size, partners, np.arange(size))


def mixup(batch: Example, rng: np.random.Generator, *, alpha: float,
          num_classes: int) -> Example:
    """lam ~ Beta(alpha, alpha); image and one-hot label mixed with the partner row (2k <-> 2k+1).

    Pairs never straddle two processes' rows when each process holds an even number of rows.
    """
    lam = np.float32(rng.beta(alpha, alpha))
    partner = pair_partners(len(batch["label"]))
    onehot = np.eye(num_classes, dtype=np.float32)[batch["label"]]
    return {**batch, "image": lam * batch["image"] + (1 - lam) * batch["image"][partner],
            "label_soft": lam * onehot + (1 - lam) * onehot[partner]}


def example_rng(seed: int, stream: int, index: int) -> np.random.Generator:
    """The RNG of item ``index`` of a random stream (0: example views, 1: mixup batches)."""
    return np.random.default_rng([seed, stream, index])


def indexed_train_view(position: int, example: Example, *, seed: int, **view) -> Example:
    """``train_view`` with the RNG of global stream position ``position``."""
    return train_view(example, example_rng(seed, 0, position), **view)


def indexed_mixup(batch_index: int, batch: Example, *, seed: int, **options) -> Example:
    """``mixup`` with the RNG of global batch ``batch_index``."""
    return mixup(batch, example_rng(seed, 1, batch_index), **options)


# ----------------------------------------------------------------------------- pipeline


@dataclasses.dataclass(frozen=True)
class ImagePipeline:
    """A ready iterator plus what the model needs to know about the data.

    ``dataset``: the Grain IterDataset (``iter(dataset)`` starts a fresh pass);
    ``num_examples``: examples in the (sliced) split over all shards;
    ``num_batches``: eval batches per shard (equal on every shard); None for training.
    """
    iterator: grain.DatasetIterator
    dataset: grain.IterDataset
    num_examples: int
    num_classes: int
    image_shape: tuple[int, int, int]
    num_batches: int | None


def make_image_pipeline(cfg: ml_collections.ConfigDict, *, split: str, batch_size: int,
                        seed: int, train: bool, shard_index: int = 0,
                        shard_count: int = 1) -> ImagePipeline:
    """The Grain pipeline of ``cfg.train_split`` or ``cfg.test_split`` for one shard.

    ``batch_size`` is this shard's: train batches are rows [i·b, (i+1)·b) of global batches of
    b·n examples (module docstring). train=True: infinite, reshuffled each epoch, augmented.
    train=False: one pass over this shard's examples, last batch padded with mask=False.
    Train stages: source -> (shuffle, repeat) -> per-example view (box, flip, mask) keyed by
    global position -> [resample] -> batch -> this shard's batches -> [resample] -> normalise
    -> [mixup] -> worker processes.
    """
    check_pipeline_call(split, batch_size, seed, shard_index, shard_count)
    validate_data_config(cfg)
    if train and cfg.mixup_alpha > 0 and shard_count > 1 and batch_size % 2:
        raise ValueError(f"data.mixup_alpha={cfg.mixup_alpha}: mixup pairs rows 2k, 2k+1 of the "
                         f"global batch, so each of the {shard_count} processes needs an even "
                         f"batch, not {batch_size}; make batch_size a multiple of "
                         f"{2 * shard_count}")
    field = f"{split}_split"
    source, selected = open_split(cfg, cfg[field])
    check_classes_kept(source, selected, name=f"data.{field}", spec=cfg[field])
    height, width, channels = source.image_shape
    size = cfg.image_size
    if len(cfg.mean) not in (1, channels) or len(cfg.std) not in (1, channels):
        counts = "1 value" if channels == 1 else f"1 or {channels} values"
        raise ValueError(f"data.mean={tuple(cfg.mean)!r}, data.std={tuple(cfg.std)!r}: give "
                         f"{counts} each ({cfg.name} images have {channels} "
                         f"channel{'s' if channels != 1 else ''})")
    if len(selected) < shard_count:
        raise ValueError(f"data.{split}_split selects {len(selected)} examples, fewer than "
                         f"shard_count={shard_count}; select more examples")

    ds = grain.MapDataset.source(source)
    augment = train and (cfg.random_resized_crop or cfg.flip)
    num_batches = None
    if train:   # the global stream; views keyed by global position
        ds = ds[selected.start:selected.stop:selected.step].shuffle(seed=seed).repeat()
        ds = ds.map_with_index(functools.partial(
            indexed_train_view, seed=seed, crop=cfg.random_resized_crop, flip=cfg.flip,
            scale=tuple(cfg.crop_scale), ratio=tuple(cfg.crop_ratio))) if augment \
            else ds.map(full_view)
    else:  # every shard pads to the same number of full batches
        ds = ds[selected.start:selected.stop:selected.step][shard_index::shard_count]
        num_batches = eval_batches_per_shard(len(selected), shard_count, batch_size)
        ds = pad_to_full_batches(ds, num_batches, batch_size, full_view)

    same_size = (height, width) == (size, size)
    if height is None:  # images differ in size: resize each before batching
        ds = ds.map(functools.partial(resample_example, size=size))
    ds = ds.batch(batch_size, drop_remainder=True)
    if train:   # batch k of b rows is rows [i·b, (i+1)·b) of global batch k div n, i = k mod n
        ds = ds[shard_index::shard_count]
    if height is not None and (augment or not same_size):
        ds = ds.map(functools.partial(resample_batch, size=size))
    ds = ds.map(functools.partial(finish_batch, mean=np.float32(cfg.mean),
                                  std=np.float32(cfg.std)))
    if train and cfg.mixup_alpha > 0:
        ds = ds.map_with_index(functools.partial(indexed_mixup, seed=seed,
                                                 alpha=float(cfg.mixup_alpha),
                                                 num_classes=source.num_classes))

    iter_ds = ds.to_iter_dataset()
    if cfg.worker_count > 0:
        if not flags.FLAGS.is_parsed():  # grain 0.2.18 reads its absl flags when it spawns
            flags.FLAGS.mark_as_parsed()  # workers; outside absl.app.run use their defaults
        prepare_input_workers()
        iter_ds = iter_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count),
                                      worker_init_fn=input_worker_init)
    return ImagePipeline(iterator=iter(iter_ds), dataset=iter_ds, num_examples=len(selected),
                         num_classes=source.num_classes, image_shape=(size, size, channels),
                         num_batches=num_batches)
