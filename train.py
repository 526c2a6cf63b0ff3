"""Train a model: python train.py [--config configs/X.py[:variant]] [--workdir DIR] [--config.a.b=v]

With no flags it trains the default ViT on scikit-learn's digits into /tmp/posjax_digits; any
other ``--config`` needs a ``--workdir``.
Rerunning with the same workdir resumes from the latest checkpoint.
"""
import pathlib
import sys

from absl import app, flags, logging

from posjax import cli
from posjax.training import hosts, trainer

DEFAULT_CONFIG = str(pathlib.Path(__file__).resolve().parent / "configs" / "vit_digits.py")

cli.define_config_flag(DEFAULT_CONFIG, "Training config file[:variant].")
DEFAULT_WORKDIR = "/tmp/posjax_digits"
flags.DEFINE_string("workdir", None, "Directory for checkpoints and logs (default, for the "
                    f"default config only: {DEFAULT_WORKDIR}).")


def main(argv):
    if not flags.FLAGS["verbosity"].present:   # Orbax logs every save at INFO
        logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    config = flags.FLAGS.config
    workdir = flags.FLAGS.workdir
    if workdir is not None and not workdir.strip():
        sys.exit(cli.EMPTY_WORKDIR)
    if workdir is None and flags.FLAGS["config"].present:
        sys.exit("error: --config needs a --workdir of its own (the default "
                 f"{DEFAULT_WORKDIR} is the default config's)")

    def train() -> trainer.TrainResult:
        hosts.maybe_initialize_distributed(config)
        return trainer.train(config, workdir or DEFAULT_WORKDIR)

    result = cli.run_command(train)
    if result.stop_line():
        print(result.stop_line())


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
