"""Data identity: what a model's data files mean, recorded beside its weights.

A text model's embedding rows stand for the tokens of the vocabulary it was trained with: a
vocabulary file rewritten in place, or another vocabulary given to a run that starts from those
weights, would silently remap every id. ``FILE`` in a train.py workdir (written at the run's
start) or in a converter folder (from the tokenizer files the imported weights came with) maps
config keys to a list of entries, any one of which the content may equal, each as
``TextTokenizer.vocabulary_identity`` gives it: ``{"data.tokenizer": [{"sha256": ..., "size":
..., "block": ..., "blocks": [...]}]}``.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

from posjax.io_utils import write_text_atomically

FILE = "data_identity.json"
TOKENIZER_KEY = "data.tokenizer"
# The tokenizer files a Hugging Face model folder may hold that ``load_tokenizer`` reads.
TOKENIZER_FILES = ("vocab.txt", "spm.model", "sentencepiece.bpe.model", "tokenizer.json")

Entry = dict[str, Any]


def read(folder: pathlib.Path) -> dict[str, list[Entry]]:
    """``folder``'s recorded identity, each key's entries as a list; {} when none is recorded."""
    path = folder / FILE
    if not path.exists():
        return {}
    try:
        recorded = json.loads(path.read_text())
        if not isinstance(recorded, dict):
            raise ValueError("not a JSON object")
        entries = {k: v if isinstance(v, list) else [v] for k, v in recorded.items()}
        if not all(isinstance(e, dict) and "sha256" in e for v in entries.values() for e in v):
            raise ValueError("an entry without its sha256")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}): restore it from a copy, or delete it "
                         "to skip this check") from None
    return entries


def write(folder: pathlib.Path, identity: dict[str, Entry | list[Entry]]) -> None:
    """Record ``identity`` in ``folder`` (atomically)."""
    write_text_atomically(folder / FILE, json.dumps(identity, indent=2) + "\n")


def difference(recorded: dict[str, list[Entry]], current: dict[str, Entry]
               ) -> tuple[str, Entry, Entry] | None:
    """(key, entry now, the closest entry recorded: fewest ``changed_blocks``) for the first
    key of ``current`` equal to none of the entries ``recorded`` for it; None when every key
    agrees (or nothing was recorded for it)."""
    for key, entry in current.items():
        entries = recorded.get(key, [])
        if entries and all(e["sha256"] != entry["sha256"] for e in entries):
            return key, entry, min(entries, key=lambda e: len(changed_blocks(e, entry)))
    return None


def changed_blocks(recorded: Entry, current: Entry) -> list[tuple[int, int]]:
    """The id ranges [start, end) whose tokens differ between two vocabularies, block by
    block (ids only one of them has count as changed); every id when their blocks cannot be
    compared (another block size, or none recorded)."""
    size = max(int(recorded.get("size", 0)), int(current.get("size", 0)))
    block = recorded.get("block")
    if block is None or block != current.get("block") or "blocks" not in recorded:
        return [(0, size)]
    ours, theirs = current["blocks"], recorded["blocks"]
    changed = []
    for i in range(max(len(ours), len(theirs))):
        if i >= len(ours) or i >= len(theirs) or ours[i] != theirs[i]:
            start, end = i * block, min((i + 1) * block, size)
            if changed and changed[-1][1] == start:
                start = changed.pop()[0]
            changed.append((start, end))
    return changed


def changed_share(recorded: Entry, current: Entry) -> float:
    """The share of ids (of the larger vocabulary) in ``changed_blocks``."""
    size = max(int(recorded.get("size", 0)), int(current.get("size", 0)), 1)
    return sum(end - start for start, end in changed_blocks(recorded, current)) / size


def folder_vocabularies(folder: pathlib.Path) -> dict[str, list[Entry]]:
    """``{TOKENIZER_KEY: entries}`` of the tokenizer files in a model folder (those of
    ``TOKENIZER_FILES`` that load; one entry per distinct vocabulary); {} when it holds none."""
    from posjax.data.tokenizers import load_tokenizer

    entries: list[Entry] = []
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            try:
                entry = load_tokenizer(folder / name).vocabulary_identity()
            except ValueError:   # not a tokenizer posjax reads: nothing to compare with
                continue
            if all(e["sha256"] != entry["sha256"] for e in entries):
                entries.append(entry)
    return {TOKENIZER_KEY: entries} if entries else {}
