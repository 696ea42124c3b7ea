"""JSON that a trial's processes wrote or a trial's node sent back, read as untrusted input:
within a size and a nesting depth, and every way it can fail is one ``Refused`` (a
``ValueError``) saying why, never another exception. Python's own parser recurses once per
level: a line of 200,000 ``[`` raised ``RecursionError`` in the tuner and ended the run.
Standard library only."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import IO, Any

# Autotune's own documents nest a few levels (a result's script read-back is four deep).
MAX_DEPTH = 32
# The quoted strings of a JSON text, an unterminated one to the end (possessive: one pass).
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*+"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class Refused(ValueError):
    """JSON the tuner will not parse: too long, too deep, or not JSON. The message completes
    "a line that is ...": ``longer than N bytes (M)``, ``nested more than N levels deep``,
    ``not JSON (why)``."""


def nesting(data: bytes, stop_at: int = MAX_DEPTH) -> int:
    """How deep the arrays and objects of ``data`` nest (counting stops past ``stop_at``):
    brackets inside strings do not count."""
    brackets = _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in brackets:
        depth += 1 if byte in (0x5B, 0x7B) else -1  # [ {
        if depth > deepest:
            deepest = depth
            if deepest > stop_at:
                break
    return deepest


def loads(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(data)`` within ``max_bytes`` and ``max_depth``; raises ``Refused``. UTF-8
    only: the depth is counted on its bytes (JSON in UTF-16 could hide its brackets)."""
    raw = data.encode(errors="surrogatepass") if isinstance(data, str) else data
    if len(raw) > max_bytes:
        raise Refused(f"longer than {max_bytes} bytes ({len(raw)})")
    depth = nesting(raw, max_depth)
    if depth > max_depth:
        raise Refused(f"nested more than {max_depth} levels deep")
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise Refused(f"not JSON ({str(exc)[:80]})") from None


def open_file(path: str | Path) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file, not a link: a FIFO the trial puts
    in its folder would block the tuner in ``open``, a link would read another file. Raises
    ``OSError`` otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def load_file(path: str | Path, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON document in the regular file at ``path``, read no further than ``max_bytes``
    + 1; raises ``Refused`` (a file that cannot be read, or is no regular file, ``OSError``)."""
    with open_file(path) as f:
        data = f.read(max_bytes + 1)
    return loads(data, max_bytes=max_bytes, max_depth=max_depth)
