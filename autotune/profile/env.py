"""A profile's environment: the variables autotune tunes (``NCCL_ALGO``, ``NCCL_PROTO``), set
in the training process by ``Profile.apply_env`` or given to a command by ``autotune launch``.

A profile is data: a name it sets that autotune does not tune (LD_PRELOAD, PYTHONPATH,
BASH_ENV, PATH) would run foreign code, so both refuse it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.config.knobs import TUNED_ENV
from autotune.errors import ProfileError

if TYPE_CHECKING:
    from autotune.profile.schema import Profile

# The variable `autotune launch` names the profile in, for ``load_profile()`` without a path.
PROFILE_ENV = "AUTOTUNE_PROFILE"


def foreign(env: Mapping[str, str]) -> list[str]:
    """Names in ``env`` that autotune does not tune (``TUNED_ENV``)."""
    return [k for k in env if k not in TUNED_ENV]


def refuse_foreign(env: Mapping[str, str]) -> None:
    """Refuse an env that holds anything autotune does not tune, naming each and the fix."""
    names = foreign(env)
    if names:
        raise ProfileError(f"the profile's env sets {', '.join(map(repr, names))}: autotune "
                           f"applies only the variables it tunes ({', '.join(TUNED_ENV)}); "
                           "remove the others from the profile's env")


def apply(env: Mapping[str, str], environ: MutableMapping[str, str] | None) -> dict[str, str]:
    """Set ``env`` in ``environ`` (default: this process's); see ``Profile.apply_env``."""
    import torch.distributed as dist

    refuse_foreign(env)
    if dist.is_available() and dist.is_initialized():
        raise ProfileError("apply_env() called after the process group started: NCCL reads "
                           "its environment at init; call it before init_process_group, or "
                           "start the script with `autotune launch PROFILE -- CMD`")
    environ = os.environ if environ is None else environ
    for key, value in env.items():
        old = environ.get(key)
        if old is not None and old != value:
            # stacklevel 4: the script's call of apply_env, past the method and its tracking.
            warnings.warn(f"{key}={old} in the environment replaced by the profile's "
                          f"{key}={value}", stacklevel=4)
        environ[key] = value
    return dict(env)


def launch_env(profile: Profile, path: str | Path,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment `autotune launch` runs a command in: ``base`` (default: this one), the
    profile's variables and ``AUTOTUNE_PROFILE`` (its absolute path) for ``load_profile``.
    Refuses a profile whose env holds a variable autotune does not tune."""
    refuse_foreign(profile.env)
    env = dict(os.environ if base is None else base)
    env.update(profile.env)
    env[PROFILE_ENV] = str(Path(path).resolve())
    return env
