"""Run one cell of a study (its train.py workdirs) and write its results files.

Workdirs (each an ordinary train.py workdir: it resumes, eval.py works on it):
``cells/<cell>/`` the main run (MLM or image classification), and for its follow-ups
``cells/<cell>+glue_<task>/`` (GLUE from the main run's encoder, ``init_from``),
``cells/<cell>+synth_<task>/`` (synthetic position task), ``cells/<cell>+ft<px>/`` (ViT
fine-tuned at another resolution). A follow-up that fails is recorded in ``stage_errors`` and
the cell goes on; a main run that fails makes the cell ``failed``.

Results: ``results/<cell>.json`` (final metrics, step time, params, config summary,
follow-ups) and ``results/<cell>_curve.csv`` (step, train loss, held-out metrics), and
``results/<cell>_analysis.json`` (position analyses of seed 1). The report reads only these.
"""
from __future__ import annotations

import csv
import json
import os
import pathlib
import socket
import time
import traceback
from typing import Any

import ml_collections
import numpy as np

from posjax.models.schemes import SCHEMES, scheme_of
from posjax.study import analysis, held_out, runner, synthetic
from posjax.study.spec import Cell, at_length, load_config_file, set_dotted


def cell_dir(root: pathlib.Path, cell_id: str, stage: str = "") -> pathlib.Path:
    return root / "cells" / (cell_id + (f"+{stage}" if stage else ""))


def results_dir(root: pathlib.Path) -> pathlib.Path:
    return root / "results"


def results_file(root: pathlib.Path, cell_id: str) -> pathlib.Path:
    return results_dir(root) / f"{cell_id}.json"


def write_json(path: pathlib.Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=_jsonable))
    os.replace(tmp, path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, (tuple, np.ndarray)):
        return list(x)
    return str(x)


def write_analysis(root: pathlib.Path, cell_id: str, arrays: dict[str, np.ndarray]) -> None:
    """``results/<cell>_analysis.json``: arrays as nested lists (5 significant digits)."""
    def plain(a: np.ndarray) -> Any:
        a = np.asarray(a)
        return a.tolist() if a.dtype.kind in "US" else np.vectorize(
            lambda x: float(f"{x:.5g}"))(a).tolist()
    write_json(results_dir(root) / f"{cell_id}_analysis.json",
               {k: plain(v) for k, v in arrays.items()})


def main_config(base: ml_collections.ConfigDict, cell: Cell) -> ml_collections.ConfigDict:
    config = base.copy_and_resolve_references()
    with config.ignore_type():
        config.model = dict(cell.model)
        config.seed = cell.seed
    for key, value in cell.train.items():
        set_dotted(config, key, value)
    if cell.learning_rate is not None:
        config.optimizer.learning_rate = cell.learning_rate
    return config


