"""What the processes of a run must agree on (``posjax.training.processes``), with a second
process simulated: ``hosts.gather`` gives this process's value and a changed copy of it as
process 1's. The real all-gather between two processes is tested in test_multiprocess.py."""
from __future__ import annotations

import copy
import pathlib
import shutil
import types

import pytest

from posjax import config_defaults
from posjax.training import hosts
from posjax.training import processes



def _second_process(monkeypatch, change) -> list:
    """``hosts.gather`` as two processes: this one's value, then process 1's, a copy that
    ``change`` (if given) edits in place. Returns the list of the values gathered, filled as
    they are asked for."""
    asked = []

    def gather(value):
        asked.append(value)
        other = copy.deepcopy(value)
        if change:
            change(other)
        return [value, other]
    monkeypatch.setattr(hosts, "several", lambda: True)
    monkeypatch.setattr(hosts, "gather", gather)
    return asked


def test_one_process_gathers_its_own_value():
    assert hosts.gather({"a": [1, 2]}) == [{"a": [1, 2]}]


def test_one_process_compares_nothing_and_writes_no_probe(tmp_path: pathlib.Path):
    def values():
        raise AssertionError("values computed with one process")
    processes.check_agree(values, "differ", "fix")
    processes.check_shared_workdir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_differences_name_each_process_and_key():
    found = processes.differences([{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 0, "c": 4}],
                                  lambda k, v, first: f"{k}={v} ({first})")
    assert found == ["process 1: b=3 (2)", "process 2: a=0 (1)", "process 2: b=None (2)",
                     "process 2: c=4 (None)"]


def test_a_process_with_another_config_is_one_error_naming_the_key(monkeypatch):
    def change(config):
        config["optimizer.learning_rate"] = 0.002
        config.pop("optimizer.b2")
    _second_process(monkeypatch, change)
    config = config_defaults.default_config()
    with pytest.raises(ValueError) as raised:
        processes.check_same_config(config)
    message = str(raised.value)
    assert message.startswith("the processes were started with different configs:\n")
    assert f"process 1: optimizer.learning_rate=0.002 (process 0: " \
        f"{config.optimizer.learning_rate!r})" in message
    assert "process 1: optimizer.b2=<absent> (process 0: 0.999)" in message
    assert "same --config and --config.* flags" in message
    assert message.count("process 1:") == 2


def test_the_distributed_section_may_differ_between_processes(monkeypatch):
    asked = _second_process(monkeypatch, None)
    config = config_defaults.default_config()
    config.distributed.process_id = 3
    processes.check_same_config(config)
    assert not any(k.startswith("distributed") for k in asked[0])
    assert asked[0]["optimizer.learning_rate"] == config.optimizer.learning_rate


def _vocabulary(blocks: list[str]) -> dict:
    return {"sha256": "".join(blocks), "size": 1024 * len(blocks) - 10, "block": 1024,
            "blocks": blocks}


def test_a_host_with_another_vocabulary_is_one_error_naming_the_ids(monkeypatch):
    def change(identity):
        identity["data.tokenizer"] = _vocabulary(["a", "B", "c", "D"])
    _second_process(monkeypatch, change)
    config = config_defaults.default_config()
    config.data.tokenizer = "/data/vocab.txt"
    with pytest.raises(ValueError) as raised:
        processes.check_same_data_identity(config,
                                      {"data.tokenizer": _vocabulary(["a", "b", "c", "d"])})
    assert str(raised.value) == (
        "the processes read different data:\n  process 1: data.tokenizer='/data/vocab.txt' "
        "holds another vocabulary than process 0's (ids 1024–2047, 3072–4085 differ)\n"
        "Give every host the same copy of the data files.")


def test_a_host_with_another_copy_of_a_split_is_one_error(monkeypatch):
    def change(counts):
        counts["test"] -= 1
    _second_process(monkeypatch, change)
    pipes = {"train": types.SimpleNamespace(num_examples=1000),
             "test": types.SimpleNamespace(num_examples=359)}
    with pytest.raises(ValueError, match=r"process 1: its data.test_split has 358 examples "
                                         r"\(process 0: 359\)\nGive every host the same copy"):
        processes.check_same_splits(pipes)


def test_processes_that_agree_pass(monkeypatch):
    asked = _second_process(monkeypatch, None)
    processes.check_same_config(config_defaults.default_config())
    processes.check_same_data_identity(config_defaults.default_config(), {"data.tokenizer": _vocabulary(["a"])})
    processes.check_same_splits({"test": types.SimpleNamespace(num_examples=3)})
    assert asked[1:] == [{"data.tokenizer": _vocabulary(["a"])}, {"test": 3}]


