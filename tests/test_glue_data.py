"""GLUE readers (all nine layouts, real SST-2/CoLA/MRPC), bad rows, metrics, submission files."""
import pathlib

import numpy as np
import pytest

from posjax.data import glue
from posjax.data.common import utf8_lines

# Minimal files in the GLUE download layout (header rows exactly as distributed).
LAYOUT = {
    "CoLA/train.tsv": "gj04\t1\t\tGood sentence .\ngj04\t0\t*\tSentence bad .\n",
    "CoLA/test.tsv": "index\tsentence\n0\tA test .\n1\tAnother test .\n",
    "SST-2/train.tsv": "sentence\tlabel\ngreat film \t1\nawful \t0\n",
    "MRPC/train.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                      "1\t1\t2\tHe said \" yes .\tHe agreed .\n0\t3\t4\tA .\tB .\n",
    "QQP/train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                     "7\t1\t2\tWhy ?\tHow ?\t0\n9\t3\t4\tWhat ?\tWhat ?\t1\n",
    "QQP/test.tsv": "id\tquestion1\tquestion2\n5\tWhy ?\tHow ?\n",
    "STS-B/train.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1"
                       "\tsentence2\tscore\n0\tmain\tf\t2012\t1\tnone\tnone\tA man .\tA person ."
                       "\t4.250\n1\tmain\tf\t2012\t2\tnone\tnone\tCat .\tDog .\t0.000\n",
    "MNLI/train.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t"
                      "sentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\t"
                      "sentence2\tlabel1\tgold_label\n"
                      "0\t1\t1n\tgov\t(\t(\t(\t(\tP one .\tH one .\tneutral\tneutral\n"
                      "1\t2\t2c\tgov\t(\t(\t(\t(\tP two .\tH two .\tcontradiction\tcontradiction\n",
    "MNLI/dev_mismatched.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t"
                               "sentence2_binary_parse\tsentence1_parse\tsentence2_parse\t"
                               "sentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\t"
                               "gold_label\n0\t1\t1e\tx\t(\t(\t(\t(\tP .\tH .\tentailment\t"
                               "entailment\tneutral\tentailment\tentailment\tentailment\n",
    "diagnostic/diagnostic.tsv": "index\tsentence1\tsentence2\n0\tP .\tH .\n1\tQ .\tR .\n",
    "QNLI/train.tsv": "index\tquestion\tsentence\tlabel\n0\tWho ?\tHim .\tentailment\n"
                      "1\tWhere ?\tThere .\tnot_entailment\n",
    "RTE/train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tA .\tB .\tnot_entailment\n",
    "WNLI/train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tA .\tB .\t1\n",
}
EXPECTED = {  # task, split -> [(text, label, idx)]
    ("cola", "train"): [(("Good sentence .",), 1, 0), (("Sentence bad .",), 0, 1)],
    ("cola", "test"): [(("A test .",), None, 0), (("Another test .",), None, 1)],
    ("sst2", "train"): [(("great film",), 1, 0), (("awful",), 0, 1)],
    ("mrpc", "train"): [(('He said " yes .', "He agreed ."), 1, 0), (("A .", "B ."), 0, 1)],
    ("qqp", "train"): [(("Why ?", "How ?"), 0, 7), (("What ?", "What ?"), 1, 9)],
    ("qqp", "test"): [(("Why ?", "How ?"), None, 5)],
    ("stsb", "train"): [(("A man .", "A person ."), 4.25, 0), (("Cat .", "Dog ."), 0.0, 1)],
    ("mnli", "train"): [(("P one .", "H one ."), 1, 0), (("P two .", "H two ."), 2, 1)],
    ("mnli", "validation_mismatched"): [(("P .", "H ."), 0, 0)],
    ("mnli", "diagnostic"): [(("P .", "H ."), None, 0), (("Q .", "R ."), None, 1)],
    ("qnli", "train"): [(("Who ?", "Him ."), 0, 0), (("Where ?", "There ."), 1, 1)],
    ("rte", "train"): [(("A .", "B ."), 1, 0)],
    ("wnli", "train"): [(("A .", "B ."), 1, 0)],
}


@pytest.fixture()
def glue_dir(tmp_path) -> pathlib.Path:
    for name, content in LAYOUT.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content, encoding="utf-8")
    return tmp_path