def _override(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        set_dotted(config, key, value)


def glue_config(study: Any, main: ml_collections.ConfigDict, task: str, init_from: pathlib.Path
                ) -> ml_collections.ConfigDict:
    config = load_config_file(f"{study.glue.config}:{task}")
    with config.ignore_type():
        config.model = {**dict(main.model), "use_emd": False}
        config.init_from = str(init_from)
        config.seed = main.seed
    _override(config, dict(study.glue.get("overrides", {})))
    return config


def synth_config(study: Any, main: ml_collections.ConfigDict, task: str, length: int
                 ) -> ml_collections.ConfigDict:
    """The main run's model and optimizer on a synthetic task of sequences of ``length``."""
    config = main.copy_and_resolve_references()
    data = synthetic.default_data_config(task, length)
    model = dict(main.model)
    model["vocab_size"] = synthetic.vocab_size(data)
    if model.get("max_position_embeddings", 0):
        model["max_position_embeddings"] = length
    if SCHEMES[model["position_scheme"]].disentangled:
        model["max_relative_positions"] = length
    with config.ignore_type():
        config.task = synthetic.PositionSynth.name
        config.data = data
        config.model = model
    _override(config, dict(study.synthetic.get("overrides", {})))
    return config


def length_results(config: ml_collections.ConfigDict, params: Any, length: int,
                   factors: list[int], max_batches: int | None) -> dict[str, Any]:
    """Held-out metrics at length·f for each factor (an absolute table interpolated beyond
    its rows: ``extended``)."""
    out: dict[str, Any] = {}
    for f in factors:
        c = at_length(config, length * f)
        out[str(f)] = {"length": length * f, "extended": bool(c.model.extend_positions),
                       **runner.evaluate_params(c, params, max_batches)}
    return out


def _config_summary(config: ml_collections.ConfigDict) -> dict[str, Any]:
    m = config.model
    keys = ("position_scheme", "hidden_size", "num_layers", "num_heads", "mlp_dim",
            "max_position_embeddings", "use_emd", "pos_att_type", "tie_cls", "image_size",
            "patch_size", "resnet_layers", "pooling", "position_biased_input")
    return {"model": {k: m[k] for k in keys if k in m}, "task": config.task,
            "num_steps": config.num_steps, "batch_size": config.batch_size,
            "learning_rate": config.optimizer.learning_rate,
            "seq_len": config.data.get("max_seq_length", None)}


def write_curve(path: pathlib.Path, rows: list[dict[str, float]]) -> None:
    keys = ["step", "train_loss"] + sorted({k for r in rows for k in r} - {"step", "train_loss"})
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})


