"""One node's part of a trial started by a cluster engine (a Slurm job step's task):

    AUTOTUNE_TRIAL_SPEC='{...}' python -m autotune.trial.executors.node [TORCHRUN FLAGS...]

writes the spec into a folder of its own on this node, starts the node's ranks (torchrun with the
given flags, or the one rank alone when there are none), sends back what the trial's files hold
as it appears (``executors.relay``), and at the end, or when the engine ends the step (SIGTERM
from ``scancel`` or the step's time limit), ends every process of its ranks, found by their
token as the local launcher finds them, and removes its folder. The ranks' own output goes to
stderr, the engine's log of the step.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autotune.trial.executors import SPEC_ENV
from autotune.trial.executors.relay import MAX_LINE, line
from autotune.trial.processes import TRIAL_TOKEN, new_token, reap
from autotune.trial.progress import Tail
from autotune.trial.untrusted import Refused, load_file

POLL_S = 0.2


def _send(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        pass  # the engine stopped listening: the step is ending


def _send_files(result: Path) -> None:
    with contextlib.suppress(OSError, Refused):
        doc = load_file(result, max_bytes=MAX_LINE)
        if isinstance(doc, dict):
            _send(line("result", doc=doc))
    for path in sorted(result.parent.glob(result.name + ".rank*")):
        with contextlib.suppress(OSError, Refused):
            _send(line("rank", rank=path.name.rsplit(".", 1)[1],
                       doc=load_file(path, max_bytes=MAX_LINE)))


def main(flags: list[str]) -> int:
    spec = os.environ.get(SPEC_ENV)
    if not spec:
        print(f"autotune: {SPEC_ENV} is not set: this runs as a trial's node part only",
              file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="autotune-trial-"))
    files = {k: folder / f"{k}.{ext}" for k, ext in
             (("spec", "json"), ("result", "json"), ("progress", "jsonl"))}
    files["spec"].write_text(spec)
    token = new_token(files["result"])
    env = {k: v for k, v in os.environ.items() if k != SPEC_ENV}
    env[TRIAL_TOKEN] = token
    launcher = [sys.executable, "-m", "torch.distributed.run", *flags] if flags \
        else [sys.executable]
    argv = [*launcher, "-m", "autotune.trial.bench", *(str(files[k]) for k in
                                                       ("spec", "result", "progress"))]
    ended: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda s, frame: ended.append(s))
    # The engine's process that started this part (slurmstepd, a Ray actor) dying ends it too.
    parent = os.getppid()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    progress = Tail(str(files["progress"]))

    def send_progress() -> None:  # the ranks' new events, as the tuner's own tail reads them
        progress.forward(lambda event: _send(line("progress", doc=event)))

    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                            stderr=sys.stderr.fileno(), start_new_session=True)
    try:
        while proc.poll() is None and not ended:
            if os.getppid() != parent:
                ended.append(signal.SIGHUP)
                break
            send_progress()
            time.sleep(POLL_S)
    finally:
        left = reap(token, proc.pid)
        proc.wait()
        send_progress()
        _send_files(files["result"])
        shutil.rmtree(folder, ignore_errors=True)
    if left:
        print(f"autotune: processes {left} of this trial survived SIGKILL", file=sys.stderr)
    if ended:
        print(f"autotune: node part ended by signal {ended[0]}", file=sys.stderr)
        return 128 + ended[0]
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
