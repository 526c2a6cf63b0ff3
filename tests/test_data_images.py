"""Image input: local sources, TFDS array_record round trip, preprocessing math, pipeline
determinism, sharding, eval padding, iterator checkpointing and config errors."""
import gzip
import multiprocessing
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
from PIL import Image

from posjax.data import default_data_config, make_image_pipeline, validate_data_config
from posjax.data import images, sources

ROOT = pathlib.Path(__file__).resolve().parents[1]


def take(pipe, n):
    return [next(pipe.iterator) for _ in range(n)]


def same_batches(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b))


def indexed_npz(root, sizes=(("train", 10), ("test", 10))):
    """npz splits whose image i is filled with the value i (its identity), label i % 3."""
    for split, n in sizes:
        image = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None, None],
                                (n, 4, 4, 1)).copy()
        np.savez(root / f"{split}.npz", image=image, label=np.arange(n) % 3)
    cfg = default_data_config("cifar10")
    cfg.update(path=str(root), train_split="train", image_size=4, random_resized_crop=False,
               flip=False, mean=(0.0,), std=(1.0,))
    return cfg


def ids(batch):
    """The identities of an ``indexed_npz`` batch (image value), real examples only."""
    values = np.rint(batch["image"][:, 0, 0, 0] * 255).astype(int)
    return values[batch["mask"]].tolist()


def digits_augmented():
    cfg = default_data_config("digits")
    cfg.update(random_resized_crop=True, flip=True, mixup_alpha=0.4, image_size=12)
    return cfg


# ----------------------------------------------------------------------------- sources


def test_digits_split_is_stratified_and_fixed():
    train, test = sources.digits_source("train"), sources.digits_source("test")
    assert (len(train), len(test)) == (1438, 359)
    assert train.image_shape == (8, 8, 1) and train.images.max() == 255
    labels = sources._digits_arrays()[1]
    test_idx = sources.digits_test_indices(labels)
    np.testing.assert_array_equal(test_idx, sources.digits_test_indices(labels))
    for c in range(10):  # each class contributes round(20%) of its members to test
        assert (labels[test_idx] == c).sum() == round(0.2 * (labels == c).sum())


def test_mnist_idx_reads_real_files(shared_data):
    cfg = default_data_config("mnist")
    cfg.update(path=str(shared_data / "mnist"), train_split="test[:8000]",
               test_split="test[8000:]", mean=(0.0,), std=(1.0,))
    validate_data_config(cfg)
    pipe = make_image_pipeline(cfg, split="train", batch_size=8, seed=0, train=False)
    assert (pipe.num_examples, pipe.num_classes, pipe.image_shape) == (8000, 10, (28, 28, 1))
    first = next(pipe.iterator)
    # The first MNIST test digits are 7, 2, 1, 0, 4, 1, 4, 9 (LeCun's t10k order).
    assert first["label"].tolist() == [7, 2, 1, 0, 4, 1, 4, 9]
    raw = sources.read_idx(shared_data / "mnist" / "t10k-images-idx3-ubyte.gz", 2051)
    np.testing.assert_allclose(first["image"][..., 0] * 255, raw[:8], atol=1e-3)
    test = make_image_pipeline(cfg, split="test", batch_size=512, seed=0, train=False)
    assert test.num_examples == 2000 and test.num_batches == 4


def test_mnist_bad_magic_is_reported(tmp_path):
    path = tmp_path / "x-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write((2049).to_bytes(4, "big") + bytes(8))
    with pytest.raises(ValueError, match="magic number is 2049, expected 2051"):
        sources.read_idx(path, 2051)


def test_cifar10_npz_reads_real_files(shared_data):
    cfg = default_data_config("cifar10")
    cfg.update(path=str(shared_data / "cifar10"))
    validate_data_config(cfg)
    pipe = make_image_pipeline(cfg, split="test", batch_size=16, seed=0, train=False)
    assert (pipe.num_examples, pipe.num_classes, pipe.image_shape) == (10000, 10, (32, 32, 3))
    assert pipe.num_batches == 625
    with np.load(shared_data / "cifar10" / "test.npz") as npz:
        raw, labels = npz["image"][:16], npz["label"][:16]
    batch = next(pipe.iterator)
    np.testing.assert_allclose((batch["image"] * 0.5 + 0.5) * 255, raw, atol=1e-3)
    np.testing.assert_array_equal(batch["label"], labels)


