"""``python -m autotune.testing ARGS``: the ``autotune`` CLI on a made-up machine.

With ``AUTOTUNE_FAKE_NVML=machine.json`` set, NVML answers from that file (``FakeNVML``): how the
tests run ``autotune probe`` on four GPUs, or a fleet worker on other hardware, on a machine with
no NVIDIA driver. The fake is handed to ``autotune.machine.nvml.use()``; nothing in the package
itself reads this variable.
"""

from __future__ import annotations

import os

from autotune.cli import main
from autotune.machine import nvml
from autotune.testing.nvml import FAKE_NVML_ENV, FakeNVML

if __name__ == "__main__":
    path = os.environ.get(FAKE_NVML_ENV)
    if path:
        nvml.use(FakeNVML.from_file(path))
    main()
