"""Convert published weights into a posjax checkpoint, or a posjax checkpoint into an HF folder.

    python -m posjax.convert --from HF_FOLDER_or_NPZ --to OUT_DIR [--image-size N] [--task T]
    python -m posjax.convert --from POSJAX_DIR_or_TRAIN_WORKDIR --to HF_OUT --format hf
                                         # schemes deberta, deberta_v2 and vit only

OUT_DIR gets ``params/`` (orbax StandardCheckpointer of {'params': params}),
``model_config.json`` and, when the source names one, ``data_identity.json`` (its vocabulary:
an init_from run reading another is refused); ``config.init_from`` of the training configs
starts from it. Nothing is left at the destination when anything fails; an existing
destination is never touched.
"""
from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from posjax.convert import export_hf, load_pretrained, save_checkpoint, source_data_identity
from posjax.convert.destination import new_destination
from posjax.io_utils import local_path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m posjax.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True,
                   help="Hugging Face folder, vit_jax or big_vision ViT .npz (FILE.npz:img "
                        "for one tower of a two-tower checkpoint), posjax checkpoint folder "
                        "or train.py workdir (its latest checkpoint)")
    p.add_argument("--to", dest="dest", required=True, help="output folder (must not exist)")
    p.add_argument("--format", choices=("posjax", "hf"), default="posjax",
                   help="posjax: orbax params + model_config.json (default); hf: config.json + "
                        "model.safetensors for transformers")
    p.add_argument("--task", choices=("mlm", "classification", "encoder"), default=None,
                   help="default: the checkpoint's own head; 'encoder' drops the head")
    p.add_argument("--image-size", type=int, nargs="+", default=None, metavar="N",
                   help="ViT: target resolution (N or H W); the position table is resampled")
    p.add_argument("--resample", choices=("bilinear", "bicubic"), default=None,
                   help="position-table interpolation (default: bilinear for .npz as vit_jax, "
                        "bicubic for HF folders as HF/timm)")
    p.add_argument("--pooling", choices=("first",), default=None,
                   help="big_vision .npz trained with pool_type='0' (the first patch's row): "
                        "its arrays look like GAP pooling, which is assumed without this")
    args = p.parse_args(argv)
    if args.image_size is not None and len(args.image_size) not in (1, 2):
        p.error(f"--image-size takes N or H W, got {args.image_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = None
    if args.image_size is not None:
        size = args.image_size[0] if len(args.image_size) == 1 else tuple(args.image_size)
    try:
        local_path(args.source, "--from")      # URLs: named as the command line does
        new_destination(args.dest, "--to")     # before a read that may take minutes
        pre = load_pretrained(args.source, task=args.task, image_size=size,
                              resample=args.resample, pooling=args.pooling)
        if args.format == "hf":
            dest = export_hf(pre, args.dest)
        else:
            dest = save_checkpoint(pre, args.dest, source_data_identity(args.source))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # a read or write that failed (disk, network): nothing was left
        print(f"error: {e} (nothing was written to {args.dest})", file=sys.stderr)
        return 1
    count = sum(int(np.size(x)) for x in jax.tree.leaves(pre.params))
    print(f"wrote {dest} ({args.format}): kind={pre.kind} task={pre.task} "
          f"scheme={pre.config.position_scheme} params={count:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