def test_a_slice_of_a_class_ordered_file_must_keep_every_class(shared_data):
    """The packed CIFAR-10 files are ordered by class: test[:2000] is airplanes and cars only
    (the image study once evaluated on it). Such a slice is one error naming the field and a
    strided slice; the strided one reads every class, evenly, in file order."""
    cfg = default_data_config("cifar10")
    cfg.update(path=str(shared_data / "cifar10"), test_split="test[:2000]")
    with pytest.raises(ValueError) as e:
        make_image_pipeline(cfg, split="test", batch_size=250, seed=0, train=False)
    assert str(e.value) == (
        "data.test_split='test[:2000]' holds examples of 2 of the 10 classes of split 'test' "
        "(none of [2, 3, 4, 5, 6, 7, 8, 9]): its examples are grouped by class, so a "
        "contiguous slice drops classes; take every k-th example instead, e.g. 'test[::5]' "
        "(2000 examples), or the whole split")
    cfg.train_split = "train_20k[1000:3000]"   # the train split too, at any offset
    with pytest.raises(ValueError, match=r"^data.train_split='train_20k\[1000:3000\]' holds "
                                         r"examples of 2 of the 10 classes"):
        make_image_pipeline(cfg, split="train", batch_size=8, seed=0, train=True)
    cfg.test_split = "test[::5]"
    pipe = make_image_pipeline(cfg, split="test", batch_size=250, seed=0, train=False)
    labels = np.concatenate([b["label"][b["mask"]] for b in pipe.iterator])
    assert pipe.num_examples == 2000
    with np.load(shared_data / "cifar10" / "test.npz") as npz:
        np.testing.assert_array_equal(labels, npz["label"][::5])
    assert np.bincount(labels).tolist() == [200] * 10
    cfg.test_split = "test[9990:]"             # the last class alone: refused as well
    with pytest.raises(ValueError, match=r"holds examples of 1 of the 10 classes .* "
                                         r"'test\[::1000\]' \(10 examples\)"):
        make_image_pipeline(cfg, split="test", batch_size=8, seed=0, train=False)


def test_strided_splits_shard_and_shuffle_the_selected_examples(tmp_path):
    cfg = indexed_npz(tmp_path, (("train", 30), ("test", 30)))
    cfg.test_split = "test[2:23:4]"                       # 2, 6, 10, 14, 18, 22
    pipe = make_image_pipeline(cfg, split="test", batch_size=4, seed=0, train=False)
    assert pipe.num_examples == 6
    assert [i for b in pipe.iterator for i in ids(b)] == [2, 6, 10, 14, 18, 22]
    shards = [make_image_pipeline(cfg, split="test", batch_size=2, seed=0, train=False,
                                  shard_index=s, shard_count=2) for s in range(2)]
    assert [[i for b in p.iterator for i in ids(b)] for p in shards] == [[2, 10, 18],
                                                                        [6, 14, 22]]
    cfg.train_split = "train[::3]"                        # 0, 3, ..., 27: every class (i % 3)?
    with pytest.raises(ValueError, match=r"holds examples of 1 of the 3 classes"):
        make_image_pipeline(cfg, split="train", batch_size=5, seed=0, train=True)
    cfg.train_split = "train[::2]"
    train = make_image_pipeline(cfg, split="train", batch_size=5, seed=0, train=True)
    seen = [i for b in take(train, 3) for i in ids(b)]    # 15 = one epoch of 15 examples
    assert sorted(seen) == list(range(0, 30, 2))
    assert sources.split_range("test[::]", 5) == range(5)
    assert sources.split_range("test[10%::3]", 30) == range(3, 30, 3)
    assert sources.without_step("test[10%::3]") == "test[10%:]"
    assert sources.without_step("test[::3]") == "test"
    for spec in ("test[::0]", "test[::00]"):
        with pytest.raises(ValueError, match=r"the step \(after the second ':'\) must be an "
                                             r"integer >= 1"):
            sources.split_range(spec, 10)
    for spec in ("test[::-1]", "test[:::2]", "test[::2%]"):
        with pytest.raises(ValueError, match=r"is not understood"):
            sources.parse_split(spec)


def test_image_folder_of_mixed_sizes(tmp_path):
    colours = {"cat": (200, 10, 10), "dog": (10, 10, 200)}
    for split, sizes in (("train", [(9, 7), (12, 12), (5, 20)]), ("test", [(8, 6)])):
        for name, colour in colours.items():
            (tmp_path / split / name).mkdir(parents=True)
            for i, (h, w) in enumerate(sizes):
                Image.new("RGB", (w, h), colour).save(tmp_path / split / name / f"{i}.png")
    cfg = default_data_config("image_folder")
    cfg.update(path=str(tmp_path), image_size=6, mean=(0.0,), std=(1.0,))
    validate_data_config(cfg)
    train = make_image_pipeline(cfg, split="train", batch_size=4, seed=0, train=True)
    assert (train.num_examples, train.num_classes, train.image_shape) == (6, 2, (6, 6, 3))
    for batch in take(train, 3):  # solid colours stay solid under crop, flip and resize
        assert batch["image"].shape == (4, 6, 6, 3)
        for image, label in zip(batch["image"], batch["label"]):
            want = np.float32(colours[["cat", "dog"][label]]) / 255
            np.testing.assert_allclose(image, np.broadcast_to(want, image.shape), atol=1e-5)
    test = make_image_pipeline(cfg, split="test", batch_size=4, seed=0, train=False)
    (batch,) = list(test.iterator)
    assert batch["label"].tolist()[:2] == [0, 1] and batch["mask"].tolist() == [1, 1, 0, 0]


