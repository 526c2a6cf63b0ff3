"""Evaluate a checkpoint: python eval.py --workdir DIR [--step N] [--config configs/X.py ...]

Reads the config train.py saved in the workdir unless --config is given, evaluates the latest
checkpoint (or --step) on data.test_split and writes DIR/checkpoints/eval_<step>_<split>.json
(e.g. eval_800_test.json; another --config.data.test_split writes its own file).
"""
import json
import pathlib
import sys

import ml_collections
from absl import app, flags, logging

from posjax.training import loop

loop.define_config_flag(None, "Config file[:variant] (default: the workdir's).")
flags.DEFINE_string("workdir", None, "Directory train.py wrote.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")


def main(argv):
    if not flags.FLAGS["verbosity"].present:   # Orbax logs every save at INFO
        logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    workdir = pathlib.Path(flags.FLAGS.workdir).expanduser()
    config = flags.FLAGS.config
    if config is None:
        saved = workdir / loop.CONFIG_FILE
        if not saved.exists():
            sys.exit(f"error: {saved} does not exist: give --workdir of a train.py run "
                     "(or --config)")
        config = ml_collections.ConfigDict(json.loads(saved.read_text()))
    loop.maybe_initialize_distributed(config)
    try:
        result = loop.evaluate(config, workdir, flags.FLAGS.step)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    app.run(main, flags_parser=loop.parse_flags)
