"""What a training script calls so that autotune can tune it (besides loading its profile with
``autotune.load_profile()``): one call per optimizer step, and a question whether to stop.

    for batch in loader:
        ...                          # forward, backward, optimizer.step()
        autotune.step()              # or autotune.step(samples) with your own count
        if autotune.should_stop():
            break

Hugging Face and Lightning users add a callback instead (``autotune.integrations``). Outside a
trial of ``autotune run -- CMD`` (no ``AUTOTUNE_TRIAL_DIR`` in the environment) both calls do
nothing and cost a global lookup, so the script stays the production script.

Inside a trial each process appends one line per optimizer step to its own file in the trial's
folder (``steps.rank<R>.jsonl``): the step's number, its end time and its samples (and, from the
callbacks, how long it waited for data). The tuner reads these files and builds warm-up, windows
and the result from them exactly as for a built-in workload (``trial.command``); when it has
measured enough it writes ``stop.json`` naming a step every rank stops after, so ranks that run
in lockstep leave together. On CPU, the first step also reads the machine's speed where the
tuner asks (``autotune.trial.sentinel``; it imports torch only when the script already has).
Which ``Profile`` methods the script called is recorded the same way (``accessed``): the tuner
searches only the knobs the script applies.

This module is imported by training scripts: standard library only.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import sys
import threading
import time
from typing import Any

TRIAL_DIR_ENV = "AUTOTUNE_TRIAL_DIR"
# Samples one optimizer step of one rank trains on, as the candidate config sets them
# (micro-batch x accumulation): what ``step()`` counts when the script does not say.
SAMPLES_ENV = "AUTOTUNE_SAMPLES_PER_STEP"
STOP_FILE = "stop.json"
STOP_POLL_S = 0.05  # how often should_stop() looks for the stop file
MEMORY_POLL_S = 0.5  # how often step() reads the CUDA allocator's peak (when CUDA is in use)
# Where the tuner asks for the sentinel's reading (``autotune.trial.sentinel.script_request``).
SENTINEL_ENV = "AUTOTUNE_SENTINEL"


def steps_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"steps.rank{rank}.jsonl")


class _Trial:
    """This process's side of a running trial."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.rank = _rank()
        self.default_samples = _env_int(SAMPLES_ENV, "0", "the samples per optimizer step "
                                        "autotune sets for the candidate config")
        # Line-buffered: the tuner sees each step as it ends, and a killed process loses none.
        self.file = open(steps_file(folder, self.rank), "a", buffering=1)  # noqa: SIM115
        self.steps = 0
        self.stop_at: int | None = None
        self.next_look = 0.0
        self.next_memory = 0.0
        self.accessed: set[str] = set()
        self.pid = os.getpid()
        self._write({"start": time.time(), "pid": self.pid, "rank": self.rank})
        _watch_tuner()

    def _write(self, doc: dict[str, Any]) -> None:
        self.file.write(json.dumps(doc) + "\n")

    def step(self, samples: int | None, data_s: float | None, loss: Any = None) -> None:
        if os.getpid() != self.pid:
            return  # a forked child (a fork-started rank, a worker) is not this process
        if self.steps == 0:
            self._sentinel()  # in the first step's time: the script's start-up, not a window
        now = time.time()
        n = self.default_samples if samples is None else _samples(samples)
        extra = "" if data_s is None else f',"d":{_seconds(data_s):.6f}'
        if loss is not None and not _finite_loss(loss):
            extra += ',"nan":1'
        self.steps += 1
        if now >= self.next_memory:
            self.next_memory = now + MEMORY_POLL_S
            peak = _cuda_peak()
            if peak:
                extra += f',"m":{peak}'
        if samples is None:
            extra += ',"default":1' if self.steps == 1 else ""
        self.file.write(f'{{"s":{self.steps},"t":{now:.6f},"n":{n}{extra}}}\n')

    def _sentinel(self) -> None:
        """The machine's speed (``autotune.trial.sentinel``), read once, at the end of the first
        step, where the tuner asks and the script trains with torch; a reading that fails is
        said on stderr and the script trains on."""
        request = os.environ.get(SENTINEL_ENV)
        if not request or "torch" not in sys.modules:
            return
        try:
            from autotune.trial.sentinel import read_requested

            world = _env_int("WORLD_SIZE", "1", "set by the launcher")
            self._write({"sentinel": read_requested(request, world)})
        except Exception as exc:  # noqa: BLE001 - the user's training goes on
            print(f"autotune: the sentinel's reading failed: {exc}", file=sys.stderr)

    def diverged(self) -> None:
        if os.getpid() == self.pid:
            self._write({"nan": self.steps, "t": time.time()})

    def should_stop(self) -> bool:
        if self.stop_at is None:
            now = time.monotonic()
            if now < self.next_look:
                return False
            self.next_look = now + STOP_POLL_S
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(self.folder, STOP_FILE)) as f:
                    self.stop_at = int(json.load(f)["at_step"])
            if self.stop_at is None:
                return False
        return self.steps >= self.stop_at

    def access(self, name: str) -> None:
        if name not in self.accessed and os.getpid() == self.pid:
            self.accessed.add(name)
            self._write({"a": name, "t": time.time()})


class StepError(ValueError):
    """A step report autotune refuses at once: a value that is not a number the tuner could
    trust, or an environment variable it cannot read. The message is one line naming it."""