# ----------------------------------------------------------------------------- TFDS


def test_tfds_array_record_round_trip_without_tensorflow(tmp_path):
    from posjax.data import tfds_sources

    rng = np.random.default_rng(0)
    splits = {s: (rng.integers(0, 256, (n, 6, 5, 3), dtype=np.uint8), np.arange(n) % 4)
              for s, n in (("train", 12), ("test", 5))}
    tfds_sources.ImageArrays(splits=splits, num_classes=4, data_dir=str(tmp_path),
                             file_format="array_record").download_and_prepare()
    assert list((tmp_path / "image_arrays" / "1.0.0").glob("*.array_record-*"))
    source = tfds_sources.tfds_source("image_arrays", "test", str(tmp_path))
    assert (len(source), source.num_classes, source.image_shape) == (5, 4, (6, 5, 3))
    for i in range(5):  # PNG is lossless and the builder keeps array order
        np.testing.assert_array_equal(source[i]["image"], splits["test"][0][i])
        assert source[i]["label"] == i % 4

    cfg = default_data_config("tfds")
    cfg.update(tfds_name="image_arrays", data_dir=str(tmp_path), train_split="train[:50%]",
               image_size=4, mixup_alpha=0.2, test_split="test[1::2]")
    validate_data_config(cfg)
    test = make_image_pipeline(cfg, split="test", batch_size=4, seed=0, train=False)
    (batch,) = list(test.iterator)   # TFDS reads test[1:], posjax takes every 2nd: 1, 3
    assert test.num_examples == 2 and batch["label"][batch["mask"]].tolist() == [1, 3]
    pipe = make_image_pipeline(cfg, split="train", batch_size=3, seed=1, train=True)
    assert pipe.num_examples == 6 and pipe.image_shape == (4, 4, 3)
    batch = next(pipe.iterator)
    assert batch["image"].shape == (3, 4, 4, 3) and batch["label_soft"].shape == (3, 4)
    assert "tensorflow" not in sys.modules

    cfg.test_split = "validation"
    with pytest.raises(ValueError, match=r"data.test_split='validation'.*offers \['test', 'tr"):
        validate_data_config(cfg)
    cfg.update(test_split="test", tfds_name="not_prepared_here")
    with pytest.raises(ValueError, match="data.tfds_name='not_prepared_here'.*tfds build"):
        validate_data_config(cfg)


# ----------------------------------------------------------------------------- preprocessing


def test_resample_identity_crop_flip_and_upsampling():
    import jax

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    full = np.stack([images.full_box(8, 8)] * 2)
    no, yes = np.zeros(2, bool), np.ones(2, bool)
    np.testing.assert_allclose(images.resample(x, full, no, 8), x, atol=1e-4)
    np.testing.assert_allclose(images.resample(x, full, yes, 8), x[:, :, ::-1], atol=1e-4)
    box = np.array([[2, 3, 4, 4]] * 2, np.float32)  # an integer window at its own size
    np.testing.assert_allclose(images.resample(x, box, no, 4), x[:, 2:6, 3:7], atol=1e-4)
    want = jax.image.resize(x.astype(np.float32), (2, 20, 20, 3), "linear", antialias=False)
    np.testing.assert_allclose(images.resample(x, full, no, 20), want, atol=1e-3)


def test_random_resized_crop_boxes_respect_scale_and_ratio():
    rng = np.random.default_rng(0)
    for _ in range(500):
        y0, x0, h, w = images.sample_crop_box(rng, 30, 40, (0.2, 0.9), (0.5, 2.0))
        assert 0 <= y0 and y0 + h <= 30 + 1e-4 and 0 <= x0 and x0 + w <= 40 + 1e-4
        assert 0.2 - 1e-4 <= h * w / 1200 <= 0.9 + 1e-4 and 0.5 - 1e-4 <= w / h <= 2 + 1e-4
    # No candidate can fit a 1x100 strip at ratio 1: the whole image is used.
    np.testing.assert_array_equal(images.sample_crop_box(rng, 1, 100, (0.5, 1), (1, 1)),
                                  [0, 0, 1, 100])


