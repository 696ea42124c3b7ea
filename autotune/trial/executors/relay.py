"""What a trial's node sends back over the engine's own output channel, for clusters whose nodes
share no file system with the tuner.

On each node the trial's wrapper (``executors.node``) writes the trial's files in a folder of its
own and sends what they hold as lines on its stdout: ``@autotune {"kind": ..., ...}``. The engine
(srun) brings that stdout back to the tuner, where ``Relay`` writes what it reads
into the trial's folder, as a local trial would have written it. Everything else the trial prints
goes to stderr, the trial's log.

What crosses here is the trial's word, not trusted: a line is parsed as JSON only, within a size
and a nesting depth (``trial.untrusted``), and written to one of three fixed names in the
trial's folder; nothing in it names a path.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from pathlib import Path
from typing import IO, Any

from autotune.trial.untrusted import Refused, loads

MARK = "@autotune "
MAX_LINE = 1 << 20  # a progress event or a result document is a few KB
_RANK_FILE = re.compile(r"rank\d{1,6}")


def line(kind: str, **fields: Any) -> str:
    """One relayed record, as the node sends it (``kind``: progress, result or rank)."""
    return MARK + json.dumps({"kind": kind, **fields}, separators=(",", ":")) + "\n"


class Relay:
    """The tuner's side: reads the engine's stdout in a thread and writes the trial's result,
    progress events and ranks' failure reports into ``result_path``'s folder."""

    def __init__(self, stream: IO[bytes], result_path: str, progress_path: str) -> None:
        self.stream = stream
        self.result_path, self.progress_path = Path(result_path), Path(progress_path)
        self.refused = 0  # lines that were not a well-formed record
        self._thread = threading.Thread(target=self._pump, daemon=True, name="trial-relay")
        self._thread.start()

    def _pump(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in iter(lambda: self.stream.readline(MAX_LINE + 1), b""):
                text = raw.decode(errors="replace")
                if not text.startswith(MARK) or len(raw) > MAX_LINE:
                    self.refused += text.startswith(MARK)
                    continue
                try:
                    doc = loads(raw[len(MARK):], max_bytes=MAX_LINE)
                except Refused:
                    self.refused += 1
                    continue
                if not isinstance(doc, dict) or not self._write(doc):
                    self.refused += 1

    def _write(self, doc: dict[str, Any]) -> bool:
        kind, body = doc.get("kind"), doc.get("doc")
        with contextlib.suppress(OSError):
            if kind == "progress" and isinstance(body, dict):
                with self.progress_path.open("a") as f:
                    f.write(json.dumps(body) + "\n")
                return True
            if kind == "result" and isinstance(body, dict):
                _replace(self.result_path, json.dumps(body))
                return True
            rank = doc.get("rank")
            if kind == "rank" and isinstance(body, dict) and isinstance(rank, str) \
                    and _RANK_FILE.fullmatch(rank):
                _replace(self.result_path.with_name(f"{self.result_path.name}.{rank}"),
                         json.dumps(body))
                return True
        return False

    def close(self, wait_s: float = 5.0) -> None:
        """Wait for the stream's end (the engine's exit), then stop reading."""
        self._thread.join(wait_s)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    tmp.replace(path)
