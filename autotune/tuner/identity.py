"""Which study a run belongs to: its name, its creation, and the guard that refuses to resume it
with anything that would make its trials incomparable (other hardware, another workload, another
space, another rank count or global batch, another memory limit)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import optuna

from autotune.config.knobs import Config
from autotune.config.space import NarrowedSpace
from autotune.errors import StorageError, UsageError
from autotune.machine.hardware import (
    Hardware,
    compare_fingerprints,
    describe_fingerprint,
    hostname,
)
from autotune.profile import FingerprintWarning
from autotune.tuner import record
from autotune.tuner.storage import redact
from autotune.units import format_bytes
from autotune.workloads import WorkloadSpec

TPE_STARTUP_TRIALS = 5


@dataclass(frozen=True)
class Identity:
    """What a study measures: every trial in it was run with these."""

    name: str
    workload_name: str
    workload: WorkloadSpec
    space: NarrowedSpace
    hw: Hardware
    baseline: Config
    world: int  # ranks per trial, all nodes together
    global_batch: int | None


def default_name(workload_name: str, workload: WorkloadSpec, space: NarrowedSpace,
                 hw: Hardware) -> str:
    """``<workload>-<space>-<hash>``: the hash covers the params, the narrowed space and the
    hardware, so editing a space file or moving machines starts a new study, never a mixed one."""
    blob = json.dumps({"spec": workload.spec, "params": workload.params,
                       "space": space.to_dict()["searched"], "fingerprint": hw.fingerprint(),
                       **_shape(space)}, sort_keys=True, default=str)
    # A folder name under studies/ (paths.study_folder): a workload's or space's own name may
    # hold anything; only names that already were safe keep their form (and their studies).
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", f"{workload_name}-{space.name}").lstrip(".") or "_"
    return f"{prefix[:150]}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def _shape(space: NarrowedSpace) -> dict[str, int]:
    """What, besides the searched knobs, makes two studies' trials incomparable. Empty for one
    rank without --global-batch, so studies made before these options keep their names."""
    shape: dict[str, int] = {}
    if space.world_size != 1:
        shape["world_size"] = space.world_size
    if space.global_batch is not None:
        shape["global_batch"] = space.global_batch
    return shape


def sampler(seed: int) -> optuna.samplers.BaseSampler:
    """The sampler of every study. Optuna does not persist it: made anew on every resume, with a
    seed moved by the trial count so the random start-up trials do not repeat the first run's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, group=True, n_startup_trials=TPE_STARTUP_TRIALS,
            # Trials other workers are running count as bad for now: workers of a fleet are
            # not all sent to the same region.
            constant_liar=True)


def open_study(storage: optuna.storages.BaseStorage, url: str, ident: Identity, *,
               seed: int, limit: int, limit_spec: str | None,
               note: Callable[[str], None] | None = None) -> tuple[optuna.Study, int]:
    """Create the study, or resume it after checking it measures what this run would; returns
    it with the memory limit to use (a resumed study keeps its own). Call under the study lock:
    creating the study and writing its attributes is one step for a fleet's workers. A warning
    (a study whose fingerprint predates the CPU's identity) goes to ``note``, else to
    ``warnings`` as a FingerprintWarning."""
    try:
        study = optuna.create_study(study_name=ident.name, storage=storage,
                                    direction="maximize", sampler=sampler(seed),
                                    load_if_exists=True)
    except Exception as exc:
        raise StorageError(f"cannot create or load study {ident.name!r} in "
                           f"{redact(url)}: {exc}") from None
    facts = record.read_facts(study)
    if facts.made_by_run:
        added = _refuse_mismatch(facts, ident)
        if added and note is not None:
            note(f"study {ident.name} was made before {', '.join(added)} could be searched: "
                 "its earlier trials ran at the baseline's value, and the search adds it now")
        limit = _kept_limit(ident.name, facts.memory_limit_bytes, facts.memory_limit_spec, limit,
                            limit_spec)
        _complete_fingerprint(study, ident, note)  # once every check has passed
    else:
        record.write_identity(study, {
            "fingerprint": ident.hw.fingerprint(), "hardware": ident.hw.to_dict(),
            "workload": {"name": ident.workload_name, "spec": ident.workload.spec,
                         "params": ident.workload.params},
            "space": ident.space.to_dict(), "baseline": ident.baseline.to_dict(),
            "created": datetime.now(UTC).isoformat(timespec="seconds")})
    if facts.memory_limit_bytes is None:
        record.write_memory_limit(study, limit, limit_spec)
    study.sampler = sampler(seed + len(study.get_trials(deepcopy=False)))
    return study, limit