def test_mixup_mixes_each_pair_of_rows_images_and_one_hot_labels():
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(5, 2, 2, 1)).astype(np.float32),
             "label": np.array([0, 1, 2, 1, 2], np.int32), "mask": np.ones(5, bool)}
    out = images.mixup(batch, np.random.default_rng(7), alpha=0.5, num_classes=3)
    lam = np.random.default_rng(7).beta(0.5, 0.5)
    partner = [1, 0, 3, 2, 4]   # rows 2k <-> 2k+1; the odd last row keeps itself
    np.testing.assert_allclose(out["image"], lam * batch["image"]
                               + (1 - lam) * batch["image"][partner], rtol=1e-5)
    np.testing.assert_allclose(out["label_soft"][0], [lam, 1 - lam, 0], rtol=1e-5)
    np.testing.assert_allclose(out["label_soft"][4], [0, 0, 1], rtol=1e-6)
    np.testing.assert_allclose(out["label_soft"].sum(1), 1, rtol=1e-6)
    assert out["image"].dtype == out["label_soft"].dtype == np.float32


# ----------------------------------------------------------------------------- pipeline


def test_digits_batches_have_the_contract_layout():
    cfg = default_data_config("digits")
    pipe = make_image_pipeline(cfg, split="train", batch_size=32, seed=0, train=True)
    assert (pipe.num_examples, pipe.num_classes, pipe.image_shape) == (1438, 10, (8, 8, 1))
    batch = next(pipe.iterator)
    assert {k: (v.dtype, v.shape) for k, v in batch.items()} == {
        "image": (np.float32, (32, 8, 8, 1)), "label": (np.int32, (32,)),
        "mask": (np.bool_, (32,))}
    assert batch["image"].min() >= -1 and batch["image"].max() <= 1 and batch["mask"].all()
    aug = make_image_pipeline(digits_augmented(), split="train", batch_size=32, seed=0,
                              train=True)
    batch = next(aug.iterator)
    assert batch["image"].shape == (32, 12, 12, 1) and batch["label_soft"].shape == (32, 10)


def test_train_order_is_seeded_and_reshuffled_each_epoch(tmp_path):
    cfg = indexed_npz(tmp_path)
    stream = [i for b in take(make_image_pipeline(cfg, split="train", batch_size=5, seed=0,
                                                  train=True), 4) for i in ids(b)]
    assert sorted(stream[:10]) == sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]
    again = [i for b in take(make_image_pipeline(cfg, split="train", batch_size=5, seed=0,
                                                 train=True), 4) for i in ids(b)]
    other = [i for b in take(make_image_pipeline(cfg, split="train", batch_size=5, seed=1,
                                                 train=True), 4) for i in ids(b)]
    assert again == stream and other != stream


def test_augmented_batches_depend_only_on_the_seed():
    cfg = digits_augmented()
    make = lambda seed: make_image_pipeline(cfg, split="train", batch_size=16, seed=seed,
                                            train=True)
    first = take(make(5), 3)
    assert same_batches(first, take(make(5), 3))
    assert not same_batches(first, take(make(6), 3))


def test_worker_processes_give_the_same_batches_and_outlive_sigterm():
    """Workers ignore a SIGTERM meant for the process group (the main process saves first and
    still needs batches): the stream goes on unchanged after every worker got one."""
    cfg = digits_augmented()
    shard = {"shard_index": 1, "shard_count": 2}
    want = take(make_image_pipeline(cfg, split="train", batch_size=16, seed=2, train=True,
                                    **shard), 12)
    cfg.worker_count = 2
    before = set(multiprocessing.active_children())
    pipe = make_image_pipeline(cfg, split="train", batch_size=16, seed=2, train=True, **shard)
    try:
        got = [{k: np.array(v) for k, v in b.items()} for b in take(pipe, 2)]
        workers = [p for p in multiprocessing.active_children() if p not in before]
        assert len(workers) == 2
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
        time.sleep(1.0)
        assert all(worker.is_alive() for worker in workers)
        got += [{k: np.array(v) for k, v in b.items()} for b in take(pipe, 10)]
    finally:
        pipe.iterator.close()
    assert same_batches(want, got)
    assert not any(worker.is_alive() for worker in workers)   # close() stopped them


WORKERS_SCRIPT = """
import multiprocessing, os, signal, sys, time
from posjax.data import default_data_config, make_image_pipeline
if __name__ == "__main__":
    cfg = default_data_config("digits")
    cfg.worker_count = 2
    pipe = make_image_pipeline(cfg, split="train", batch_size=8, seed=0, train=True)
    fresh_pass = iter(pipe.dataset)   # two more workers
    next(pipe.iterator), next(fresh_pass)
    for _ in range(600):   # Grain starts the workers from its own threads
        if len(multiprocessing.active_children()) == 4:
            break
        time.sleep(0.05)
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    # else: exit with both iterators open
"""


