"""bench.profile: the categories given to our compiled step's ops and to torch's, the thunk
times read from a trace, and the subcommand end to end at smoke size."""
import collections
import math
import re

import jax
import pytest

from bench import profile
from bench.workloads import OursTrainer, all_workloads


@pytest.fixture(scope="module")
def categorized():
    """{category: [instructions]} of the compiled smoke BERT-A MLM step (entry computation)."""
    w = next(w for w in all_workloads("smoke") if w.name == "study BERT-A")
    text = OursTrainer(w, compiler_options={"xla_backend_optimization_level": 0})._compiled
    cats, module = profile.categorize_module(text.as_text())
    comps, entry = profile.parse_hlo(text.as_text())
    by = collections.defaultdict(list)
    for inst in comps[entry]:
        by[cats[inst.name][0]].append(cats[inst.name][1])
    return by, module


def test_every_category_is_known_and_the_module_named(categorized):
    by, module = categorized
    assert module.startswith("jit_step")
    assert set(by) <= set(profile.CATEGORIES)


def test_products_are_split_into_dense_and_attention(categorized):
    by, _ = categorized
    dense = " ".join(i.op_name for i in by["dense matmuls"])
    attention = " ".join(i.op_name for i in by["attention matmuls"])
    for module in ("/query/", "/fc1/", "/fc2/", "attend/dot_general"):
        assert module in dense
    assert "bqhd,bkhd->bhqk" in attention and "/fc1/" not in attention


def test_elementwise_work_is_named_by_what_it_computes(categorized):
    by, _ = categorized
    assert any("/mlp/" in i.op_name for i in by["GELU"])
    assert all("norm" in i.op_name for i in by["LayerNorm"] if i.op_name)
    assert by["dropout RNG"] and by["AdamW"] and by["softmax"] and by["loss"]
    assert all("jvp(" not in i.op_name for i in by["AdamW"])
    assert all(i.opcode == "copy" for i in by["parameter copies"])


def test_thunk_times_share_wall_time_and_follow_asynchronous_ends():
    def event(ts, dur, op, run, tid=1):
        return {"ph": "X", "ts": ts, "dur": dur, "tid": tid,
                "args": {"hlo_module": "jit_step", "hlo_op": op, "run_id": run}}

    def end(ts, op):
        return {"ph": "X", "ts": ts, "dur": 0.0, "tid": 3, "name": f"end: {op}"}
    events = [event(0, 10, "while.1", "a"), event(1, 2, "body_add", "a"),   # nested: left out
              event(12, 4, "dot.1", "a"), event(12, 4, "add.2", "a", tid=2),  # side by side
              event(20, 1, "dot.3", "a"), end(30, "dot.3"),        # returns at 21, done at 30
              event(100, 5, "dot.1", "b"), event(106, 1, "dot.1", "b"),
              {"ph": "X", "ts": 0, "dur": 99, "tid": 1,
               "args": {"hlo_module": "jit_other", "hlo_op": "x", "run_id": "c"}}]
    runs, nested = profile.thunk_times(events, "jit_step")
    assert runs == [{"while.1": 10, "dot.1": 2, "add.2": 2, "dot.3": 10}, {"dot.1": 6}]
    assert nested == {"body_add"}


def test_products_are_read_from_the_hlo_and_timed_alone():
    """dot_signatures recovers each dot's operand shapes and dimension numbers, and
    time_products_alone counts their FLOPs: a batched product, one contracting the first
    dimension of both operands and a plain one."""
    def f(q, k, x, w, y, z):
        return (jax.numpy.einsum("bqd,bkd->bqk", q, k).sum() + (x.T @ w).sum()
                + jax.numpy.tanh(y @ z).sum())
    shapes = [(2, 8, 4), (2, 6, 4), (5, 7), (5, 3), (9, 11), (11, 13)]
    text = jax.jit(f).lower(*(jax.numpy.ones(s) for s in shapes)).compile().as_text()
    comps, entry = profile.parse_hlo(text)
    sigs = collections.Counter(s for inst in comps[entry]
                               for s in profile.dot_signatures(inst, comps,
                                                               profile.shape_index(comps)))
    assert sum(sigs.values()) == 3 and all(s[0] == "f32" for s in sigs)
    assert {(s[1], s[2]) for s in sigs} >= {((5, 7), (5, 3)), ((9, 11), (11, 13))}
    ms, gflop = profile.time_products_alone(sigs, repeats=2)
    expected = 2 * (2 * 8 * 6 * 4 + 7 * 3 * 5 + 9 * 13 * 11)
    assert sorted(map(profile.signature_flops, sigs)) == [2 * 7 * 3 * 5, 2 * 2 * 8 * 6 * 4,
                                                          2 * 9 * 13 * 11]
    assert ms > 0 and gflop == pytest.approx(expected / 1e9)
    assert sorted(map(profile.canonical_product, sigs)) == [(1, 7, 5, 3), (1, 9, 11, 13),
                                                            (2, 8, 4, 6)]
    torch_ms, torch_gflop = profile.time_products_torch(sigs, repeats=2)
    assert torch_ms > 0 and torch_gflop == pytest.approx(gflop)


