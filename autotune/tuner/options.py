"""What ``autotune run`` takes, declared once and checked all at once.

``RunOptions`` holds a run's options as typed values, defaults included; each field that the
command line sets carries its ``Flag`` (names, help, and how the flag's text becomes the value),
from which the CLI builds ``autotune run``'s parameters. ``problems`` checks every option against
the rules and this machine and returns every problem found, so a command line with three mistakes
gets one error naming all three; ``from_flags`` reads the flags' values into options and checks
them in the same pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotune.config.space import check_global_batch
from autotune.errors import UsageError
from autotune.flags import DURATION, BoundFlag, Flag, Form, flags, flags_of, option, read_flags
from autotune.machine.hardware import Hardware
from autotune.paths import control_characters, study_folder
from autotune.trial.command import parse_command
from autotune.trial.launch import Nodes
from autotune.trial.spec import MeasureSettings
from autotune.tuner.search import HEADROOM, PATIENCE
from autotune.units import SIZE_UNITS, format_bytes, format_duration, parse_size
from autotune.workloads import parse_params

DEFAULT_TIMEOUT_S = 12 * 60  # with no budget flag: ends within ~15 minutes on a 2-core CPU
DEFAULT_TRIAL_TIMEOUT_S = 180.0
CONFIRM_TOP = 3  # configs re-measured at the end (0: no confirmation)
CONFIRM_ROUNDS = 3  # interleaved rounds of that re-measurement
CONFIRM_SCREEN = 2  # more configs within the margin, in its first round where time allows
CONFIRM_SHARE = 0.4  # this share of a --timeout is kept for the confirmation from the start
CONFIRM_MAX_SHARE = 0.6  # ... and up to this share when its smallest plan needs more
STUDIES = Path("studies")
WorkloadParam = int | float | bool | str | None  # a value of --param name=value, as read


def default_storage(studies_dir: Path = STUDIES) -> str:
    """The embedded default: one SQLite file under ``studies_dir``."""
    return f"sqlite:///{studies_dir}/autotune.db"


DEFAULT_STORAGE = default_storage()


def _command(words: list[str] | None, flag: str) -> tuple[str, ...]:
    words = words or []  # click keeps the -- once options stop being parsed
    return tuple(words[1:] if words[:1] == ["--"] else words)


# The forms of flags whose command-line value is not the field's: name=value words, the words
# after --, and a count where 0 means none.
PARAMS = Form(list[str] | None, lambda items, _: parse_params(items or []), lambda _: None, {})
COMMAND = Form(list[str] | None, _command, lambda _: None, ())
NEVER_IF_ZERO = Form(int, lambda n, _: n or None, lambda n: n or 0, None)


@dataclass(frozen=True)
class RunOptions:
    """Everything ``autotune run`` takes, in the order its --help lists the flags; the defaults
    are the CLI's."""

    model: str = option("bert", "--model", "-m", help=(
        "Built-in workload (see `autotune list`), pkg.module:function, or path/to/file.py"))
    params: Mapping[str, WorkloadParam] = field(default_factory=dict, metadata=flags(Flag(
        ("--param", "-p"), "Workload parameter name=value, repeatable (--param seq_len=256)",
        PARAMS)))
    space: str = option("default", "--space", help="Search space: built-in name or YAML file")
    storage: str | None = option(None, "--storage", help=(  # default: default_storage(studies_dir)
        f"Optuna storage URL (default: {DEFAULT_STORAGE})"))
    study_name: str | None = option(None, "--study", help=(
        "Study name (default: workload-space-<hash of params, space, hardware>)"))
    trials: int | None = option(None, "--trials", help=(
        "Measured trials the study should have (repeats of a measured config do not count); "
        "rerunning the command resumes towards it"))
    timeout_s: float | None = option(None, "--timeout", form=DURATION, help=(
        "Wall-time budget of this run, e.g. 10m (default: 12m when --trials is not given)"))
    nproc: int | None = option(None, "--nproc", help=(
        "Ranks per trial, started through torchrun (nccl on GPUs, gloo on CPU) (default: one per "
        "visible GPU, 1 on CPU)"))
    nnodes: int = option(1, "--nnodes", help=(
        "Machines per trial, each running --nproc ranks, meeting at torchrun's c10d rendezvous; "
        "started by --executor slurm or ray, or by a --launcher template"))
    executor: str = option("local", "--executor", help=(
        "Where trials run: local (this machine), slurm (job steps inside an sbatch/salloc "
        "allocation) or ray (placement groups on a running Ray cluster; needs Ray installed)"))
    parallel: int | None = option(None, "--parallel", help=(
        "Trials at a time on --executor slurm or ray, each on its own nodes (default: as many "
        "as fit)"))
    rdzv_endpoint: str | None = option(None, "--rdzv-endpoint", help=(
        "HOST:PORT of the rendezvous of trials across machines (with --launcher)"))
    launcher: str | None = option(None, "--launcher", help=(
        "Launcher template that starts {cmd} (torchrun) on every node of a trial, for engines "
        "other than Slurm and Ray, e.g. 'mpirun -np 2 --map-by node {cmd}' (with --nnodes)"))
    global_batch: int | None = option(None, "--global-batch", help=(
        "Keep micro-batch x accumulation x ranks at this many samples per optimizer step "
        "(accumulation is derived), so tuning never changes the training semantics"))
    memory_limit: str | None = option(None, "--memory-limit", help=(
        "Memory limit: a size (20GiB) or a fraction (0.8); per rank on GPUs, for all ranks "
        "together on CPU, where they share the RAM (default: 90% of GPU memory, 80% of "
        "available RAM on CPU)"))
    out_dir: Path | None = option(None, "--out", help=(
        "Directory for the profile and trial logs (default: studies/<study>)"))
    seed: int = option(0, "--seed", help="Sampler seed")
    trial_timeout_s: float = option(DEFAULT_TRIAL_TIMEOUT_S, "--trial-timeout", form=DURATION,
                                   help="Hard limit per trial (process start to exit)")
    # Its defaults live in trial.spec; two flags set two of its settings.
    measure: MeasureSettings = field(default_factory=MeasureSettings, metadata=flags(
        Flag(("--trial-seconds",), "Measuring budget per trial, warm-up included",
             part="max_seconds"),
        Flag(("--window-seconds",), "Minimum length of one timed window", part="min_window_s"),
    ))
    # --patience 0 never stops early, which the options say as None.
    patience: int | None = option(PATIENCE, "--patience", form=NEVER_IF_ZERO, help=(
        "Stop when this many trials in a row beat the best by no more than the noise (0: never "
        "stop early)"))
    confirm_top: int = option(CONFIRM_TOP, "--confirm-top", help=(
        "Configs re-measured at the end, interleaved with the baseline, to pick the winner: the "
        "best, and the next whose trials are within the margin of it (0: no confirmation)"))
    confirm_rounds: int = option(CONFIRM_ROUNDS, "--confirm-rounds",
                                help="Interleaved rounds of that re-measurement")
    prune: bool = option(True, "--prune/--no-prune",
                        help="Stop trials whose first windows are clearly below the best")
    probe: bool = option(True, "--probe/--no-probe", help=(
        "Read this machine's measured peaks (probing it once per fingerprint, seconds on a CPU) "
        "for MFU and the diagnosis"))
    # The user's training script, run as each trial (``autotune run -- CMD``); empty: --model.
    command: tuple[str, ...] = option((), "command", form=COMMAND, argument=True, help=(
        "Your own training script, after --, run as typed as each trial: e.g. -- torchrun "
        "--nproc-per-node 2 train.py --data d/. The script must load the candidate with "
        "autotune.load_profile(), apply it with the profile's methods, and report each optimizer "
        "step: autotune.step() and autotune.should_stop(), or AutotuneCallback from "
        "autotune.integrations.hf / autotune.integrations.lightning"))
    # Not flags: set by the runner, tests and benchmarks.
    studies_dir: Path = STUDIES
    headroom: float = HEADROOM  # share of the memory limit the exported config keeps free
    address_space_bytes: int | None = None  # RLIMIT_AS for trial processes (tests)
    hardware: Hardware | None = None  # detected when None

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
        if self.nnodes == 1 or self.rdzv_endpoint is None or self.launcher is None:
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
    found += node_problems(opts.nnodes, opts.rdzv_endpoint, opts.launcher, opts.executor)
    found += executor_problems(opts)
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
    if opts.executor != "local":
        found.append(f"--executor {opts.executor}: a script's trials run on this machine only; "
                     "drop --executor")
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


