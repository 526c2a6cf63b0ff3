"""The scheme table (posjax/models/schemes.py) is the one place where a scheme's name decides
anything: elsewhere code reads the scheme's row (its columns and properties), never compares a
scheme variable with a scheme-name literal. And the table's columns agree with what the
modules built from them compute."""
from __future__ import annotations

import ast
import pathlib

import pytest

from posjax.convert import HF_MODEL_TYPES, hf_deberta, hf_vit
from posjax.convert.pretrained import KINDS
from posjax.models.schemes import ALIASES, HF_SCHEMES, INPUTS, SCHEMES, TERMS, TEXT_SCHEMES

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = sorted([*(ROOT / "posjax").rglob("*.py"), *(ROOT / "bench").rglob("*.py"),
                  ROOT / "train.py", ROOT / "eval.py"])
TABLE = ROOT / "posjax" / "models" / "schemes.py"

# Other vocabularies that share words with the scheme names: a literal compared with an
# operand whose last name is the key is a word of that vocabulary (the scheme table's own
# ``input`` and ``terms`` columns; a model's kind, posjax.convert.pretrained.KINDS), not a
# scheme name.
OTHER_VOCABULARIES = {"input": INPUTS, "terms": TERMS, "kind": KINDS}

# (file, the other operand as written, literal): comparisons that are not about a position
# scheme although the literal spells one. Keep it short; each entry says why.
ALLOWED = {
    # The layer benchmark's own labels (its SCHEMES: content, t5, tupe, deberta): which bare
    # attention layer to time, not a model's position_scheme.
    ("bench/long_attention.py", "self.scheme", "deberta"),
    # Workload.hf: the Hugging Face reference model a workload is timed against (bert,
    # deberta_v2, vit), which picks the transformers class, not a posjax position scheme.
    ("bench/workloads.py", "w.hf", "deberta_v2"),
    ("bench/workloads.py", "w.hf", "vit"),
}


