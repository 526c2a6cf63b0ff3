"""The config a train.py run saved in its workdir (``DIR/config.json``).

    python eval.py --workdir DIR --config.mesh.fsdp=1      # eval.py's default config
    python train.py --config configs/saved.py:DIR --workdir DIR   # resume with the saved config
"""
from posjax.training.run_config import load_saved_config


def get_config(workdir: str = ""):
    if not workdir:
        raise ValueError("configs/saved.py needs the run's workdir: --config configs/saved.py:DIR")
    return load_saved_config(workdir)