def _samples(value: Any) -> int:
    try:
        n = operator.index(value)  # ints and numpy ints; not floats, not bools' cousins
    except TypeError:
        raise StepError(f"autotune.step(samples={value!r}): samples must be a whole number "
                        ">= 0 (this rank's samples in the optimizer step)") from None
    if isinstance(value, bool) or n < 0:
        raise StepError(f"autotune.step(samples={value!r}): samples must be a whole number "
                        ">= 0 (this rank's samples in the optimizer step)")
    return n


def _seconds(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0:
        raise StepError(f"autotune.step(data_s={value!r}): data_s must be a finite number of "
                        "seconds >= 0 (how long the step waited for its batches)")
    return seconds


def _finite_loss(value: Any) -> bool:
    """Whether the loss is a finite number (a float, or a one-element tensor: reading it waits
    for the device, as logging the loss does)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        raise StepError(f"autotune.step(loss={value!r}): loss must be a number or a "
                        "one-element tensor") from None


def _env_int(name: str, default: str, what: str) -> int:
    raw = os.environ.get(name, default) or default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise StepError(f"autotune: {name}={raw!r} in the environment is not a whole number "
                        f">= 0 ({what}): correct or unset it")
    return value


def _rank() -> int:
    """This process's rank: RANK (torchrun), else the local rank and node of a launcher that
    sets only those (Lightning starting its ranks itself), else 0."""
    what = "set by the launcher for each rank"
    if "RANK" in os.environ:
        return _env_int("RANK", "0", what)
    local = _env_int("LOCAL_RANK", "0", what)
    node = _env_int("NODE_RANK", "0", what) if "NODE_RANK" in os.environ else \
        _env_int("GROUP_RANK", "0", what)
    per_node = _env_int("LOCAL_WORLD_SIZE", "1", what)
    return node * per_node + local


# None: not looked yet; False: not in a trial; else this process's trial.
_state: _Trial | bool | None = None


def _trial() -> _Trial | None:
    global _state
    if _state is None:
        folder = os.environ.get(TRIAL_DIR_ENV)
        _state = False
        if folder:
            try:
                _state = _Trial(folder)
            except OSError as exc:  # a folder the tuner removed: report nothing, train on
                print(f"autotune: cannot report steps to {folder}: {exc}", file=sys.stderr)
    return _state or None  # type: ignore[return-value]


def step(samples: int | None = None, data_s: float | None = None, loss: Any = None) -> None:
    """Mark the end of one optimizer step. ``samples``: what this process trained on in it
    (its micro-batch x accumulation; default: the tuned config's); ``data_s``: seconds the step
    waited for its batches, when the script knows (the callbacks measure it); ``loss``: the
    step's loss, when the script has it (a NaN or infinite one ends the trial as diverged).
    A no-op outside a trial. In a trial, a value that is not a finite number >= 0 raises
    ``StepError`` at once, naming it."""
    state = _state
    if state is False:
        return
    trial = _trial() if state is None else state
    if trial:
        trial.step(samples, data_s, loss)  # type: ignore[union-attr]


def diverged() -> None:
    """Report that the loss (or the gradient norm) became NaN or infinite after the steps
    reported so far: the trial ends as diverged. For scripts that learn of it other than by
    ``step(loss=...)`` (the Hugging Face callback reads the Trainer's logs). A no-op outside a
    trial."""
    if _state is False:
        return
    trial = _trial()
    if trial is not None:
        trial.diverged()


def should_stop() -> bool:
    """True once the trial has measured enough: leave the training loop (every rank gets True
    after the same step). Always False outside a trial."""
    state = _state
    if state is False:
        return False
    trial = _trial() if state is None else state
    return bool(trial) and trial.should_stop()  # type: ignore[union-attr]


def in_trial() -> bool:
    """Whether this process runs as a trial of ``autotune run -- CMD`` (reads the environment;
    opens nothing)."""
    return _state is not False and bool(os.environ.get(TRIAL_DIR_ENV))


def readback(doc: dict[str, Any]) -> None:
    """Record what a framework's Trainer runs with, read back once it is built (autotune's
    bootstrap calls this): the knobs in effect and those that did not take, with reasons."""
    if _state is False:
        return
    trial = _trial()
    if trial is not None and os.getpid() == trial.pid:
        trial._write({"k": doc, "t": time.time()})


def accessed(name: str) -> None:
    """Record that the script called ``Profile.<name>`` (the profile's methods call this)."""
    if _state is False:
        return
    trial = _trial()
    if trial is not None:
        trial.access(name)


_noted: set[str] = set()


def note_once(line: str) -> None:
    """Print ``line`` on stderr once per process (what a trial's stderr tail should show)."""
    if line not in _noted:
        _noted.add(line)
        print(line, file=sys.stderr, flush=True)


def _cuda_peak() -> int:
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    with contextlib.suppress(Exception):
        if torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_reserved())
    return 0


def _watch_tuner() -> None:
    """End this process if the tuner that started the trial dies: a script must not outlive it
    holding a device. A daemon thread: it never keeps the script alive."""
    try:
        tuner = int(os.environ.get("AUTOTUNE_TUNER_PID", "0"))
    except ValueError:
        return
    if tuner <= 0:
        return

    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(tuner, 0)
            except ProcessLookupError:
                os._exit(1)
            except OSError:
                return

    threading.Thread(target=watch, daemon=True, name="autotune-tuner-watch").start()
