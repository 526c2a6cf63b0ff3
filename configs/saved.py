"""The config a train.py run saved in its workdir (``DIR/config.json``).

    python eval.py --workdir DIR --config.mesh.fsdp=1      # eval.py's default config
    python train.py --config configs/saved.py:workdir=DIR --workdir DIR   # resume with it

The older spelling ``configs/saved.py:DIR`` still works.
"""
from posjax import config_defaults


def get_config(variant: str = ""):
    workdir = config_defaults.variant_values(variant, {"workdir": ""}, "configs/saved.py",
                                             whole=True)["workdir"]
    if not workdir:
        raise ValueError("configs/saved.py needs the run's workdir: --config "
                         "configs/saved.py:workdir=DIR")
    return config_defaults.load_saved_config(workdir)