def cfg_for(task, glue_dir, tokenizer="", **kw):
    cfg = glue.default_glue_data_config(task)
    cfg.glue_dir, cfg.tokenizer = str(glue_dir), str(tokenizer)
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("task,split", sorted(EXPECTED))
def test_all_layouts(task, split, glue_dir):
    examples, report = glue.read_split(cfg_for(task, glue_dir), split)
    assert [(e["text"], e["label"], e["idx"]) for e in examples] == EXPECTED[task, split]
    assert not report.bad_rows


def test_real_glue_files(shared_data):
    root = shared_data / "glue"
    counts = {("sst2", "validation"): 872, ("sst2", "test"): 1821, ("cola", "train"): 8551,
              ("cola", "validation"): 1043, ("cola", "test"): 1063, ("mrpc", "validation"): 408,
              ("mrpc", "train"): 3668}
    for (task, split), n in counts.items():
        examples, report = glue.read_split(cfg_for(task, root), split)
        assert len(examples) == n and not report.bad_rows and report.empty_lines == 0
    dev, _ = glue.read_split(cfg_for("cola", root), "validation")
    assert dev[-1]["text"][0].endswith(".")                  # no final newline: last row kept
    assert np.mean([e["label"] for e in dev]) == pytest.approx(721 / 1043)
    mrpc, _ = glue.read_split(cfg_for("mrpc", root), "validation")
    assert mrpc[0]["label"] == 1 and mrpc[0]["text"][1].startswith('" The foodservice')
    assert np.mean([e["label"] for e in mrpc]) == pytest.approx(279 / 408)
    sliced, _ = glue.read_split(cfg_for("sst2", root), "validation[:10%]")
    assert len(sliced) == 87


def test_pipeline_truncates_and_pads(shared_data):
    root = shared_data / "glue"
    vocab = shared_data / "bert-base-uncased-vocab" / "vocab.txt"
    cfg = cfg_for("mrpc", root, vocab, max_seq_length=24)
    p = glue.make_glue_pipeline(cfg, split="test", batch_size=64, seed=0, train=False,
                                shard_index=1, shard_count=3)
    batches = list(p.iterator)
    assert p.report.truncated > 300 and "examples truncated" in p.report.summary()
    assert len(batches) == p.num_batches == 3 and p.num_examples == 408
    assert sum(int(b["mask"].sum()) for b in batches) == 136
    b = batches[0]
    assert b["input_ids"].shape == (64, 24) and b["label"].dtype == np.int32
    for ids, types, att in zip(b["input_ids"], b["token_type_ids"], b["attention_mask"]):
        n = int(att.sum())
        seps = np.flatnonzero(ids[:n] == 102)
        assert ids[0] == 101 and len(seps) == 2 and seps[-1] == n - 1
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:n] == 1).all()
    # longest-first: pieces differ in length by at most one when both were cut
    assert glue.truncate_longest_first([1] * 9, [2] * 4, 8) == ([1] * 4, [2] * 4)
    assert glue.truncate_longest_first([1] * 3, [2] * 9, 8) == ([1] * 3, [2] * 5)
    # both cut: the odd token stays with the longer piece (b on ties), as in HF tokenizers
    assert glue.truncate_longest_first([1] * 14, [2] * 9, 13) == ([1] * 7, [2] * 6)
    assert glue.truncate_longest_first([1] * 9, [2] * 14, 13) == ([1] * 6, [2] * 7)
    assert glue.truncate_longest_first([1] * 9, [2] * 9, 13) == ([1] * 6, [2] * 7)
    assert glue.truncate_longest_first([1] * 2, [2] * 9, 8) == ([1] * 2, [2] * 6)
    stsb = glue.encode_examples([{"text": ("a", "b"), "label": 3.5, "idx": 0}],
                                glue.load_tokenizer(vocab), 16, True, glue.ReadReport("x"))
    assert stsb[0]["label"].dtype == np.float32 and stsb[0]["label"] == 3.5


@pytest.mark.parametrize("length", [16, 23])
def test_pairs_are_encoded_as_transformers_encodes_them(shared_data, length):
    """Real MRPC dev pairs cut to a short length (both sentences truncated, odd and even
    budgets): input ids, token types and mask equal BertTokenizer's."""
    transformers = pytest.importorskip("transformers")
    vocab = shared_data / "bert-base-uncased-vocab" / "vocab.txt"
    cfg = cfg_for("mrpc", shared_data / "glue", vocab, max_seq_length=length)
    examples, _ = glue.read_split(cfg, "validation")
    ours = glue.encode_examples(examples, glue.load_tokenizer(vocab), length, False,
                                glue.ReadReport("x"))
    hf = transformers.BertTokenizer(str(vocab), do_lower_case=True)(
        [e["text"][0] for e in examples], [e["text"][1] for e in examples],
        truncation="longest_first", max_length=length, padding="max_length")
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        np.testing.assert_array_equal(np.stack([o[key] for o in ours]), hf[key], err_msg=key)