def test_canonical_product_reads_batch_free_and_contracted_sizes():
    """A product with two batch axes, a contracting axis in the middle of each operand and
    two free axes on the left: the sizes torch's (batch, M, K)·(batch, K, N) needs."""
    signature = ("f32", (2, 5, 3, 7), (3, 5, 2, 4), ((2,), (0,), (0, 1), (2, 1)))
    assert profile.canonical_product(signature) == (10, 7, 3, 4)
    assert profile.signature_flops(signature) == 2 * 10 * 7 * 3 * 4


@pytest.mark.parametrize("options, kind", [
    ({}, "YNNPACK"),
    ({"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}, "XLA dot"),
    ({"xla_cpu_use_onednn": True,
      "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}, "oneDNN")])
def test_products_are_named_by_the_library_that_runs_them(options, kind):
    x = jax.numpy.ones((64, 32), "float32")
    text = jax.jit(lambda a, b: a @ b).lower(x, x.T).compile(options).as_text()
    comps, entry = profile.parse_hlo(text)
    products = [i for i in comps[entry] if any(j.opcode == "dot" for j in profile._inner(i, comps))]
    assert [profile.matmul_kind(i, comps) for i in products] == [kind]


@pytest.mark.parametrize("name, category", [
    ("aten::mm", "dense matmuls"), ("aten::addmm", "dense matmuls"),
    ("aten::bmm", "attention matmuls"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "fused attention"),
    ("aten::_softmax_backward_data", "softmax"), ("aten::native_layer_norm", "LayerNorm"),
    ("aten::gelu_backward", "GELU"), ("aten::bernoulli_", "dropout RNG"),
    ("aten::native_dropout_backward", "dropout apply"), ("aten::copy_", "transposes/copies"),
    ("aten::embedding_dense_backward", "embedding gather/scatter"),
    ("aten::_fused_adamw_", "AdamW"), ("aten::nll_loss_forward", "loss"),
    ("aten::add", "other elementwise"),
    ("autograd::engine::evaluate_function: MmBackward0", "framework overhead")])
def test_torch_ops_fall_in_the_same_categories(name, category):
    assert profile.torch_category(name) == category


def test_profile_subcommand_end_to_end(tmp_path, capsys):
    out = tmp_path / "profile.md"
    assert profile.main(["--smoke", "--models", "study BERT-A", "--steps", "2", "--top", "3",
                         "--out", str(out)]) == 0
    text = out.read_text()
    assert "### Where the step time goes: study BERT-A" in capsys.readouterr().out
    assert "### Where the step time goes: study BERT-A" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| dense matmuls |"))
    ours_ms, ours_pct, hf_ms = (float(v) for v in row.split("|")[2:5])
    assert ours_ms > 0 and 0 < ours_pct <= 100 and hf_ms > 0
    total = next(ln for ln in text.splitlines() if ln.startswith("| sum of ops |"))
    assert float(total.split("|")[3]) == pytest.approx(100)
    assert re.search(r"### Largest ops, ours: study BERT-A\n\n\| op \|", text)
    assert "ours: median over 2 traced steps; the fastest 2 of 4 traced steps;" in text
    def number(cell):   # "—": not known (HF's SDPA attention FLOPs are not counted)
        return float("nan") if cell.strip() == "—" else float(cell)

    products = {ln.split("|")[1].strip(): [number(v) for v in ln.split("|")[3:11]]
                for ln in text.split("### Matrix products alone and the rest: study BERT-A")[1]
                .splitlines() if ln.startswith(("| ours |", "| hf |"))}
    for wall, ms, gflop, rate, attention_ms, _, rest, rest_pct in products.values():
        rounding = 0.005 * (abs(wall) + abs(ms) + abs(rest))    # 3 significant digits each
        assert ms > 0 and gflop > 0 and rest == pytest.approx(wall - ms, abs=rounding)
        assert 0 < attention_ms < ms
    if math.isnan(products["hf"][5]):   # HF ran SDPA: its attention FLOPs are not counted
        assert products["hf"][2] < products["ours"][2]
    else:
        assert products["ours"][2] == pytest.approx(products["hf"][2], rel=0.1)   # same FLOPs
    torch_row = next(ln for ln in text.splitlines()
                     if ln.startswith("| torch | our products alone |")).split("|")[3:11]
    assert torch_row[0].strip() == torch_row[6].strip() == "—"    # no step of its own
    assert float(torch_row[1]) > 0 and float(torch_row[2]) == products["ours"][2]
    assert 0 < float(torch_row[4]) < float(torch_row[1])
    assert "Our products alone: XLA:CPU " in text
    assert "Load average before / after" in text


def test_profile_rejects_bad_command_lines(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--models", "GPT", "--frameworks", "jax"])
    err = capsys.readouterr().err
    assert "unknown ['GPT']" in err and "--frameworks='jax'" in err


def test_jax_trace_is_written_where_asked(tmp_path):
    """The profiler call the subcommand relies on writes a Perfetto trace with XLA ops."""
    f = jax.jit(lambda x: (x @ x).sum())
    x = jax.numpy.ones((64, 64))
    f(x).block_until_ready()
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    f(x).block_until_ready()
    jax.profiler.stop_trace()
    events = profile._trace_events(tmp_path)
    assert any((e.get("args") or {}).get("hlo_op") for e in events)