def _run_workers_script(tmp_path, how):
    script = tmp_path / "workers.py"
    script.write_text(WORKERS_SCRIPT)
    out = subprocess.run([sys.executable, str(script), how], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 4, out.stderr[-2000:]
    return out, pids


SNIPER_SCRIPT = """
import contextlib, glob, os, signal, sys, threading, time
from posjax.data import default_data_config, make_image_pipeline
from posjax.io_utils import signals_to_receiver_thread

def children():
    out = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            out.update(int(p) for p in f.read().split())
    return out

if __name__ == "__main__":
    sniped, stop = set(), threading.Event()
    def snipe():   # SIGTERM each new child process the moment it appears (still starting up)
        while not stop.is_set():
            for pid in children() - sniped:
                os.kill(pid, signal.SIGTERM)
                sniped.add(pid)
            time.sleep(0.002)
    threading.Thread(target=snipe, daemon=True).start()
    shield = signals_to_receiver_thread() if sys.argv[1] == "shielded" else contextlib.nullcontext()
    cfg = default_data_config("digits")
    cfg.worker_count = 2
    with shield:
        pipe = make_image_pipeline(cfg, split="train", batch_size=8, seed=0, train=True)
        batches = [next(pipe.iterator) for _ in range(6)]
        pipe.iterator.close()
    stop.set()
    print(len(batches), len(sniped), flush=True)
"""


def test_workers_survive_a_sigterm_while_they_start(tmp_path):
    """Inside ``signals_to_receiver_thread`` (train.py, eval.py) a worker is immune from its
    first instruction: without it, a group SIGTERM during a worker's ~2 s of imports kills it
    and the main process waits for its batches forever (checked: the script then hangs)."""
    script = tmp_path / "sniper.py"
    script.write_text(SNIPER_SCRIPT)
    out = subprocess.run([sys.executable, str(script), "shielded"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    batches, sniped = map(int, out.stdout.split())
    assert batches == 6 and sniped >= 2   # both workers (and the resource tracker) were hit


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has ended
    except FileNotFoundError:
        return False


def _all_end(pids, within):
    deadline = time.monotonic() + within
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(_running(p) for p in pids)


def test_workers_exit_when_the_main_process_is_killed(tmp_path):
    out, pids = _run_workers_script(tmp_path, "kill")
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert _all_end(pids, within=15), "workers outlived their main process"


def test_open_iterators_do_not_hold_up_the_exit(tmp_path):
    """Workers ignore SIGTERM, which multiprocessing's exit handler would wait on forever."""
    out, pids = _run_workers_script(tmp_path, "exit")
    assert out.returncode == 0, out.stderr[-2000:]
    assert _all_end(pids, within=15)


def test_eval_is_one_padded_pass_and_shards_are_disjoint(tmp_path):
    cfg = indexed_npz(tmp_path, (("train", 10), ("test", 11)))
    pipe = make_image_pipeline(cfg, split="test", batch_size=4, seed=0, train=False)
    batches = list(pipe.iterator)
    assert pipe.num_batches == len(batches) == 3
    assert [i for b in batches for i in ids(b)] == list(range(11))
    assert batches[-1]["mask"].tolist() == [True, True, True, False]

    shards = [make_image_pipeline(cfg, split="test", batch_size=2, seed=0, train=False,
                                  shard_index=s, shard_count=3) for s in range(3)]
    seen = [[i for b in p.iterator for i in ids(b)] for p in shards]
    assert {p.num_batches for p in shards} == {2}  # 11 -> 4, 4, 3 examples; 2 batches each
    assert seen == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]


def test_global_batches_do_not_depend_on_the_shard_count():
    """Shards 0 and 1 of 2 (batch 8 each) concatenate to the 1-shard batch of 16, bit for bit,
    with crop, flip and mixup on (epoch boundaries: next test)."""
    cfg = digits_augmented()
    whole = take(make_image_pipeline(cfg, split="train", batch_size=16, seed=4, train=True), 3)
    halves = [take(make_image_pipeline(cfg, split="train", batch_size=8, seed=4, train=True,
                                       shard_index=s, shard_count=2), 3) for s in range(2)]
    joined = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*halves)]
    assert same_batches(whole, joined)
    with pytest.raises(ValueError, match="mixup_alpha=0.4: .* even batch, not 3"):
        make_image_pipeline(cfg, split="train", batch_size=3, seed=0, train=True,
                            shard_index=0, shard_count=2)


