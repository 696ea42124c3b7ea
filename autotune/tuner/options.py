"""What ``autotune run`` takes, checked all at once.

``RunOptions`` holds a run's options as typed values, defaults included; ``problems`` checks
every one of them against the rules and this machine and returns every problem found, so a
command line with three mistakes gets one error naming all three; ``from_flags`` turns the CLI's
text (durations, ``name=value`` params) into options and checks them in the same pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.config.space import check_global_batch
from autotune.errors import UsageError
from autotune.machine.hardware import Hardware
from autotune.paths import control_characters, study_folder
from autotune.trial.command import parse_command
from autotune.trial.launch import Nodes
from autotune.trial.spec import MeasureSettings
from autotune.tuner.search import HEADROOM, PATIENCE
from autotune.units import SIZE_UNITS, format_bytes, format_duration, parse_duration, parse_size

DEFAULT_TIMEOUT_S = 12 * 60  # with no budget flag: ends within ~15 minutes on a 2-core CPU
DEFAULT_TRIAL_TIMEOUT_S = 180.0
CONFIRM_TOP = 3  # configs re-measured at the end (0: no confirmation)
CONFIRM_ROUNDS = 3  # interleaved rounds of that re-measurement
CONFIRM_SHARE = 0.4  # this share of a --timeout is kept for the confirmation from the start
CONFIRM_MAX_SHARE = 0.6  # ... and up to this share when its smallest plan needs more
STUDIES = Path("studies")


def default_storage(studies_dir: Path = STUDIES) -> str:
    """The embedded default: one SQLite file under ``studies_dir``."""
    return f"sqlite:///{studies_dir}/autotune.db"


DEFAULT_STORAGE = default_storage()


@dataclass(frozen=True)
class RunOptions:
    """Everything ``autotune run`` takes; the defaults are the CLI's."""

    model: str = "bert"
    params: dict[str, Any] = field(default_factory=dict)
    space: str = "default"
    storage: str | None = None  # default: default_storage(studies_dir)
    study_name: str | None = None
    trials: int | None = None  # the study's total; rerunning the command resumes towards it
    timeout_s: float | None = None  # wall time of this invocation (DEFAULT_TIMEOUT_S w/o trials)
    memory_limit: str | None = None  # a size or a fraction, as the flag takes it
    out_dir: Path | None = None
    studies_dir: Path = STUDIES
    seed: int = 0
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    nproc: int | None = None  # ranks per trial; None: one per visible GPU, 1 on CPU
    global_batch: int | None = None  # keep micro x accumulation x ranks at this value
    measure: MeasureSettings = field(default_factory=MeasureSettings)
    patience: int | None = PATIENCE  # stop after this many trials with no win beyond the noise
    confirm_top: int = CONFIRM_TOP
    confirm_rounds: int = CONFIRM_ROUNDS
    headroom: float = HEADROOM  # share of the memory limit the exported config keeps free
    prune: bool = True  # stop trials whose first windows are clearly below the best
    address_space_bytes: int | None = None  # RLIMIT_AS for trial processes (tests)
    hardware: Hardware | None = None  # detected when None
    probe: bool = True  # read the machine's peaks (probing it once) for MFU and the diagnosis
    nnodes: int = 1  # machines per trial; each runs --nproc ranks (torchrun, c10d rendezvous)
    rdzv_endpoint: str | None = None  # host:port of the rendezvous, for --nnodes > 1
    launcher: str | None = None  # a cluster launcher's command template with {cmd}
    # The user's training script, run as each trial (``autotune run -- CMD``); empty: --model.
    command: tuple[str, ...] = ()

    @property
    def storage_url(self) -> str:
        return self.storage or default_storage(self.studies_dir)

    def with_defaults(self, hw: Hardware) -> RunOptions:
        """These options with what the machine and the budget rules decide filled in: the
        default time budget when no budget was given, one rank per visible GPU."""
        timeout = DEFAULT_TIMEOUT_S if self.trials is None and self.timeout_s is None \
            else self.timeout_s
        nproc = self.nproc if self.nproc is not None else \
            parse_command(self.command).nproc if self.command else default_nproc(hw)
        return replace(self, timeout_s=timeout, nproc=nproc, hardware=hw)

    @property
    def world(self) -> int:
        """Ranks per trial, all nodes together (after ``with_defaults``)."""
        return (self.nproc or 1) * self.nnodes

    @property
    def nodes(self) -> Nodes | None:
        """The multi-node launch of a checked run with --nnodes > 1; None on one node."""
        if self.nnodes == 1 or self.rdzv_endpoint is None:
            return None
        return Nodes(count=self.nnodes, endpoint=self.rdzv_endpoint, template=self.launcher)