def test_bad_rows_are_counted_or_refused(glue_dir):
    rows = "".join(f"fine sentence {i}\t{i % 2}\n" for i in range(300))
    (glue_dir / "SST-2" / "train.tsv").write_text(
        "sentence\tlabel\n" + rows + "\n\nthree\tcolumns\there\n" + rows, encoding="utf-8")
    examples, report = glue.read_split(cfg_for("sst2", glue_dir), "train")
    assert len(examples) == 600 and report.empty_lines == 2
    assert report.bad_rows == [(304, "3 columns, expected 2")]
    (glue_dir / "SST-2" / "train.tsv").write_text(
        "sentence\tlabel\n" + rows[:rows.index("fine sentence 100")] + "x\tpositive\ny\t2\n",
        encoding="utf-8")
    with pytest.raises(ValueError, match=r"2 bad rows.*line 102: label 'positive'.*more than 1%"):
        glue.read_split(cfg_for("sst2", glue_dir), "train")
    # The evaluated split keeps every row: its metrics must be those of the official set.
    (glue_dir / "SST-2" / "dev.tsv").write_text("sentence\tlabel\n" + rows + "z\t2\n",
                                                encoding="utf-8")
    assert len(glue.read_split(cfg_for("sst2", glue_dir), "validation")[0]) == 300
    with pytest.raises(ValueError, match=r"1 bad rows.*line 302: label '2'.*evaluated split "
                                         "must keep every row"):
        glue.read_split(cfg_for("sst2", glue_dir), "validation", evaluated=True)
    (glue_dir / "SST-2" / "train.tsv").write_text("sentence\tlabel\n" + rows)
    (glue_dir / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nfine\n")
    cfg = cfg_for("sst2", glue_dir, glue_dir / "vocab.txt", test_split="validation")
    glue.make_glue_pipeline(cfg, split="train", batch_size=8, seed=0, train=True)
    with pytest.raises(ValueError, match="evaluated split must keep every row"):
        glue.make_glue_pipeline(cfg, split="test", batch_size=8, seed=0, train=False)
    (glue_dir / "SST-2" / "dev.tsv").unlink()
    (glue_dir / "STS-B" / "train.tsv").write_text(
        LAYOUT["STS-B/train.tsv"] + "2\tm\tf\t2012\t3\tn\tn\tA\tB\tfive\n", encoding="utf-8")
    with pytest.raises(ValueError, match="could not convert string to float: 'five'"):
        glue.read_split(cfg_for("stsb", glue_dir), "train")
    (glue_dir / "QQP" / "test.tsv").write_text(
        LAYOUT["QQP/test.tsv"] + "6\tonly one column\n", encoding="utf-8")
    with pytest.raises(ValueError, match="test split must keep every row"):
        glue.read_split(cfg_for("qqp", glue_dir), "test")
    (glue_dir / "RTE" / "train.tsv").write_text("a\tb\n1\t2\n")
    with pytest.raises(ValueError, match=r"needs \['sentence1', 'sentence2', 'label'\]"):
        glue.read_split(cfg_for("rte", glue_dir), "train")
    with pytest.raises(ValueError, match="GLUE task 'squad' is unknown"):
        glue.default_glue_data_config("squad")
    cfg = cfg_for("sst2", glue_dir, tokenizer=glue_dir / "none.txt", test_split="dev",
                  max_seq_length=4)
    with pytest.raises(ValueError) as e:
        glue.validate_glue_data_config(cfg)
    for text in ("data.tokenizer=", "data.test_split='dev'", "data.max_seq_length=4"):
        assert text in str(e.value)
    with pytest.raises(ValueError, match="does not exist: set data.glue_dir"):
        glue.read_split(cfg_for("sst2", glue_dir), "validation")


def test_tsv_that_is_not_utf8_is_refused_with_its_line(glue_dir):
    """The decoder's own error gives a position within a read chunk and no file or line."""
    head = ("sentence\tlabel\n" + "".join(f"fine sentence {i}\t1\n" for i in range(900))).encode()
    (glue_dir / "SST-2" / "train.tsv").write_bytes(head + b"caf\xe9 au lait\t1\n")
    at = len(head) + 3
    with pytest.raises(ValueError, match=rf"SST-2/train.tsv: line 902, bytes {at}..{at + 1} "
                                         "are not valid UTF-8; convert the file to UTF-8"):
        glue.read_split(cfg_for("sst2", glue_dir), "train")
    # Lines end at \r too (as the reader counts them); offsets count a leading BOM.
    head = b"\xef\xbb\xbfsentence\tlabel\rgood\t1\r"
    (glue_dir / "SST-2" / "train.tsv").write_bytes(head + b"na\xefve\t0\r")
    at = len(head) + 2
    with pytest.raises(ValueError, match=rf"line 3, bytes {at}..{at + 1} are not valid UTF-8"):
        glue.read_split(cfg_for("sst2", glue_dir), "train")


def test_metrics_match_sklearn_and_scipy():
    from scipy import stats
    from sklearn import metrics

    rng = np.random.default_rng(0)
    for _ in range(5):
        y, p = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
        assert glue.accuracy(p, y) == pytest.approx(metrics.accuracy_score(y, p))
        assert glue.f1_score(p, y) == pytest.approx(metrics.f1_score(y, p))
        assert glue.matthews_corrcoef(p, y) == pytest.approx(metrics.matthews_corrcoef(y, p))
        a, b = rng.normal(size=100), rng.integers(0, 6, 100).astype(float)  # ties in b
        assert glue.pearson(a, b) == pytest.approx(stats.pearsonr(a, b)[0])
        assert glue.spearman(a, b) == pytest.approx(stats.spearmanr(a, b)[0])
    assert glue.matthews_corrcoef(np.ones(5), np.ones(5)) == 0.0
    out = glue.glue_metrics(glue.TASKS["mrpc"], np.array([1, 1, 0, 0]), np.array([1, 0, 0, 1]))
    assert out == {"f1": 0.5, "accuracy": 0.5, "score": 0.5}
    assert set(glue.glue_metrics(glue.TASKS["cola"], np.ones(3), np.ones(3))) == {"mcc", "score"}


def test_submission_files(tmp_path):
    mnli = glue.TASKS["mnli"]
    path = glue.write_submission(mnli, "test_mismatched", np.array([2, 0, 1]),
                                 np.array([2, 0, 1]), tmp_path)
    assert path.name == "MNLI-mm.tsv"
    assert path.read_text() == "index\tprediction\n0\tentailment\n1\tneutral\n2\tcontradiction\n"
    path = glue.write_submission(glue.TASKS["stsb"], "test", np.array([1, 0]),
                                 np.array([5.61, -0.2]), tmp_path)
    assert path.read_text() == "index\tprediction\n0\t0.000\n1\t5.000\n"
    path = glue.write_submission(glue.TASKS["cola"], "test", np.array([0, 1]), np.array([1, 0]),
                                 tmp_path)
    assert path.read_text() == "index\tprediction\n0\t1\n1\t0\n"
    assert glue.write_submission(mnli, "diagnostic", np.array([0]), np.array([0]),
                                 tmp_path).name == "AX.tsv"
    assert glue.write_submission(mnli, "validation_matched[:5]", np.array([0]), np.array([0]),
                                 tmp_path).name == "MNLI.validation_matched.tsv"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "AX.tsv", "CoLA.tsv", "MNLI-mm.tsv", "MNLI.validation_matched.tsv", "STS-B.tsv"]
    with pytest.raises(ValueError, match="duplicate example indices"):
        glue.write_submission(mnli, "test_matched", np.array([0, 0]), np.array([0, 1]), tmp_path)