def test_a_workdir_a_process_does_not_share_is_one_error(tmp_path: pathlib.Path, monkeypatch):
    views = []

    def gather(value):   # process 1 reads its own, empty directory
        views.append(value)
        return [value, None]
    monkeypatch.setattr(hosts, "several", lambda: True)
    monkeypatch.setattr(hosts, "gather", gather)
    with pytest.raises(ValueError, match=r"workdir '.*' is not one directory shared by every "
                                         r"process: process 1 does not see a file that process "
                                         r"0 wrote there"):
        processes.check_shared_workdir(tmp_path)
    name, content = views[0]   # process 0's probe: a new name each time, removed after
    assert name.startswith(".shared-workdir-check-") and content == name
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"process 1 does not see the config.json that process "
                                         r"0 sees there"):
        processes.check_shared_workdir(tmp_path, "config.json")


def test_a_workdir_every_process_sees_passes(tmp_path: pathlib.Path, monkeypatch):
    names = []

    def gather(value):
        names.append(value)
        return [value, value, value]
    monkeypatch.setattr(hosts, "several", lambda: True)
    monkeypatch.setattr(hosts, "gather", gather)
    processes.check_shared_workdir(tmp_path)
    processes.check_shared_workdir(tmp_path)
    assert names[0][0] != names[2][0]   # a new probe name each time
    processes.check_shared_workdir(tmp_path, "config.json")   # absent for every process
    assert list(tmp_path.iterdir()) == []


def test_a_host_with_other_software_is_one_error_naming_it(monkeypatch):
    def change(versions):
        versions["jax"] = "0.0.1"
        versions["posjax source"] = "0" * 16   # another checkout
    _second_process(monkeypatch, change)
    with pytest.raises(ValueError) as raised:
        processes.check_same_software()
    ours = processes.software_versions()
    assert str(raised.value) == (
        "the processes run different software:\n"
        f"  process 1: jax 0.0.1 (process 0: {ours['jax']})\n"
        f"  process 1: posjax source 0000000000000000 (process 0: {ours['posjax source']})\n"
        "Install the same packages and the same posjax on every host.")


def test_the_source_digest_follows_posjax_s_files(tmp_path, monkeypatch):
    """The digest covers every posjax .py file, so an edited file (a stale checkout) shows."""
    import posjax
    copy = tmp_path / "posjax"
    shutil.copytree(pathlib.Path(posjax.__file__).parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    here = processes.software_versions()["posjax source"]
    monkeypatch.setattr(processes, "__file__", str(copy / "training" / "processes.py"))
    assert processes.software_versions()["posjax source"] == here
    (copy / "layers" / "attention.py").write_text("# edited\n", encoding="utf-8")
    assert processes.software_versions()["posjax source"] != here


def test_a_host_with_other_init_from_weights_is_one_error(tmp_path, monkeypatch):
    """The fingerprint of a converter-style folder: equal for a copy, different for another
    checkpoint (other file names or sizes) or none; a difference between processes is one
    error naming init_from."""
    source = tmp_path / "ckpt"
    (source / "params" / "d").mkdir(parents=True)
    (source / "params" / "d" / "a1b2").write_bytes(b"x" * 100)
    (source / "params" / "_METADATA").write_text("{}")
    (source / "model_config.json").write_text('{"hidden_size": 16}')
    fingerprint = processes.init_from_fingerprint(source)
    shutil.copytree(source, tmp_path / "copy")
    assert processes.init_from_fingerprint(tmp_path / "copy") == fingerprint
    (tmp_path / "copy" / "model_config.json").write_text('{"hidden_size": 32}')
    assert processes.init_from_fingerprint(tmp_path / "copy") != fingerprint
    shutil.copytree(source, tmp_path / "other")
    data = tmp_path / "other" / "params" / "d"
    (data / "a1b2").rename(data / "c3")   # another save: its files are named afresh
    assert processes.init_from_fingerprint(tmp_path / "other") != fingerprint
    assert processes.init_from_fingerprint(tmp_path / "missing") is None

    def change(value):
        value["init_from"] = None   # process 1 has no checkpoint under that path
    _second_process(monkeypatch, change)
    with pytest.raises(ValueError) as raised:
        processes.check_same_init_from(str(source))
    assert str(raised.value).startswith(
        f"the processes read different data:\n  process 1: init_from={str(source)!r} holds "
        "other weights than process 0's (none there)\nGive every host the same copy")