def executor_problems(opts: RunOptions) -> list[str]:
    """What is wrong with --executor/--parallel, if anything (what the allocation or the Ray
    cluster holds is checked when the executor starts)."""
    from autotune.trial.executors import EXECUTORS

    if opts.executor not in EXECUTORS:
        return [f"--executor {opts.executor!r} is not one of {', '.join(EXECUTORS)}"]
    if opts.parallel is not None and opts.parallel < 1:
        return [f"--parallel must be >= 1, got {opts.parallel}"]
    if opts.executor == "local":
        if opts.parallel not in (None, 1):
            return [f"--parallel {opts.parallel}: trials on one machine share its devices and "
                    "run one at a time; pass --executor slurm or ray, or run a fleet of "
                    "workers (docs/clusters.md)"]
        return []
    if opts.launcher is not None or opts.rdzv_endpoint is not None:
        return [f"--executor {opts.executor} starts every node of a trial and picks its "
                "rendezvous: drop --launcher and --rdzv-endpoint"]
    return []


def node_problems(nnodes: int, endpoint: str | None, template: str | None,
                  executor: str = "local") -> list[str]:
    """What is wrong with --nnodes/--rdzv-endpoint/--launcher, if anything."""
    if nnodes < 1:
        return [f"--nnodes must be >= 1, got {nnodes}"]
    if executor != "local":
        return []
    if template is not None and "{cmd}" not in template:
        return [f"--launcher {template!r} has no {{cmd}}: the launcher runs {{cmd}} on each "
                "node, e.g. --launcher 'srun --nodes 2 --ntasks-per-node 1 {cmd}'"]
    if nnodes == 1:
        if endpoint is not None or template is not None:
            return ["--rdzv-endpoint and --launcher are for trials across machines: pass "
                    "--nnodes N (N > 1) too"]
        return []
    if template is None:
        return [f"--nnodes {nnodes} needs an engine to start the other nodes: --executor slurm "
                "(inside an sbatch allocation), --executor ray, or --launcher TEMPLATE with "
                "--rdzv-endpoint"]
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


@functools.cache
def run_flags() -> tuple[BoundFlag, ...]:
    """Every flag of ``autotune run``, in the order its --help lists them."""
    return flags_of(RunOptions)


def from_flags(values: Mapping[str, object], hw: Hardware) -> RunOptions:
    """Options from ``autotune run``'s parameter values, as the command line hands them over
    (named as ``BoundFlag.param`` names them; one not given keeps its default), every problem
    raised together."""
    found: list[str] = []
    opts = read_flags(RunOptions, run_flags(), values, found, hardware=hw)
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
    top = f"up to {o.confirm_top - 1} more, " if o.confirm_top > 1 else ""
    more = "" if o.confirm_top < 1 else (
        f"; then the best (with {top}{CONFIRM_SCREEN} more in the first round where time allows, "
        "of those within the margin of it) and the baseline are re-measured, "
        f"up to {o.confirm_rounds} interleaved rounds"
        + (f" (what it needs, at most {format_duration(CONFIRM_SHARE * o.timeout_s)} of "
           "the time budget, kept for it as the trials go)" if o.timeout_s is not None else ""))
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
