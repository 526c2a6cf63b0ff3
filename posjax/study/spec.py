"""A study config (ml_collections, ``configs/study_*.py``) checked and expanded into cells.

A study is a grid: each entry of ``study.cells`` (a scheme or ablation: ``name``, ``scheme``,
optional ``model`` and ``train`` overrides) runs once per seed 1..``study.seeds``; every cell
has the same base training config (``study.base``: ``"path/to/config.py[:variant]"`` plus
``study.base_overrides``), so only the position scheme and the cell's overrides differ.

With ``study.sweep`` (``learning_rates``, ``metric``, ``better``), seed 1 of every entry first
runs at each rate (cells ``<name>-lr<rate>``); seeds 2.. (``<name>-s<seed>``) run at the rate
the sweep chose for the entry, and the sweep cell at that rate is the entry's seed 1. Cells are
ordered sweep first, then seed-major (seed 2 of every entry next), so a grid stopped part-way
has the same seeds of every scheme. ``check_study`` finds every problem before anything trains and raises one
``StudyConfigError`` naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re
from typing import Any

import ml_collections

from posjax.models.config import TEXT_SCHEMES, VIT_SCHEMES, TextConfig, ViTConfig
from posjax.models.params import SAME_FUNCTION_FIELDS
from posjax.models.schemes import SCHEMES, absolute_rows

KINDS = ("text", "vit")
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def scheme_presets(kind: str, scheme: str) -> dict[str, Any]:
    """The scheme's own settings on top of the base model: its row's ``presets`` in the
    scheme table (DeBERTa without absolute input positions, DeBERTa-v3's shared position keys
    and LayerNorm'd relative table). Everything else (token types, LayerNorm eps, dropout,
    sizes) is the base model's, the same for every entry."""
    row = SCHEMES.get(scheme)
    return dict(row.presets) if kind == "text" and row is not None else {}


def at_length(config: ml_collections.ConfigDict, length: int) -> ml_collections.ConfigDict:
    """``config`` reading held-out sequences of ``length`` tokens; an absolute table with
    fewer rows is read interpolated (``model.extend_positions='interpolate'``)."""
    out = config.copy_and_resolve_references()
    out.data.max_seq_length = length
    rows = table_rows(dict(out.model))
    if not rows:   # a table no layer reads: no rows to fit
        out.model.max_position_embeddings = 0
    with out.ignore_type():
        out.model.extend_positions = "interpolate" if rows and length > rows else ""
    if "length" in out.data:
        out.data.length = length
    return out


def table_rows(model: dict[str, Any]) -> int:
    """Positions the model can read: its absolute table's rows, or 0 for none (unbounded)."""
    return absolute_rows(TextConfig.from_dict(model))


class StudyConfigError(ValueError):
    """A study config that cannot run: every problem found, one per line."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One training run of the grid: entry ``name`` with ``seed``."""

    name: str                   # the grid entry (scheme or ablation)
    seed: int
    scheme: str
    model: dict[str, Any]       # the full model config of the primary run
    train: dict[str, Any]       # dotted train-config overrides of the entry
    pending: str = ""           # non-empty: not runnable (the reason), reported as such
    learning_rate: float | None = None   # the cell's rate (None: the base config's)
    sweep_chosen: bool = False  # learning_rate is the one the sweep chose for the entry

    @property
    def sweep(self) -> bool:
        """A learning-rate sweep cell (seed 1 at one rate of ``study.sweep.learning_rates``)."""
        return self.learning_rate is not None and not self.sweep_chosen

    @property
    def id(self) -> str:
        return f"{self.name}-lr{self.learning_rate:g}" if self.sweep else f"{self.name}-s{self.seed}"


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``path.py[:variant]`` -> its ``get_config(variant)``."""
    path, _, variant = spec.partition(":")
    file = pathlib.Path(path)
    if not file.is_file():
        raise StudyConfigError(f"config file {path!r} does not exist (from {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"_study_cfg_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()


def set_dotted(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """``config.a.b = value`` for ``key='a.b'``; the key must exist (else KeyError)."""
    *parents, last = key.split(".")
    node = config
    for p in parents:
        node = node[p]
    if last not in node:
        raise KeyError(key)
    with node.ignore_type():
        node[last] = value


def model_class(kind: str) -> type:
    return TextConfig if kind == "text" else ViTConfig


def known_schemes(kind: str) -> tuple[str, ...]:
    return TEXT_SCHEMES if kind == "text" else VIT_SCHEMES


def unread_fields(config: Any, overrides: dict[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    """(field, schemes that read it) for each override that is a setting of other position
    schemes only (``SAME_FUNCTION_FIELDS``): with this cell's scheme it would change nothing."""
    own = set(SAME_FUNCTION_FIELDS["*"]) | set(SAME_FUNCTION_FIELDS.get(config.position_scheme, ()))
    out = []
    for field in overrides:
        readers = tuple(s for s, fs in SAME_FUNCTION_FIELDS.items() if s != "*" and field in fs)
        if readers and field not in own:
            out.append((field, readers))
    return out