def _refuse_mismatch(facts: record.StudyFacts, ident: Identity) -> list[str]:
    """A resumed study must measure what this run would: one line saying what differs. Returns
    the knobs this run adds to the study's space (``added_knobs``)."""
    name = ident.name
    match = compare_fingerprints(dict(facts.fingerprint), ident.hw.fingerprint())
    if match.differs and match.unverified:
        raise UsageError(f"study {name} was made by an earlier autotune whose fingerprint did "
                         f"not record the CPU's {match.unverified_words()}, and what it did "
                         f"record differs here ({'; '.join(match.differs)}); measurements are "
                         "not comparable: pass another --study name to start a new study")
    if match.differs:
        # A fleet worker on another kind of machine lands here too: its throughput would not
        # be comparable with the study's.
        raise UsageError(f"study {name} was measured on other hardware "
                         f"({'; '.join(match.differs)}); measurements are not comparable: run "
                         "this worker on a machine like the study's, or pass another --study "
                         "name")
    stored = dict(facts.workload)
    if (stored.get("spec"), stored.get("params")) != (ident.workload.spec,
                                                      ident.workload.params):
        _refuse_other_script(name, stored, ident.workload)
        raise UsageError(f"study {name} tunes workload {stored}, not this one; "
                         "pass another --study name")
    stored_space = facts.space
    shape = {"world_size": stored_space.get("world_size", 1),
             "global_batch": stored_space.get("global_batch")}
    if shape != {"world_size": ident.world, "global_batch": ident.global_batch}:
        raise UsageError(
            f"study {name} was tuned with {shape['world_size']} rank(s) per trial (--nproc x "
            f"--nnodes) and --global-batch {shape['global_batch'] or 'unset'}, not "
            f"{ident.world} rank(s) and --global-batch {ident.global_batch or 'unset'}; pass "
            "the same flags to resume it, or another --study name")
    searched = stored_space.get("searched")
    here = json.loads(json.dumps(ident.space.to_dict()["searched"]))
    added = added_knobs(facts, ident)
    if searched != {k: v for k, v in here.items() if k not in added}:
        raise UsageError(f"study {name} searched another space ({searched}); its trials would "
                         "not fit this one: pass another --study name")
    return added


def added_knobs(facts: record.StudyFacts, ident: Identity) -> list[str]:
    """Knobs this run searches that the study's space neither searched nor fixed nor removed
    (a knob newer than the study: malloc_retain), where the baseline keeps the knob's default:
    every trial the study holds ran at that default, so its trials fit this space too."""
    stored = facts.space
    known = {k for part in ("searched", "fixed", "removed") for k in stored.get(part, {})}
    default = Config()
    return sorted(k for k in ident.space.searched if k not in known
                  and getattr(ident.baseline, k) == getattr(default, k))


def _complete_fingerprint(study: optuna.Study, ident: Identity,
                          note: Callable[[str], None] | None) -> None:
    """A study made before the fingerprint recorded the CPU's identity, resumed on a machine
    where everything it did record matches (``_refuse_mismatch`` let it through): resume it,
    say once what could not be checked, and record this CPU on it, so that from now on a worker
    on another CPU is refused as for any study (and the agents' plain check works)."""
    stored = dict(record.read_facts(study).fingerprint)
    here = ident.hw.fingerprint()
    match = compare_fingerprints(stored, here)
    if not match.unverified:
        return
    line = (f"study {ident.name} was made by an earlier autotune whose fingerprint did not "
            f"record the CPU's {match.unverified_words()}, so autotune cannot tell whether "
            f"this machine ({describe_fingerprint(here)}) is the CPU its "
            f"{len(study.get_trials(deepcopy=False))} trial(s) ran on; everything else it "
            "recorded matches, so it resumes, and this CPU is recorded on it for later runs: "
            "if its trials ran on another CPU, pass another --study name to start a new study")
    # Which trials ran before the CPU was known: a reader can tell them from the later ones.
    record.write_unverified_cpu(study, {**stored, **{k: here[k] for k in match.unverified}}, {
        "fields": match.unverified, "trials_before": len(study.get_trials(deepcopy=False)),
        "at": datetime.now(UTC).isoformat(timespec="seconds"), "host": hostname()})
    if note is not None:
        note(line)
    else:
        warnings.warn(line, FingerprintWarning, stacklevel=3)


def _refuse_other_script(name: str, stored: dict[str, Any], workload: WorkloadSpec) -> None:
    """The resume guard's line for a study of a script: another command, or the same command
    with the script edited since."""
    if stored.get("spec") != "command" or workload.spec != "command":
        return
    old, new = stored.get("params") or {}, workload.params
    if old.get("command") != new.get("command"):
        raise UsageError(f"study {name} tunes the command {shlex.join(old.get('command') or [])!r}"
                         f", not {shlex.join(new['command'])!r}; pass another --study name")
    # A study from before its command's file was tracked (a wrapper's) resumes as it did then.
    if old.get("script_sha256") not in (None, new.get("script_sha256")):
        raise UsageError(f"{new.get('script')} changed since study {name} measured it (sha256 "
                         f"{str(old.get('script_sha256'))[:12]} then, "
                         f"{str(new.get('script_sha256'))[:12]} now): its trials measured the "
                         "old script; pass another --study name")


def _kept_limit(name: str, stored: int | None, stored_spec: str | None, limit: int,
                asked: str | None) -> int:
    """A study's memory limit is fixed when it is created: constraints of earlier trials were
    computed against it. Resuming uses it; asking for another one is an error. The same flag
    text counts as the same limit (a fraction of available RAM moves a little)."""
    if stored is None:
        return limit
    if asked is not None and asked != stored_spec and limit != stored:
        raise UsageError(
            f"study {name} was tuned with --memory-limit {format_bytes(stored)}, not "
            f"{format_bytes(limit)}; resume it without --memory-limit, or pass --study NAME to "
            "start a new study with the new limit")
    return int(stored)