def default_nproc(hw: Hardware) -> int:
    """One rank per visible GPU; one on CPU."""
    return len(hw.gpus) if hw.device == "cuda" and hw.gpus else 1


def problems(opts: RunOptions, hw: Hardware) -> list[str]:
    """Every rule ``opts`` breaks on this machine, one line each (rule, value, fix)."""
    found: list[str] = []
    if opts.trials is not None and opts.trials < 1:
        found.append(f"--trials must be >= 1, got {opts.trials}")
    if opts.timeout_s is not None and opts.timeout_s <= 0:
        found.append(f"--timeout must be positive, got {opts.timeout_s:g}s")
    found += _measuring_problems(opts)
    found += _command_problems(opts)
    found += _rank_problems(opts, hw)
    found += node_problems(opts.nnodes, opts.rdzv_endpoint, opts.launcher)
    nproc = opts.nproc if opts.nproc is not None else default_nproc(hw)
    if opts.global_batch is not None and nproc >= 1 and opts.nnodes >= 1:
        try:
            check_global_batch(opts.global_batch, nproc * opts.nnodes)
        except UsageError as exc:
            found.append(str(exc))
    try:
        memory_limit(opts.memory_limit, hw)
    except UsageError as exc:
        found.append(str(exc))
    if opts.study_name is not None and (why := control_characters("--study", opts.study_name)):
        found.append(why)
    elif opts.study_name is not None and opts.out_dir is None:
        try:
            study_folder(opts.studies_dir, opts.study_name)
        except UsageError as exc:
            found.append(str(exc))
    return found


def _measuring_problems(opts: RunOptions) -> list[str]:
    m, found = opts.measure, []
    if m.max_seconds <= 0 or m.min_window_s <= 0:
        found.append(f"--trial-seconds and --window-seconds must be positive, got "
                     f"{m.max_seconds:g} and {m.min_window_s:g}")
    elif m.max_seconds > opts.trial_timeout_s * 2 / 3:
        # Start-up, model build and the slow first step need room under the hard limit.
        found.append(f"--trial-seconds ({m.max_seconds:g}s) must be at most 2/3 of "
                     f"--trial-timeout ({opts.trial_timeout_s:g}s); raise --trial-timeout to "
                     f"at least {m.max_seconds * 1.5:g}s")
    if (opts.patience or 0) < 0 or opts.confirm_top < 0 or opts.confirm_rounds < 2:
        found.append(f"--patience and --confirm-top must be >= 0 and --confirm-rounds >= 2 "
                     f"(a spread needs two rounds), got {opts.patience or 0}, "
                     f"{opts.confirm_top} and {opts.confirm_rounds}")
    return found


def _command_problems(opts: RunOptions) -> list[str]:
    """What is wrong with the command after --, and with the options it cannot go with."""
    if not opts.command:
        return []
    try:
        command = parse_command(opts.command)
    except UsageError as exc:
        return [str(exc)]
    found = []
    if opts.nproc is not None and command.launcher and opts.nproc != command.nproc:
        found.append(f"--nproc {opts.nproc} but the command starts {command.nproc} rank(s): "
                     "the command's launcher decides (torchrun --nproc-per-node N); drop --nproc")
    if opts.nnodes != 1:
        found.append(f"--nnodes {opts.nnodes}: a script's trials run on this machine only; "
                     "drop --nnodes")
    if opts.model != RunOptions.model:
        found.append(f"--model {opts.model} and a command after --: tune one of them")
    if opts.address_space_bytes:
        found.append("an address-space limit applies to built-in workloads' trials only")
    return found


def _rank_problems(opts: RunOptions, hw: Hardware) -> list[str]:
    nproc = opts.nproc
    if nproc is None:
        return []
    if nproc < 1:
        return [f"--nproc must be >= 1, got {nproc}"]
    if hw.device == "cuda" and nproc > len(hw.gpus):
        return [f"--nproc {nproc} asks for more ranks than the {len(hw.gpus)} visible GPU(s); "
                "one rank per GPU: pass --nproc <= the GPU count (CUDA_VISIBLE_DEVICES selects "
                "them)"]
    if hw.device == "cpu" and nproc > hw.cpu_cores:
        return [f"--nproc {nproc} asks for more ranks than the {hw.cpu_cores} CPU cores; ranks "
                f"would share cores and time each other: pass --nproc <= {hw.cpu_cores}"]
    return []