def _literals(node: ast.AST) -> list[str]:
    """The string constants of ``node``: itself, or the items of a tuple/list/set display."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for item in node.elts for v in _literals(item)]
    return []


def _last_name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def scheme_literal_decisions(source: str, rel: str) -> list[tuple[int, str, str]]:
    """(line, other operand, literal) for every scheme-name literal in ``source`` (the file
    ``rel``, relative to the repository) that is an operand of ==, !=, in, not in, a literal
    ``match`` pattern, or the argument of str.startswith/endswith: a scheme's name deciding
    logic."""
    found = []

    def check(literal_side: ast.AST, other: ast.AST, line: int) -> None:
        words = OTHER_VOCABULARIES.get(_last_name(other), ())
        for value in _literals(literal_side):
            if value in SCHEMES and value not in words and (
                    rel, ast.unparse(other), value) not in ALLOWED:
                found.append((line, ast.unparse(other), value))

    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for a, b in zip(operands, operands[1:]):
                check(a, b, node.lineno)
                check(b, a, node.lineno)
        elif isinstance(node, ast.Match):
            for case in node.cases:
                for pattern in ast.walk(case.pattern):
                    if isinstance(pattern, ast.MatchValue):
                        check(pattern.value, node.subject, pattern.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and node.args):
            check(node.args[0], node.func.value, node.lineno)
    return sorted(found)


def test_no_scheme_name_decides_logic_outside_the_table() -> None:
    bad = []
    for path in SCANNED:
        if path != TABLE:
            rel = path.relative_to(ROOT).as_posix()
            bad += [f"{rel}:{line}: {other} vs {value!r}"
                    for line, other, value in scheme_literal_decisions(path.read_text(), rel)]
    assert not bad, ("a scheme-name literal decides logic outside posjax/models/schemes.py; "
                     "read a column or property of the scheme's row instead:\n"
                     + "\n".join(bad))


def test_the_literal_check_sees_what_it_should() -> None:
    source = ("if cfg.position_scheme == 'deberta': pass\n"
              "v2 = 'deberta_v2' != scheme\n"
              "if s in ('rope', 'alibi'): pass\n"
              "if name.startswith('deberta'): pass\n"
              "match scheme:\n    case 'nope': pass\n"
              "if row.input == 'sincos2d' or 'alibi' in row.terms or kind == 'vit': pass\n"
              "if scheme == 'hf_deberta_v2' or w.hf == 'vit': pass\n"
              "table = {'deberta': 1}; f(position_scheme='deberta')\n")
    found = scheme_literal_decisions(source, "posjax/probe.py")
    assert sorted((line, value) for line, _, value in found) == [
        (1, "deberta"), (2, "deberta_v2"), (3, "alibi"), (3, "rope"), (4, "deberta"),
        (6, "nope"), (8, "vit")]
    # The allow-list is per file: the same comparison in bench/workloads.py is allowed.
    assert max(line for line, _, _ in scheme_literal_decisions(source, "bench/workloads.py")) == 6


def test_allow_list_entries_are_all_used() -> None:
    """An entry whose comparison has gone is removed, so the list stays the short truth."""
    seen = set()
    for rel, other, value in ALLOWED:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(ast.unparse(o) == other for o in operands) and any(
                        value in _literals(o) for o in operands):
                    seen.add((rel, other, value))
    assert seen == ALLOWED


# --- the columns ---------------------------------------------------------------------------

def test_deberta_version_marks_exactly_the_disentangled_schemes() -> None:
    for name, row in SCHEMES.items():
        assert row.deberta_version in (0, 1, 2), name
        assert (row.deberta_version > 0) == row.disentangled, name
    versions = sorted(row.deberta_version for row in SCHEMES.values() if row.disentangled)
    assert versions == [1, 2]
    # Only v2 reads v2's options (log buckets, shared keys, the relative table's LayerNorm).
    for row in SCHEMES.values():
        if row.disentangled:
            assert ("position_buckets" in row.fields) == (row.deberta_version == 2), row.name


def test_hf_model_types_round_trip() -> None:
    table = HF_SCHEMES
    assert len(table) == len([r for r in SCHEMES.values() if r.hf_model_type])   # one row each
    for model_type, name in table.items():
        assert SCHEMES[name].hf_model_type == model_type
    # Every HF model type is imported by exactly one converter, which speaks the scheme.
    assert set(hf_deberta.MODEL_TYPES) | set(hf_vit.MODEL_TYPES) == set(table)
    assert not set(hf_deberta.MODEL_TYPES) & set(hf_vit.MODEL_TYPES)
    assert set(HF_MODEL_TYPES) == set(table)
    assert hf_deberta.MODEL_TYPES == {"deberta": "deberta", "deberta-v2": "deberta_v2"}
    assert hf_vit.MODEL_TYPES == {"vit": "vit"}
    assert all(SCHEMES[n].disentangled for n in hf_deberta.MODEL_TYPES.values())
    assert set(hf_deberta.HF_DEFAULTS) == set(hf_deberta.MODEL_TYPES)


def test_presets_are_the_study_presets() -> None:
    """The study's grid puts a scheme's presets on its base model (spec.scheme_presets)."""
    from posjax.study.spec import scheme_presets
    for name, row in SCHEMES.items():
        if row.text:
            assert scheme_presets("text", name) == dict(row.presets), name
        assert scheme_presets("vit", name) == {}, name


@pytest.mark.parametrize("name", TEXT_SCHEMES)
def test_recipe_model_carries_presets_and_recipe_columns(name: str) -> None:
    from configs.text_recipes import text_model
    recipe_name = {v: k for k, v in ALIASES.items()}.get(name, name)
    for size in ("tiny", "base"):
        model = text_model(recipe_name, size, 128)
        for field, value in SCHEMES[name].presets + SCHEMES[name].recipe:
            assert model[field] == value, (name, field)


def test_preset_fields_are_model_fields() -> None:
    import dataclasses

    from posjax.models.config import TextConfig
    fields = {f.name for f in dataclasses.fields(TextConfig)}
    for row in SCHEMES.values():
        keys = [k for k, _ in row.presets + row.recipe]
        assert set(keys) <= fields and len(keys) == len(set(keys)), row.name