class Stages:
    """The follow-up stages of a cell: ``errors`` (stage -> message) and ``seconds`` (stage ->
    wall time; a stage run twice adds up)."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn, *args) -> Any:
        """``fn(*args)``, timed; an exception is recorded under ``name`` (None returned)."""
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:   # noqa: BLE001 - a follow-up failure must not end the grid
            self.errors[name] = f"{type(e).__name__}: {e}"
            return None
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def _train_stage(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict[str, Any]:
    done = runner.finished_eval(workdir, int(config.num_steps))
    if done is None:
        result = runner.train(config, workdir)
        if result.preempted:
            raise KeyboardInterrupt(f"{workdir} stopped at step {result.step}")
        done = dict(result.eval)
    return {k: v for k, v in done.items() if k not in ("step", "split")}


def run_cell(root: pathlib.Path, study: Any, base: ml_collections.ConfigDict, cell: Cell
             ) -> dict[str, Any]:
    """Train every stage of ``cell`` (resuming), write its results files, return the record."""
    record: dict[str, Any] = {"cell": cell.id, "name": cell.name, "seed": cell.seed,
                              "scheme": cell.scheme, "kind": study.kind, "status": "ok",
                              "host": socket.gethostname(), "pid": os.getpid(),
                              "sweep": cell.sweep, "provenance": provenance()}
    config = main_config(base, cell)
    record["learning_rate"] = float(config.optimizer.learning_rate)
    record["config"] = _config_summary(config)
    record["configs"] = {"main": config.to_dict()}
    workdir = cell_dir(root, cell.id)
    started = time.perf_counter()
    try:
        record["final"] = _train_stage(config, workdir)
        record["train_s"] = time.perf_counter() - started
    except KeyboardInterrupt:
        raise
    except Exception as e:   # noqa: BLE001 - reported as a failed cell, the grid goes on
        record.update(status="failed", error=f"{type(e).__name__}: {e}",
                      traceback=traceback.format_exc(limit=4)[-2000:])
        write_json(results_file(root, cell.id), record)
        return record
    records = runner.metrics(workdir)
    record["step_time_s"] = runner.step_time(records)
    rdir = results_dir(root)
    rdir.mkdir(parents=True, exist_ok=True)
    write_curve(rdir / f"{cell.id}_curve.csv", runner.curve(records))
    stages = Stages()
    params = stages.run("params", runner.load_params, workdir)
    if params is not None:
        record["params"] = runner.param_count(params)
        record["position_movement"] = stages.run(
            "position_movement", lambda: analysis.position_movement(
                runner.initial_params(config), params))
        if study.kind == "text" and study.get("held_out"):
            record["held_out"] = stages.run("held_out", held_out.evaluate, config, params,
                                            list(study.held_out.factors),
                                            int(study.held_out.draws))
    if params is None or not follows_up(study, cell):
        pass   # follow-ups (GLUE, synthetic, transfer): the first follow_up_seeds seeds only
    elif study.kind == "text":
        _text_follow_ups(root, study, config, cell, params, record, stages)
    else:
        _vit_follow_ups(root, study, config, cell, params, record, stages)
    if params is not None and study.get("analysis", True) and first_follow_up(study, cell):
        analyse = _text_analysis if study.kind == "text" else _vit_analysis
        stages.run("analysis", analyse, root, config, cell, params)
    record["stage_errors"] = stages.errors
    record["stage_s"] = stages.seconds
    record["wall_s"] = time.perf_counter() - started
    write_json(results_file(root, cell.id), record)
    return record


def follows_up(study: Any, cell: Cell) -> bool:
    """Whether ``cell`` runs the follow-ups: not a sweep cell (its rate may not be chosen),
    and a seed <= ``study.follow_up_seeds`` (default every seed)."""
    return not cell.sweep and cell.seed <= study.get("follow_up_seeds", 10**6)


def first_follow_up(study: Any, cell: Cell) -> bool:
    """The seed whose params the analyses plot: the first seed that is not a sweep cell."""
    return not cell.sweep and cell.seed == (2 if study.get("sweep") else 1)


def provenance() -> dict[str, Any]:
    """The git commit of the posjax checkout running the cell, and whether tracked files
    differed from it ('unknown' outside a git checkout)."""
    import subprocess

    here = pathlib.Path(__file__).resolve().parents[2]
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True,
                                  timeout=30, check=True).stdout.strip()
        return {"git_commit": git("rev-parse", "HEAD"),
                "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": None}


def _text_follow_ups(root: pathlib.Path, study: Any, config: ml_collections.ConfigDict,
                     cell: Cell, params: Any, record: dict[str, Any], stages: Stages
                     ) -> None:
    record["glue"] = {}
    for task in study.get("glue", {}).get("tasks", []):
        def glue(task=task):
            c = glue_config(study, config, task, cell_dir(root, cell.id))
            record["configs"][f"glue_{task}"] = c.to_dict()
            return _train_stage(c, cell_dir(root, cell.id, f"glue_{task}"))
        if (r := stages.run(f"glue_{task}", glue)) is not None:
            record["glue"][task] = r
    synth = study.get("synthetic", {})
    record["synthetic"] = {}
    for task in synth.get("tasks", []):
        def run_synth(task=task):
            c = synth_config(study, config, task, int(synth.length))
            record["configs"][f"synth_{task}"] = c.to_dict()
            wd = cell_dir(root, cell.id, f"synth_{task}")
            _train_stage(c, wd)
            write_curve(results_dir(root) / f"{cell.id}+synth_{task}_curve.csv",
                        runner.curve(runner.metrics(wd)))
            return length_results(c, runner.load_params(wd), int(synth.length),
                                  list(synth.get("factors", [1, 2, 4])), None)
        if (r := stages.run(f"synth_{task}", run_synth)) is not None:
            record["synthetic"][task] = r


def _text_analysis(root: pathlib.Path, config: ml_collections.ConfigDict, cell: Cell,
                   params: Any) -> None:
    from posjax.models.config import TextConfig

    model = TextConfig.from_dict(dict(config.model))
    length = min(64, int(config.data.max_seq_length))
    arrays: dict[str, np.ndarray] = {}
    if scheme_of(model).input_positions_only:   # BERT-A: TUPE Fig. 2's four terms
        task, _ = runner.build(config)
        batch = next(iter(task.make_pipeline("test", 1, 0, False, 0, 1).dataset))
        ids = np.asarray(batch["input_ids"][0, :length])
        for k, v in analysis.bert_terms(params, ids, model.num_heads).items():
            arrays[f"bert_terms/{k}"] = v
    if scheme_of(model).untied and "mixed" not in scheme_of(model).terms:   # TUPE-A/R
        maps, labels = analysis.tupe_position_maps(params, model, length)
        arrays["tupe_maps"] = maps
        arrays["tupe_labels"] = np.array(labels)
    if arrays:
        write_analysis(root, cell.id, arrays)


def _vit_follow_ups(root: pathlib.Path, study: Any, config: ml_collections.ConfigDict,
                    cell: Cell, params: Any, record: dict[str, Any], stages: Stages
                    ) -> None:
    from posjax.layers.positions import resample_position_table

    transfer = study.get("transfer", {})
    size = int(config.model.image_size if isinstance(config.model.image_size, int)
               else config.model.image_size[0])
    record["transfer"] = {}

    def finetune(n: int) -> dict[str, Any]:
        """``transfer.finetune_steps`` steps at ``n`` px from the cell's checkpoint."""
        c = at_size(config, n)
        with c.ignore_type():
            c.init_from = str(cell_dir(root, cell.id))
        _override(c, dict(transfer.get("finetune_overrides", {})))
        c.num_steps = int(transfer.finetune_steps)
        record["configs"][f"ft{n}"] = c.to_dict()
        return _train_stage(c, cell_dir(root, cell.id, f"ft{n}"))

    for new in transfer.get("sizes", []):
        def at_size(c: ml_collections.ConfigDict, n: int = new) -> ml_collections.ConfigDict:
            out = c.copy_and_resolve_references()
            with out.ignore_type():
                out.model.image_size = n
                out.data.image_size = n
            out.data.test_split = transfer.get("test_split") or out.data.test_split
            return out

        entry: dict[str, Any] = {}
        if "pos_embedding" in params:
            patch = config.model.patch_size
            patch = patch if isinstance(patch, int) else patch[0]
            from posjax.models.config import stem_stride
            stride = patch * stem_stride(tuple(config.model.get("resnet_layers", ())))
            old, grid = size // stride, new // stride
            prefix = params["pos_embedding"].shape[1] - old * old
            for method in transfer.get("methods", ["bilinear", "bicubic"]):
                table = np.asarray(resample_position_table(params["pos_embedding"], (old, old),
                                                           (grid, grid), prefix, method))
                p = {**params, "pos_embedding": table}
                r = stages.run(f"transfer_{new}_{method}", runner.evaluate_params,
                               at_size(config), p)
                if r is not None:
                    entry[method] = r
        elif "tupe_bias" in params.get("encoder", {}):
            entry["as_is"] = {"reason": "TUPE's untied table is tied to the grid: fine-tuned "
                                        "column only (init_from resamples it)"}
        else:
            r = stages.run(f"transfer_{new}", runner.evaluate_params, at_size(config),
                           params)
            if r is not None:
                entry["as_is"] = r
        if transfer.get("finetune_steps", 0):
            r = stages.run(f"finetune_{new}", finetune, new)
            if r is not None:
                entry["finetuned"] = r
        record["transfer"][str(new)] = entry
    if transfer.get("finetune_steps", 0) and transfer.get("sizes"):
        # The equal-steps control: the same fine-tune at the training resolution.
        r = stages.run(f"finetune_{size}", finetune, size)
        if r is not None:
            record["transfer_control"] = {"size": size, "steps": int(transfer.finetune_steps),
                                          "finetuned": r}


def _vit_analysis(root: pathlib.Path, config: ml_collections.ConfigDict, cell: Cell,
                  params: Any) -> None:
    """The learned table's similarity maps (ViT Fig. 7), for a model that has one."""
    from posjax.models.config import stem_stride

    if "pos_embedding" not in params:
        return
    size = config.model.image_size
    size = size if isinstance(size, int) else size[0]
    patch = config.model.patch_size
    patch = patch if isinstance(patch, int) else patch[0]
    g = size // (patch * stem_stride(tuple(config.model.get("resnet_layers", ()))))
    table = np.asarray(params["pos_embedding"])
    sim = analysis.vit_similarity(table, (g, g), table.shape[1] - g * g)
    write_analysis(root, cell.id, {"vit_similarity": sim})
