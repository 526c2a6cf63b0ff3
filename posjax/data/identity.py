"""Data identity: digests of what a model's data files mean, recorded beside its weights.

A text model's embedding rows stand for the tokens of the vocabulary it was trained with: a
vocabulary file rewritten in place, or another vocabulary given to a run that starts from those
weights, would silently remap every id. ``FILE`` in a train.py workdir (written at the run's
start) or in a converter folder (from the tokenizer files the imported weights came with) maps
config keys to digests of what they name, ``{"data.tokenizer": [sha256, ...]}``: content equal
to any one of them is the same.
"""
from __future__ import annotations

import json
import pathlib

from posjax.data.common import write_text_atomically

FILE = "data_identity.json"
TOKENIZER_KEY = "data.tokenizer"
# The tokenizer files a Hugging Face model folder may hold that ``load_tokenizer`` reads.
TOKENIZER_FILES = ("vocab.txt", "spm.model", "sentencepiece.bpe.model", "tokenizer.json")


def read(folder: pathlib.Path) -> dict[str, list[str]]:
    """``folder``'s recorded identity, each key's digests as a list; {} when none is recorded."""
    path = folder / FILE
    if not path.exists():
        return {}
    try:
        recorded = json.loads(path.read_text())
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}): restore it from a copy, or delete it "
                         "to skip this check") from None
    return {k: [str(d) for d in (v if isinstance(v, list) else [v])] for k, v in recorded.items()}


def write(folder: pathlib.Path, identity: dict[str, str | list[str]]) -> None:
    """Record ``identity`` in ``folder`` (atomically)."""
    write_text_atomically(folder / FILE, json.dumps(identity, indent=2) + "\n")


def difference(recorded: dict[str, list[str]], current: dict[str, str]
               ) -> tuple[str, str, str] | None:
    """(key, digest now, first digest recorded) for the first key of ``current`` whose digest
    is not among those ``recorded`` for it; None when all agree (or nothing was recorded)."""
    for key, digest in current.items():
        if key in recorded and digest not in recorded[key]:
            return key, digest, recorded[key][0]
    return None


def folder_vocabularies(folder: pathlib.Path) -> dict[str, list[str]]:
    """``{TOKENIZER_KEY: digests}`` of the tokenizer files in a model folder (``TOKENIZER_FILES``
    that load); {} when it holds none."""
    from posjax.data.tokenizers import load_tokenizer

    digests = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            try:
                digest = load_tokenizer(folder / name).vocabulary_digest()
            except ValueError:   # not a tokenizer posjax reads: nothing to compare with
                continue
            if digest not in digests:
                digests.append(digest)
    return {TOKENIZER_KEY: digests} if digests else {}
