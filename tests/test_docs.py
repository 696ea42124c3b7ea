"""The README and docs/ stay navigable: every relative link resolves, and the README stays short."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 250

_FENCE = re.compile(r"^ {0,3}(```+|~~~+)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target), with an optional "title" after the target.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*)>?(?:\s+[^)]*)?\)")
# [label]: target
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)[0] * len(match.group(1))
                continue
            yield number, line
        elif match and match.group(1).startswith(fence):
            fence = None


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    for number, line in prose_lines(text):
        reference = _REFERENCE.match(line)
        if reference:
            yield number, reference.group(1)
            continue
        for match in _INLINE_LINK.finditer(_INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (hyphens, spaces and
    underscores kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link in `path` that does not resolve, named relative to `root`."""
    broken: list[str] = []
    for number, target in links(path.read_text(encoding="utf-8")):
        if not target or _EXTERNAL.match(target):
            continue  # http(s), mailto and other schemes are not checked
        file_part, _, fragment = target.partition("#")
        file_part = unquote(file_part.split("?", 1)[0])
        where = f"{os.path.relpath(path, root)}:{number}: {target}"
        resolved = (path.parent / file_part).resolve() if file_part else path
        if file_part and not resolved.exists():
            broken.append(f"{where} (no such file: {os.path.relpath(resolved, root)})")
            continue
        if fragment and resolved.suffix.lower() == ".md" and resolved.is_file():
            if unquote(fragment).lower() not in anchors(resolved):
                broken.append(f"{where} (no heading with anchor #{fragment} in "
                              f"{os.path.relpath(resolved, root)})")
    return broken


def test_docs_pages_exist() -> None:
    assert (ROOT / "docs").is_dir(), "docs/ is missing"
    assert len(markdown_files()) > 1, "docs/ has no Markdown pages"


def test_every_relative_link_resolves() -> None:
    broken = [line for path in markdown_files() for line in broken_links(path)]
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def test_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move detail into docs/")


def test_github_anchor_rule() -> None:
    assert github_anchor("Know the machine: probe, MFU and what limits a config") == \
        "know-the-machine-probe-mfu-and-what-limits-a-config"
    assert github_anchor("`autotune profile check`: a regression check") == \
        "autotune-profile-check-a-regression-check"
    assert github_anchor("What watching a trial's memory costs") == \
        "what-watching-a-trials-memory-costs"
    assert github_anchor("Run-to-run noise") == "run-to-run-noise"


def test_broken_links_are_reported(tmp_path: Path) -> None:
    """The checker itself finds a missing file and a missing heading, and ignores code."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\n## Real heading\n", encoding="utf-8")
    page = docs / "b.md"
    page.write_text(
        "# B\n\n[ok](a.md#real-heading) [web](https://example.com/x.md) [self](#b)\n"
        "[gone](missing.md) [bad anchor](a.md#nope)\n"
        "`[in code](nowhere.md)`\n\n```bash\n[in a fence](nowhere.md)\n```\n",
        encoding="utf-8")
    broken = broken_links(page, root=tmp_path)
    assert len(broken) == 2, broken
    assert "missing.md" in broken[0] and "#nope" in broken[1]
