"""A stand-in for a cluster launcher (``srun --nodes N {cmd}``) on one machine, for tests.

    python -m autotune.testing.launcher N CMD...

starts CMD N times at once, as a cluster launcher starts it once per node, each copy with its
own ``AUTOTUNE_LOCK_DIR`` (separate machines have separate device locks) and ``NODE_INDEX``;
waits for all and exits with the first non-zero exit code. SIGTERM (the tuner ending the
trial) ends every copy, as srun forwards it to its tasks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile


def main() -> int:
    count, cmd = int(sys.argv[1]), sys.argv[2:]
    base = tempfile.mkdtemp(prefix="fake-launcher-")
    procs = [subprocess.Popen(cmd, env={**os.environ, "NODE_INDEX": str(i),
                                        "AUTOTUNE_LOCK_DIR": os.path.join(base, str(i))})
             for i in range(count)]

    def forward(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