def node_problems(nnodes: int, endpoint: str | None, template: str | None) -> list[str]:
    """What is wrong with --nnodes/--rdzv-endpoint/--launcher, if anything."""
    if nnodes < 1:
        return [f"--nnodes must be >= 1, got {nnodes}"]
    if template is not None and "{cmd}" not in template:
        return [f"--launcher {template!r} has no {{cmd}}: the launcher runs {{cmd}} on each "
                "node, e.g. --launcher 'srun --nodes 2 --ntasks-per-node 1 {cmd}'"]
    if nnodes == 1:
        if endpoint is not None or template is not None:
            return ["--rdzv-endpoint and --launcher are for trials across machines: pass "
                    "--nnodes N (N > 1) too"]
        return []
    if endpoint is None:
        return [f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the address every node "
                "reaches the rendezvous at (a free port on this machine, which hosts it)"]
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return [f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; pass e.g. "
                "--rdzv-endpoint node0:29400"]
    return []


def check(opts: RunOptions, hw: Hardware) -> None:
    """Raise one UsageError naming every problem of ``opts``, if there is any."""
    _raise(problems(opts, hw))


def _raise(found: list[str]) -> None:
    if len(found) == 1:
        raise UsageError(found[0])
    if found:
        raise UsageError(f"{len(found)} problems with the options: " + "; ".join(found))


def from_flags(*, hw: Hardware, param: list[str], timeout: str | None, trial_timeout: str,
               trial_seconds: float, window_seconds: float, patience: int,
               **values: Any) -> RunOptions:
    """Options from the CLI's flags (durations and ``name=value`` params as text, the rest as
    typed values named as RunOptions' fields), every problem raised together."""
    from autotune.workloads import parse_params

    found: list[str] = []

    def duration(text: str | None, flag: str) -> float | None:
        try:
            return None if text is None else parse_duration(text, flag)
        except ValueError as exc:
            found.append(str(exc))
            return None

    params: dict[str, Any] = {}
    try:
        params = parse_params(param)
    except UsageError as exc:
        found.append(str(exc))
    hard = duration(trial_timeout, "--trial-timeout")
    opts = RunOptions(
        params=params, timeout_s=duration(timeout, "--timeout"),
        # Unparsed, it is already one problem: no bound, so the 2/3 rule does not add another.
        trial_timeout_s=hard if hard is not None else math.inf,
        measure=MeasureSettings(max_seconds=trial_seconds, min_window_s=window_seconds),
        patience=patience or None, hardware=hw, **values)
    _raise(found + problems(opts, hw))
    return opts


def budget_text(o: RunOptions) -> str:
    """What a run (with defaults filled in) will spend, in one line: its budget, each trial's
    measuring budget and hard limit, and the confirmation's share of the time budget."""
    parts = []
    if o.trials is not None:
        parts.append(f"{o.trials} measured trials in the study")
    if o.timeout_s is not None:
        parts.append(f"{format_duration(o.timeout_s)} of wall time")
    more = ""
    if o.confirm_top > 0:
        more = (f"; then the top {o.confirm_top} and the baseline are re-measured, up to "
                f"{o.confirm_rounds} interleaved rounds"
                + (f" ({format_duration(CONFIRM_SHARE * o.timeout_s)} of the time budget kept "
                   "for it from the start)" if o.timeout_s is not None else ""))
    return (" or ".join(parts) + (", whichever comes first" if len(parts) > 1 else "")
            + f"; each trial measures for {o.measure.max_seconds:.0f}s, longer when its "
            f"predicted steps need it, and is killed at {o.trial_timeout_s:.0f}s" + more)


def memory_limit(spec: str | None, hw: Hardware) -> int:
    """Bytes one rank may use. ``spec`` is a size (``20GiB``, ``512MB``) or a fraction (``0.8``).

    Default: 90% of GPU memory, or 80% of the RAM available now on CPU. A fraction is of the same
    base (GPU memory, or RAM available now). A limit above the device's memory is an error.
    """
    base = hw.device_memory_bytes
    if spec is None:
        return int(base * (0.9 if hw.device == "cuda" else 0.8))
    value, unit = parse_size(spec)
    if unit not in SIZE_UNITS or not value > 0 or not math.isfinite(value):
        raise UsageError(f"--memory-limit must be a size like 20GiB or a fraction like 0.8, "
                         f"got {spec!r}")
    if unit == "" and value <= 1.0:
        return int(base * value)
    limit = int(value * SIZE_UNITS[unit])
    ceiling = hw.device_memory_ceiling
    if limit > ceiling:
        what = "GPU memory" if hw.device == "cuda" else "RAM"
        raise UsageError(f"--memory-limit {spec} is above this machine's {what} "
                         f"({format_bytes(ceiling)}); pass at most {ceiling // 2**30}GiB "
                         "or a fraction like 0.8")
    if limit < 2**20:
        raise UsageError(f"--memory-limit {spec} is below 1 MiB; did you mean {spec}GiB?")
    return limit


def check_out_dir(path: Path) -> None:
    """Make the output directory, or say in one line why it cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".autotune-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"output directory {path} is not writable ({exc.strerror}); "
                         "pass --out DIR with a writable directory") from None