def _cell_model(kind: str, base_model: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    model = dict(base_model)
    model.update(scheme_presets(kind, entry["scheme"]))
    model["position_scheme"] = entry["scheme"]
    model.update(entry.get("model", {}))
    return model


def check_study(study: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, list[Cell]]:
    """(base train config, cells) of ``study``; one ``StudyConfigError`` listing every problem."""
    problems: list[str] = []
    kind = study.get("kind", "")
    if kind not in KINDS:
        raise StudyConfigError(f"study.kind={kind!r} is not valid: choose one of {', '.join(KINDS)}")
    seeds = study.get("seeds", 0)
    if not isinstance(seeds, int) or seeds < 1:
        problems.append(f"study.seeds={seeds!r}: must be an integer >= 1 (seeds 1..N run per cell)")
    try:
        base = load_config_file(study.base)
    except StudyConfigError as e:
        raise StudyConfigError(f"study.base={study.base!r}: {e}") from None
    for key, value in dict(study.get("base_overrides", {})).items():
        try:
            set_dotted(base, key, value)
        except KeyError:
            problems.append(f"study.base_overrides[{key!r}]: no such key in the base config "
                            f"{study.base!r}: remove it or fix its name")
    if kind == "vit" and not problems:
        problems += image_split_problems(study, base)
    rates, sweep_problems = sweep_rates(study)
    problems += sweep_problems
    base_model = dict(base.model)
    cls = model_class(kind)
    names: dict[str, int] = {}
    entries = [dict(e) for e in study.cells]
    if not entries:
        problems.append("study.cells is empty: list at least one cell (name, scheme)")
    cells: list[Cell] = []
    for i, entry in enumerate(entries):
        where = f"study.cells[{i}]"
        name = entry.get("name", "")
        if not isinstance(name, str) or not NAME.match(name):
            problems.append(f"{where}.name={name!r}: use letters, digits and _ (starting with a "
                            "letter)")
            continue
        where = f"study.cells[{i}] ({name!r})"
        if name in names:
            problems.append(f"{where}: duplicate cell name (also study.cells[{names[name]}]): "
                            "give every cell its own name")
            continue
        names[name] = i
        unknown = set(entry) - {"name", "scheme", "model", "train", "optional"}
        if unknown:
            problems.append(f"{where}: unknown key(s) {sorted(unknown)}: a cell has name, scheme, "
                            "model, train, optional")
        scheme = entry.get("scheme", "")
        pending = ""
        if scheme not in known_schemes(kind):
            if entry.get("optional"):
                pending = (f"scheme not available: position_scheme={scheme!r} is not in this "
                           f"posjax ({', '.join(known_schemes(kind))})")
            else:
                problems.append(f"{where}.scheme={scheme!r} is unknown: choose one of "
                                f"{', '.join(known_schemes(kind))} (or set optional=True to "
                                "list it as pending)")
                continue
        overrides = dict(entry.get("model", {}))
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(overrides) - fields)
        if bad:
            problems.append(f"{where}.model: unknown {cls.__name__} field(s) {bad}: fix the "
                            "name(s)")
            continue
        model = _cell_model(kind, base_model, entry)
        if not pending:
            try:
                config = cls(**model)
            except (ValueError, TypeError) as e:
                problems.append(f"{where}: {e}")
                continue
            for field, readers in unread_fields(config, overrides):
                problems.append(f"{where}.model.{field}={overrides[field]!r} has no effect with "
                                f"scheme {scheme!r} (only {', '.join(readers)} read it): remove "
                                "it or choose one of those schemes")
        train = dict(entry.get("train", {}))
        for key, value in train.items():
            try:
                set_dotted(base.copy_and_resolve_references(), key, value)
            except KeyError:
                problems.append(f"{where}.train[{key!r}]: no such key in the base config")
        for rate in rates:
            cells.append(Cell(name, 1, scheme, model, train, pending, learning_rate=rate))
        for seed in range(1 + bool(rates), (seeds if isinstance(seeds, int) else 0) + 1):
            cells.append(Cell(name, seed, scheme, model, train, pending))
    for i, claim in enumerate(study.get("claims", [])):
        for side in ("a", "b"):
            if claim.get(side) not in names:
                problems.append(f"study.claims[{i}].{side}={claim.get(side)!r} is not a cell "
                                f"name: use one of {', '.join(names)}")
        rule = claim.get("rule", "paired")
        if rule not in ("paired", "same", "convergence"):
            problems.append(f"study.claims[{i}].rule={rule!r}: use 'paired', 'same' or "
                            "'convergence'")
        elif rule == "same" and not (isinstance(claim.get("margin"), (int, float))
                                     and claim["margin"] > 0):
            problems.append(f"study.claims[{i}].margin={claim.get('margin')!r}: a 'same' claim "
                            "is an equivalence test; write its margin (> 0, in the metric's "
                            "units) in the config before the run")
    if problems:
        raise StudyConfigError("the study config cannot run:\n  " + "\n  ".join(problems))
    order = {rate: i for i, rate in enumerate(rates)}
    cells.sort(key=lambda c: (not c.sweep, order.get(c.learning_rate, 0), c.seed, names[c.name]))
    return base, cells