def test_train_shards_take_their_rows_of_each_global_batch(tmp_path):
    cfg = indexed_npz(tmp_path)
    whole = [ids(b) for b in take(make_image_pipeline(cfg, split="train", batch_size=4,
                                                      seed=0, train=True), 5)]
    shards = [[ids(b) for b in take(make_image_pipeline(cfg, split="train", batch_size=2,
                                                        seed=0, train=True, shard_index=s,
                                                        shard_count=2), 5)] for s in range(2)]
    assert [list(w[:2]) for w in whole] == [list(b) for b in shards[0]]
    assert [list(w[2:]) for w in whole] == [list(b) for b in shards[1]]


def test_iterator_checkpoint_restores_the_stream(tmp_path):
    cfg = digits_augmented()
    make = lambda: make_image_pipeline(cfg, split="train", batch_size=64, seed=3, train=True)
    pipe = make()
    take(pipe, 25)  # past the first epoch (1438 / 64 batches)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(25, args=ocp.args.Composite(
            data_iter=grain.checkpoint.CheckpointSave(pipe.iterator)))
        manager.wait_until_finished()
    want = take(pipe, 3)
    fresh = make()
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore(25, args=ocp.args.Composite(
            data_iter=grain.checkpoint.CheckpointRestore(fresh.iterator)))
    assert same_batches(want, take(fresh, 3))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name, changes, message", [
    ("digits", {"name": "svhn"}, "data.name='svhn': choose one of"),
    ("mnist", {}, "data.path='': mnist needs the folder"),
    ("mnist", {"path": "/no/such/folder"}, "data.path='/no/such/folder'"),
    ("digits", {"image_size": 0}, "data.image_size=0: must be a positive integer"),
    ("digits", {"crop_scale": (0.5, 0.2)}, "data.crop_scale=.*0 < min <= max <= 1"),
    ("digits", {"std": (0.0,)}, r"data.std=\(0.0,\): every entry must be > 0"),
    ("digits", {"mixup_alpha": -1.0}, "data.mixup_alpha=-1.0: must be >= 0"),
    ("digits", {"train_split": "train[:x]"}, "data.train_split='train\\[:x\\]'"),
    ("digits", {"test_split": "valid"}, r"data.test_split='valid': no such split.*'test'\]"),
    ("tfds", {}, "data.tfds_name='': name the TFDS catalog dataset"),
    ("digits", {"mixup_alfa": 0.2}, r"unknown key\(s\) data.mixup_alfa: the data config has "
                                    r"no such field; the valid keys are .*mixup_alpha"),
])
def test_bad_config_is_one_clear_error(name, changes, message):
    cfg = default_data_config(name)
    cfg.update(changes)
    with pytest.raises(ValueError, match=message):
        validate_data_config(cfg)


def test_bad_config_errors_name_the_split_files(shared_data, tmp_path):
    cfg = default_data_config("mnist")
    cfg.path = str(shared_data / "mnist")  # only t10k files: 'train' is not there
    with pytest.raises(ValueError, match=r"data.train_split='train'.*offers \['test'\]"):
        validate_data_config(cfg)
    cfg = indexed_npz(tmp_path)
    cfg.mean = (0.5, 0.5, 0.5)  # the npz images have one channel
    with pytest.raises(ValueError, match=r"data.mean=.*give 1 value each .*have 1 channel\)"):
        make_image_pipeline(cfg, split="train", batch_size=2, seed=0, train=True)
    with pytest.raises(ValueError, match="shard_index=2, shard_count=2"):
        make_image_pipeline(default_data_config("digits"), split="train", batch_size=2,
                            seed=0, train=True, shard_index=2, shard_count=2)
    del cfg["flip"]
    with pytest.raises(ValueError, match=r"keys \['flip'\] are missing"):
        validate_data_config(cfg)


def _npz(root, split, labels, images=None, **more):
    labels = np.asarray(labels)
    images = np.zeros((len(labels), 4, 4, 1), np.uint8) if images is None else images
    np.savez(root / f"{split}.npz", image=images, label=labels, **more)


