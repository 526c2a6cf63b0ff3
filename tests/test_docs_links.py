"""Every relative link in the project's Markdown resolves: README.md, BENCHMARKS.md, STUDY.md
and docs/*.md.

A link is ``[text](path)`` or ``![alt](path)`` outside code (fenced blocks and inline code
spans are not rendered as links). ``http(s)://`` and ``mailto:`` targets and pure ``#anchor``
links are left alone. The path is taken relative to the linking file and must name an
existing file or folder; ``file.md#anchor`` must also name a heading of that file, slugged as
GitHub does (lower-case; punctuation dropped except '-' and '_'; each space a '-'; a repeated
heading gets '-1', '-2', ...). And every test docs/guarantees.md names exists.
"""
from __future__ import annotations

import pathlib
import re
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "STUDY.md",
               *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = ("http://", "https://", "mailto:")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link of ``path`` outside code."""
    found = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            found.append((number, match.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of ``path``, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """'file:line: target (why)' for each link of ``path`` that does not resolve (``file``
    relative to ``root``)."""
    broken = []
    for number, target in links(path):
        if target.startswith(_EXTERNAL) or target.startswith("#"):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / urllib.parse.unquote(file_part)).resolve()
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not resolved.exists():
            broken.append(f"{where} (no such file or folder)")
        elif anchor and resolved.suffix == ".md" and resolved.is_file():
            if urllib.parse.unquote(anchor).lower() not in anchors(resolved):
                broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_slugs_follow_github() -> None:
    assert slug("Run S — throughput suite, Intel Xeon (2 vCPUs), idle (2026-12-06 14:16 UTC)") \
        == "run-s--throughput-suite-intel-xeon-2-vcpus-idle-2026-12-06-1416-utc"
    assert slug("`evaluate` the model_layout and gathers") == "evaluate-the-model_layout-and-gathers"
    assert slug("Speed-ups of issue #38 (2026-12-04 and 2026-12-06)") \
        == "speed-ups-of-issue-38-2026-12-04-and-2026-12-06"


def test_links_skip_code_and_external(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text("# Top\n\n## Top\n\nsee [b](b.md#part) and ![i](img.png) and [t](#top)\n"
                   "`[no](missing.md)` [web](https://example.com/x)\n\n```\n[no](missing.md)\n```\n"
                   "[self](a.md#top-1) [bad](a.md#nowhere) [gone](gone/)\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("## Part\n", encoding="utf-8")
    (tmp_path / "img.png").write_bytes(b"")
    assert [t for _, t in links(doc)] == ["b.md#part", "img.png", "#top",
                                          "https://example.com/x", "a.md#top-1",
                                          "a.md#nowhere", "gone/"]
    assert anchors(doc) == {"top", "top-1"}
    assert broken_links(doc, tmp_path) == [
        "a.md:11: a.md#nowhere (no heading with that anchor)",
        "a.md:11: gone/ (no such file or folder)"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: pathlib.Path) -> None:
    assert doc.is_file(), f"{doc} is missing"
    broken = broken_links(doc)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_test_the_guarantees_name_exists() -> None:
    """docs/guarantees.md names the test behind each guarantee (``file.py::test_name`` or
    ``::test_name``): each is a test function defined in tests/."""
    text = (ROOT / "docs" / "guarantees.md").read_text()
    named = set(re.findall(r"::(test_\w+)", text))
    defined = {m for path in (ROOT / "tests").glob("test_*.py")
               for m in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    assert len(named) > 40 and named <= defined, sorted(named - defined)