def test_tfds_glue_source(shared_data):
    tfds = pytest.importorskip("tensorflow_datasets")
    vocab = shared_data / "bert-base-uncased-vocab" / "vocab.txt"
    with tfds.testing.mock_data(num_examples=10):
        for task, split in (("mnli", "validation_mismatched"), ("stsb", "train"),
                            ("qnli", "test"), ("mnli", "diagnostic")):
            cfg = glue.default_glue_data_config(task)
            cfg.tokenizer, cfg.test_split = str(vocab), split
            p = glue.make_glue_pipeline(cfg, split="test", batch_size=4, seed=0, train=False)
            batches = list(p.iterator)
            assert p.num_examples == 10 and len(batches) == 3
            label = np.concatenate([b["label"] for b in batches])
            assert label.dtype == (np.float32 if task == "stsb" else np.int32)
            assert p.labelled == (split not in ("test", "diagnostic"))
            if task == "mnli" and p.labelled:
                assert set(label.tolist()) <= {0, 1, 2}


def test_config_checks_keys_and_every_split_it_will_read(glue_dir):
    """Up front, before a run trains: a misspelt key, and a split whose TSV file is missing
    (the fixture's SST-2 has train.tsv only) or that TFDS cannot open."""
    tokenizer = glue_dir / "vocab.txt"
    tokenizer.write_text("[PAD]\n")
    cfg = cfg_for("sst2", glue_dir, tokenizer, test_split="train[:1]")
    glue.validate_glue_data_config(cfg)
    cfg.max_seq_lenght = 64
    with pytest.raises(ValueError, match=r"unknown key\(s\) data.max_seq_lenght.*valid keys "
                                         r"are .*max_seq_length"):
        glue.validate_glue_data_config(cfg)
    cfg = cfg_for("sst2", glue_dir, tokenizer)
    dev = glue_dir / "SST-2" / "dev.tsv"
    with pytest.raises(ValueError, match=f"data.test_split='validation': GLUE file "
                                         f"'{dev}' does not exist"):
        glue.validate_glue_data_config(cfg)
    cfg = cfg_for("sst2", "", tokenizer, data_dir=str(glue_dir / "no_tfds_here"))
    with pytest.raises(ValueError, match=r"(?s)data.train_split='train': TFDS 'glue/sst2' "
                                         r"split 'train' could not be opened"):
        glue.validate_glue_data_config(cfg)