def test_npz_labels_must_be_class_indices_of_the_folder(tmp_path):
    """Every split of an npz folder has the classes of the whole folder (its largest label + 1,
    or its 'classes'), and labels must be one integer in range per example: (N, 1) labels
    (Keras' layout) broadcast into a wrong loss, float ones were truncated, out-of-range ones
    became all-zero targets."""
    _npz(tmp_path, "train", [0, 1, 2, 1])       # lacks class 3, which only the test split has
    _npz(tmp_path, "test", [3, 0])
    np.savez(tmp_path / "mean_std.npz", mean=np.zeros(3), std=np.ones(3))   # not a split
    assert sources.open_local_split("cifar10", tmp_path, "train").num_classes == 4
    with pytest.raises(ValueError, match=r"mean_std.npz lacks keys \['image', 'label'\] \(has "
                                         r"\['mean', 'std'\]\)"):
        sources.open_local_split("cifar10", tmp_path, "mean_std")
    for labels, message in (([[0], [1]], r"labels must be one integer class index per "
                                         r"example, shape \(N,\); got int64\(2, 1\) \(for \(N, "
                                         r"1\) labels, store labels.reshape\(-1\)\)"),
                            ([0.7, 1.0], r"labels must be .*; got float64\(2,\)"),
                            ([0, -1], r"1 label\(s\) outside 0..3 \(the 4 classes\), e.g. \[-1\]")):
        _npz(tmp_path, "bad", labels)
        with pytest.raises(ValueError, match=rf"^{tmp_path / 'bad.npz'}: " + message):
            sources.open_local_split("cifar10", tmp_path, "bad")
    (tmp_path / "bad.npz").unlink()
    _npz(tmp_path, "test", [3, 0], classes=np.array(["a", "b", "c"]))
    with pytest.raises(ValueError, match=r"test.npz: 1 label\(s\) outside 0..2 \(the 3 classes\)"):
        sources.open_local_split("cifar10", tmp_path, "test")
    _npz(tmp_path, "train", [0, 1], classes=np.array(["a", "b", "x"]))
    with pytest.raises(ValueError, match=r"its npz files name different 'classes' \(test.npz: "
                                         r"3; train.npz: 3\); give every split the same list"):
        sources.open_local_split("cifar10", tmp_path, "train")


def test_mnist_labels_outside_the_ten_classes_are_refused(shared_data, tmp_path):
    with gzip.open(shared_data / "mnist" / "t10k-labels-idx1-ubyte.gz") as f:
        labels = bytearray(f.read())
    labels[8:10] = bytes([10, 255])
    (tmp_path / "t10k-images-idx3-ubyte.gz").symlink_to(
        shared_data / "mnist" / "t10k-images-idx3-ubyte.gz")
    with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(bytes(labels))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte.gz: 2 label\(s\) outside "
                                         r"0..9 \(the 10 classes\), e.g. \[10, 255\]"):
        sources.open_local_split("mnist", tmp_path, "test")


def test_unreadable_files_are_named(tmp_path):
    (tmp_path / "plain-labels-idx1-ubyte.gz").write_bytes((2049).to_bytes(4, "big") + bytes(8))
    with gzip.open(tmp_path / "cut-labels-idx1-ubyte.gz", "wb") as f:
        f.write((2049).to_bytes(4, "big") + bytes(4000))
    cut = (tmp_path / "cut-labels-idx1-ubyte.gz").read_bytes()
    (tmp_path / "cut-labels-idx1-ubyte.gz").write_bytes(cut[:len(cut) // 2])
    for name, cause in (("plain", "BadGzipFile"), ("cut", "EOFError")):
        path = tmp_path / f"{name}-labels-idx1-ubyte.gz"
        with pytest.raises(ValueError, match=rf"^{path}: cannot be read as a gzipped IDX file "
                                             rf"\({cause}: .*\); download it again"):
            sources.read_idx(path, 2049)
    np.savez(tmp_path / "train.npz", image=np.zeros((9, 4, 4, 1), np.uint8), label=np.zeros(9))
    (tmp_path / "train.npz").write_bytes((tmp_path / "train.npz").read_bytes()[:-30])   # cut
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'train.npz'}: cannot be read as an npz "
                                         r"file \(BadZipFile: .*\); write it again"):
        sources.open_local_split("cifar10", tmp_path, "train")
    np.savez(tmp_path / "train.npz", image=np.zeros((1, 4, 4, 1), np.uint8),
             label=np.array([None], object))
    with pytest.raises(ValueError, match=r"train.npz: cannot be read as an npz file \(ValueError: "
                                         r"Object arrays cannot be loaded .*numeric arrays only"):
        sources.open_local_split("cifar10", tmp_path, "train")
    with open(tmp_path / "train.npz", "wb") as f:   # np.save's format under an .npz name
        np.save(f, np.zeros(3))
    with pytest.raises(ValueError, match=r"train.npz: cannot be read as an npz file \(ValueError: "
                                         r"it holds one array \(.npy\), not named arrays"):
        sources.open_local_split("cifar10", tmp_path, "train")
    np.savez_compressed(tmp_path / "train.npz", image=np.zeros((64, 8, 8, 1), np.uint8),
                        label=np.zeros(64, np.int64))
    data = bytearray((tmp_path / "train.npz").read_bytes())
    data[60:80] = bytes(20)   # inside the first member's deflate stream
    (tmp_path / "train.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"train.npz: cannot be read as an npz file \((error|"
                                         r"BadZipFile): "):
        sources.open_local_split("cifar10", tmp_path, "train")
    with gzip.open(tmp_path / "short-images-idx3-ubyte.gz", "wb") as f:
        f.write((2051).to_bytes(4, "big") + bytes(2))
    with pytest.raises(ValueError, match=r"short-images-idx3-ubyte.gz: 6 bytes, shorter than "
                                         r"the IDX header \(16\)"):
        sources.read_idx(tmp_path / "short-images-idx3-ubyte.gz", 2051)


def test_image_folder_reads_16_bit_grey_and_names_an_undecodable_file(tmp_path):
    """Pillow's convert('RGB') clips 16-bit grey at 255 (a 0..65535 ramp came out 99.6 %
    white); it is scaled to 8 bits instead. A file that does not decode is named."""
    (tmp_path / "train" / "ramp").mkdir(parents=True)
    ramp = (np.arange(256, dtype=np.uint16) * 257).reshape(16, 16)
    Image.fromarray(ramp).save(tmp_path / "train" / "ramp" / "0.png")
    assert Image.open(tmp_path / "train" / "ramp" / "0.png").mode.startswith("I")
    source = sources.open_local_split("image_folder", tmp_path, "train")
    pixels = source[0]["image"]
    assert pixels.shape == (16, 16, 3) and pixels.dtype == np.uint8
    np.testing.assert_array_equal(pixels, np.repeat(np.arange(256, dtype=np.uint8).reshape(
        16, 16)[..., None], 3, axis=-1))
    (tmp_path / "train" / "ramp" / "1.png").write_bytes(
        (tmp_path / "train" / "ramp" / "0.png").read_bytes()[:60])
    source = sources.open_local_split("image_folder", tmp_path, "train")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'train' / 'ramp' / '1.png'}: cannot be "
                                         r"decoded as an image \(.*\); replace or remove"):
        source[1]


