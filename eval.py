"""Evaluate a checkpoint: python eval.py --workdir DIR [--config.eval_step=N] [--config.a.b=v ...]

Reads the config train.py saved in the workdir (configs/saved.py:DIR) unless --config names
another file; ``--config.*`` overrides apply on top of it. Evaluation may change only how and
where it reads its data and on which devices (mesh, batch sizes, data paths and splits:
``run_config.EVAL_KEYS``); a config that differs from the run's config.json in any other key is
refused. It evaluates the newest intact checkpoint and says which step it used (a damaged newer
step is named and skipped), or the step ``--config.eval_step=N`` picks (``--step N`` is the
same); a step that is not saved or is damaged is one error listing the intact steps. It reads
data.test_split and writes DIR/checkpoints/eval_<step>_<split>.json (e.g. eval_800_test.json;
another --config.data.test_split writes its own file, and so does other data than the run's:
eval_<step>_<split>_data-<hash>.json, which records the data it read); the JSON it prints
names the step.

    python eval.py --config configs/X.py --config.init_from=CKPT --workdir NEW_DIR

evaluates pretrained weights as they are (a converter folder or another run's workdir) on the
recipe's data, as step 0 (NEW_DIR/checkpoints/eval_0_<split>.json): every parameter of the
model must come from CKPT, heads included, and config.model must compute what CKPT's model did.
"""
import json
import pathlib
import re
import sys

from absl import app, flags, logging

from posjax import cli
from posjax.training import evaluator, hosts

SAVED_CONFIG = pathlib.Path(__file__).resolve().parent / "configs" / "saved.py"

cli.define_config_flag(None, "Config file[:variant] (default: the workdir's, "
                              "configs/saved.py:WORKDIR).")
flags.DEFINE_string("workdir", None, "Directory train.py wrote.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step: the same as --config.eval_step=N "
                     "(default: the newest intact step).")


def with_saved_config(argv: list[str]) -> list[str]:
    """``argv`` with ``--config=configs/saved.py:WORKDIR`` put first when no --config file is
    given, so that ``--config.*`` overrides apply to the workdir's saved config."""
    if any(re.match(r"^--?config(=|$)", a) for a in argv[1:]):
        return argv
    first = flags.FlagValues()
    flags.DEFINE_string("workdir", None, "", flag_values=first)
    try:
        first(argv, known_only=True)
    except flags.Error:
        return argv             # the full parse reports it
    if not (first.workdir or "").strip():
        return argv             # main says what is missing
    return [argv[0], f"--config={SAVED_CONFIG}:{first.workdir}", *argv[1:]]


def main(argv):
    if not flags.FLAGS["verbosity"].present:   # Orbax logs every save at INFO
        logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    if not flags.FLAGS.workdir.strip():
        sys.exit(cli.EMPTY_WORKDIR)
    config = flags.FLAGS.config

    def evaluate() -> dict:
        hosts.maybe_initialize_distributed(config)
        # a local path (``~`` expanded) or gs://bucket/run: run_setup.prepare reads it
        return evaluator.evaluate(config, flags.FLAGS.workdir, flags.FLAGS.step)

    print(json.dumps(cli.run_command(evaluate), indent=2))


if __name__ == "__main__":
    app.run(main, flags_parser=lambda argv: cli.parse_flags(with_saved_config(argv)))