def sweep_rates(study: ml_collections.ConfigDict) -> tuple[list[float], list[str]]:
    """(``study.sweep.learning_rates``, problems): the rates seed 1 of every entry runs at;
    seeds 2.. then run at the entry's best (``study.sweep.metric``, ``study.sweep.better``)."""
    sweep = study.get("sweep", None)
    if not sweep:
        return [], []
    rates = list(sweep.get("learning_rates", []))
    problems = []
    if not rates or not all(isinstance(r, (int, float)) and r > 0 for r in rates) or len(
            set(rates)) < len(rates):
        problems.append(f"study.sweep.learning_rates={rates!r}: give distinct rates > 0, e.g. "
                        "[3e-4, 1e-3, 3e-3]")
    if not isinstance(sweep.get("metric"), str) or "." not in sweep.get("metric", ""):
        problems.append(f"study.sweep.metric={sweep.get('metric')!r}: name the result the rate "
                        "is chosen by, e.g. 'held_out.1.loss'")
    if sweep.get("better") not in ("lower", "higher"):
        problems.append(f"study.sweep.better={sweep.get('better')!r}: use 'lower' or 'higher'")
    return [float(r) for r in rates], problems


def image_split_problems(study: ml_collections.ConfigDict,
                         base: ml_collections.ConfigDict) -> list[str]:
    """The base config's image splits and the transfer's test split, opened before any cell
    trains: a bad one (e.g. a slice of a class-ordered file that drops classes) is one line."""
    from posjax.data import images

    checks = [("data.train_split", base.data.train_split),
              ("data.test_split", base.data.test_split)]
    transfer_split = study.get("transfer", {}).get("test_split")
    if transfer_split:
        checks.append(("study.transfer.test_split", transfer_split))
    try:
        images.validate_data_config(base.data)
    except ValueError as e:
        return [f"study.base {study.base!r} with study.base_overrides: {e}"]
    for name, spec in checks:
        try:
            source, selected = images.open_split(base.data, spec)
            images.check_classes_kept(source, selected, name=name, spec=spec)
        except ValueError as e:
            return [str(e) if str(e).startswith(name) else f"{name}={spec!r}: {e}"]
    return []


def baseline(study: ml_collections.ConfigDict) -> str:
    """The cell every other is compared with (``study.baseline``, default the first cell)."""
    return study.get("baseline", "") or study.cells[0]["name"]
