"""A profile in a framework's terms, and callbacks that report the framework's training steps to
autotune, so that ``autotune run -- CMD`` can tune a Hugging Face or Lightning script that loads
its profile: ``autotune.integrations.hf`` (``TrainingArguments`` kwargs, ``AutotuneCallback``)
and ``autotune.integrations.lightning`` (``Trainer`` kwargs, ``AutotuneCallback``). Each imports
its framework itself; importing ``autotune`` (or this package) imports neither.

The kwargs are built from a ``Config`` and the device it was measured on; ``Profile`` calls
them with its own (``hf_training_args``, ``lightning_trainer_kwargs``). The integrations never
import the profile (a contract): a profile passed in, as before they took a config, is read
through ``ProfileLike``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from autotune.config.knobs import Config


class ProfileLike(Protocol):
    """What the kwargs read of a ``Profile`` passed in place of a config: its config, and the
    fingerprint that says which device it was measured on."""

    @property
    def config(self) -> Config: ...

    @property
    def fingerprint(self) -> Mapping[str, object]: ...


def config_and_device(tuned: Config | ProfileLike,
                      device: str | None) -> tuple[Config, str | None]:
    """The config, and the device it was measured on (``device`` where given; a profile's
    fingerprint says it otherwise; None: unknown, taken as a GPU)."""
    if isinstance(tuned, Config):
        return tuned, device
    measured = tuned.fingerprint.get("device")
    return tuned.config, device or (measured if isinstance(measured, str) else None)
