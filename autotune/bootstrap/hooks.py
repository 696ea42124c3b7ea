"""Post-import hooks: when the script imports a hooked framework module, the module runs as
usual and then its hook patches it (``hf``). A meta-path finder that wraps the module's own
loader, the way tracing tools reach code they cannot edit. Standard library only: a process
that never imports a hooked module pays for one dictionary lookup per import.

A hook that fails says so on stderr and leaves the module as it was: the script runs on,
unhooked (a trial of it then reports no step, and the tuner says why)."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from autotune.bootstrap import MODE_ENV, MODES, TRIAL

# module -> "autotune module:function" called with it once it has run.
HOOKS = {
    "transformers.training_args": "autotune.bootstrap.hf:on_training_args",
    "transformers.trainer": "autotune.bootstrap.hf:on_trainer",
}


def mode() -> str | None:
    """``trial`` or ``launch`` in a process the bootstrap serves, else None."""
    found = os.environ.get(MODE_ENV)
    if found not in MODES:
        return None
    if found == TRIAL and not os.environ.get("AUTOTUNE_TRIAL_DIR"):
        return None  # a trial's environment without its folder: nothing to report to
    return found


def install() -> None:
    """Hook the frameworks in this process (once)."""
    if mode() is None or any(isinstance(f, _PostImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PostImport(HOOKS))


def _run_hook(target: str, module: ModuleType) -> None:
    where, _, func = target.partition(":")
    try:
        hook: Callable[[ModuleType], None] = getattr(importlib.import_module(where), func)
        hook(module)
    except Exception:  # noqa: BLE001 - the script must run on without its hook
        last = traceback.format_exc().strip().splitlines()[-1]
        print(f"autotune: the bootstrap could not hook {module.__name__} ({last}); the script "
              "runs without it", file=sys.stderr, flush=True)


class _PostImport(importlib.abc.MetaPathFinder):
    def __init__(self, hooks: dict[str, str]) -> None:
        self.hooks = hooks
        self.busy: set[str] = set()

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        hook = self.hooks.get(name)
        if hook is None or name in self.busy:
            return None
        self.busy.add(name)  # the finders after this one find the module itself
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, hook)
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, with its hook run after the module has."""

    def __init__(self, inner: Any, hook: str) -> None:
        self.inner, self.hook = inner, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self.inner.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _run_hook(self.hook, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect
        return getattr(self.inner, name)


def skipped_in_trials(method: Callable[..., Any], result: Any) -> Callable[..., Any]:
    """``method`` returning (a copy of) ``result`` at once in a trial, as itself elsewhere:
    what a script does with its Trainer after training (save, evaluate, push), whose outputs
    a trial never writes; its windows are measured by then."""
    @functools.wraps(method)
    def skipped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if mode() != TRIAL:
            return method(self, *args, **kwargs)
        return type(result)(result) if isinstance(result, dict | list) else result

    return skipped


def note_fresh_start(call: str) -> None:
    """Say once that ``call``, a resume the script asks for in code, trains from the start in
    a trial: a trial measures the config, never the rest of another run (nor reads its
    checkpoint)."""
    from autotune import steps

    steps.note_once(f"autotune: {call} in a trial trains from the start: a trial measures the "
                    "config, not the rest of a run (`autotune launch` resumes as the script "
                    "asks)")