def test_atomic_writes_get_the_usual_permissions(tmp_path):
    """Files replaced atomically (config.json, eval JSON, submissions) are 0666 less the umask,
    as a plain open() makes them: readable by others on shared storage (mkstemp gave 0600)."""
    import os
    from posjax.io_utils import write_text_atomically
    old = os.umask(0o022)
    try:
        write_text_atomically(tmp_path / "a.json", "{}\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").read_text() == "{}\n"
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_an_atomic_write_removes_the_temporary_file_of_a_killed_writer(tmp_path):
    """A writer SIGKILLed mid-write leaves ``.<name>.<host>.<pid namespace>.<pid>.tmp``; the
    next write of that file removes it, and keeps the one of a writer still at work, of
    another PID namespace, and those of other files."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    from posjax.io_utils import write_text_atomically
    hang = ("import sys, time, pathlib; from posjax.io_utils import write_atomically; "
            "write_atomically(pathlib.Path(sys.argv[1]), "
            "lambda tmp: (tmp.write_text('partial'), time.sleep(600)))")
    writers = [subprocess.Popen([sys.executable, "-c", hang, str(tmp_path / name)])
               for name in ("a.json", "a.json", "b.json")]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob(".*.tmp"))) < 3:
            assert time.monotonic() < deadline, "the writers did not start"
            time.sleep(0.05)
        for killed in (writers[0], writers[2]):
            killed.send_signal(signal.SIGKILL)
            killed.wait()
        # A writer in another PID namespace (a container sharing the host name): its pid
        # means nothing here, so its file is kept.
        host, ours = socket.gethostname(), os.stat("/proc/self/ns/pid").st_ino
        (tmp_path / f".a.json.{host}.1.{writers[0].pid}.tmp").write_text("")
        (tmp_path / f".a.json.{host}.{ours}.{writers[2].pid}.tmp").write_text("")   # ours: gone
        write_text_atomically(tmp_path / "a.json", "{}\n")
        left = sorted(p.name.rsplit(".", 2)[-2] for p in tmp_path.glob(".*.tmp"))
        assert left == sorted([str(writers[1].pid), str(writers[2].pid),
                               str(writers[0].pid)])   # a's live, b's, a's other namespace
        assert (tmp_path / "a.json").read_text() == "{}\n"
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()


def test_tsv_that_changes_while_it_is_read_is_one_error(tmp_path):
    """A decode error the file no longer shows when read again (it changed meanwhile) is still
    one ValueError naming the file, not the decoder's bare error."""
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\nfine\t1\n", encoding="utf-8")

    def lines_then_bad_byte():
        yield "sentence\tlabel\n"
        raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid continuation byte")
    with pytest.raises(ValueError, match=rf"^{path}: was not valid UTF-8 while it was read"):
        list(utf8_lines(lines_then_bad_byte(), path))