@pytest.mark.parametrize("spec, message", [
    ("train[:150%]", r"a percentage bound lies in -100%..100%, not 150%"),
    ("train[:11]", r"bound 11 lies outside the split's 10 examples; give one in -10..10"),
    ("train[-11:]", r"bound -11 lies outside"),
])
def test_split_bounds_past_the_split_are_refused_as_in_tfds(tmp_path, spec, message):
    cfg = indexed_npz(tmp_path)
    cfg.train_split = spec
    with pytest.raises(ValueError, match=rf"split '{re.escape(spec)}': " + message):
        make_image_pipeline(cfg, split="train", batch_size=2, seed=0, train=True)
    assert sources.split_range("train[:100%]", 10) == range(10)
    assert sources.split_range("train[-10:10]", 10) == range(10)
    for spec in ("train[%:]", "train[-:]", "train[:-%]", "train[1.5:]"):
        with pytest.raises(ValueError, match=rf"split '{re.escape(spec)}' is not understood"):
            sources.parse_split(spec)


def test_image_folder_split_without_some_classes_is_named_once(tmp_path, caplog):
    for split, classes in (("train", ("cat", "dog")), ("test", ("cat", "dog", "owl"))):
        for name in classes:
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (4, 4)).save(tmp_path / split / name / "0.png")
    (tmp_path / "train" / "emu").mkdir()   # an empty class folder
    for _ in range(2):
        source = sources.open_local_split("image_folder", tmp_path, "train")
    assert source.num_classes == 4
    warnings = [r.getMessage() for r in caplog.records if "has no images" in r.getMessage()]
    assert warnings == [f"image folder split {tmp_path / 'train'} has no images of class(es) "
                        "emu, owl; the classes are the <class> folders of all splits, and the "
                        "model has an output for each"]


def test_an_mnist_split_without_its_labels_file_names_it(shared_data, tmp_path):
    (tmp_path / "t10k-images-idx3-ubyte.gz").symlink_to(
        shared_data / "mnist" / "t10k-images-idx3-ubyte.gz")
    cfg = default_data_config("mnist")
    cfg.update(path=str(tmp_path), train_split="test")
    with pytest.raises(ValueError, match=r"data.train_split='test': no such split in .* \(no "
                                         r"t10k-labels-idx1-ubyte.gz\); it offers no splits"):
        validate_data_config(cfg)
    (tmp_path / "t10k-images-idx3-ubyte.gz").rename(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(ValueError, match=r"\(no t10k-images-idx3-ubyte.gz\)"):
        validate_data_config(cfg)
