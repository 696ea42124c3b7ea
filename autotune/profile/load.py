"""Loading a profile file: safely, as data (never code), within the size of a profile, checked
(``validate.from_dict``), and with a warning when it was tuned on another machine.

In a trial of ``autotune run -- CMD`` the load is the trial's candidate config whatever path
the script names, so a script is tuned without changing the path it loads in production.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import yaml

from autotune import steps
from autotune.errors import ProfileError
from autotune.profile.env import PROFILE_ENV
from autotune.profile.schema import Profile
from autotune.profile.validate import from_dict

# A profile autotune writes is a few KB and a few hundred values; these bounds refuse a file
# that is not one before anything prints or walks it (a 637-byte YAML of nested aliases expands
# to 100+ MB).
MAX_PROFILE_BYTES = 4 * 2**20
MAX_PROFILE_NODES = 200_000


class FingerprintWarning(UserWarning):
    """The profile was tuned on different hardware or software than this machine."""


def load_profile(path: str | Path | None = None, check_fingerprint: bool = True) -> Profile:
    """Load a profile safely. Warns (FingerprintWarning) when tuned on other hardware.

    Without ``path``, loads the one ``autotune launch`` named in ``AUTOTUNE_PROFILE``. In a
    trial of ``autotune run -- CMD`` it always loads the trial's candidate config (also named
    in ``AUTOTUNE_PROFILE``), whatever ``path`` the script passes: a script that loads its
    production profile by path is tuned without that path changing, and says so once on stderr.
    """
    path = _trial_candidate(path)
    if path is None:
        path = os.environ.get(PROFILE_ENV)
        if not path:
            raise ProfileError(f"no profile path given and {PROFILE_ENV} is not set: pass the "
                               "path, or start the script with `autotune launch PROFILE -- CMD`")
    path = Path(path)
    profile = from_dict(_read(path), str(path))
    if check_fingerprint:
        _warn_if_elsewhere(profile, path)
    return profile


def read_quietly(path: str | Path) -> Profile:
    """A profile read and checked as ``load_profile`` does, without recording a load in a
    trial or warning about its fingerprint: what autotune's bootstrap reads the candidate
    config with (the script did not load it; nothing is to be said about this machine)."""
    return from_dict(_read(Path(path)), str(path))


def _read(path: Path) -> Any:
    """The file's YAML as plain data, refused when it is not text, not YAML, holds a Python
    tag, or is bigger than any profile (in bytes, or in values once its aliases expand)."""
    try:
        if path.stat().st_size > MAX_PROFILE_BYTES:
            raise ProfileError(f"profile {path} is {path.stat().st_size} bytes, more than a "
                               f"profile's {MAX_PROFILE_BYTES}: it is not a profile")
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"profile {path} is not text: the file is damaged or not a "
                           "profile") from None
    try:
        data = yaml.safe_load(text)  # safe_load refuses !!python/object and friends
    except yaml.YAMLError as exc:
        what = str(exc).splitlines()[0]
        if "python/" in str(exc):
            raise ProfileError(f"profile {path} holds a Python object tag ({what}); profiles "
                               "are plain data and such tags are never loaded") from None
        raise ProfileError(f"profile {path} is not valid YAML ({what}); the file is damaged: "
                           "re-export it") from None
    if _expanded_size(data, MAX_PROFILE_NODES) > MAX_PROFILE_NODES:
        raise ProfileError(f"profile {path} expands to more than {MAX_PROFILE_NODES} values "
                           "(YAML aliases repeating aliases): it is not a profile autotune wrote")
    return data


def _expanded_size(data: Any, cap: int) -> int:
    """Values in ``data`` counted as printing would visit them (an alias's target as often as
    it is referenced), stopping just past ``cap``."""
    count, stack = 0, [data]
    while stack and count <= cap:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _warn_if_elsewhere(profile: Profile, path: Path) -> None:
    """Warn when the profile's fingerprint differs from this machine's, or is too old to say."""
    from autotune.machine.hardware import compare_fingerprints, detect

    match = compare_fingerprints(profile.fingerprint, detect().fingerprint())
    # stacklevel 3: the script's call of load_profile.
    if match.differs:
        warnings.warn(f"profile {path} was tuned on a different machine or software: "
                      f"{'; '.join(match.differs)}", FingerprintWarning, stacklevel=3)
    elif match.unverified:
        warnings.warn(f"profile {path} was made by an earlier autotune whose fingerprint "
                      f"did not record the CPU's {match.unverified_words()}: whether it "
                      "was tuned on this CPU cannot be told", FingerprintWarning, stacklevel=3)


def _trial_candidate(path: str | Path | None) -> str | Path | None:
    """``path``, or in a trial the candidate profile the tuner wrote for it (and the load is
    recorded: a script that never loads a profile applies no knob)."""
    candidate = os.environ.get(PROFILE_ENV)
    if not steps.in_trial() or not candidate:
        return path
    steps.accessed("load_profile")
    if path is not None and os.path.abspath(path) != os.path.abspath(candidate):
        steps.note_once(f"autotune: load_profile({str(path)!r}) in a trial of `autotune run`: "
                        "loading the trial's candidate config instead")
    return candidate
