"""What a study records of itself (``StudyFacts``), read once, and written here only: its
identity when it is made, its memory limit, the probe, the FLOPs figure, the knobs a script
never applies, the confirmation and the exported diagnosis."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import optuna

from autotune.profile.documents import ConfirmationDoc, FindingDoc, ProbeDoc
from autotune.trial.sizing import check
from autotune.tuner.confirmation import Confirmation
from autotune.tuner.record.read import MALFORMED, left_out


@dataclass(frozen=True)
class StudyFacts:
    """What a study records of itself: where it was measured, what it tunes, its memory limit,
    the machine's probe, and what the confirmation and the export left on it."""

    name: str
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    workload: Mapping[str, Any] = field(default_factory=dict)
    space: Mapping[str, Any] = field(default_factory=dict)
    memory_limit_bytes: int | None = None
    memory_limit_spec: str | None = None
    probe: ProbeDoc | None = None
    flops: Mapping[str, Any] = field(default_factory=dict)  # counted once per study
    unapplied: Mapping[str, str] | None = None  # knobs a script never applies, and why
    confirmation: Confirmation | None = None
    diagnosis: tuple[Mapping[str, Any], ...] = ()  # the exported winner's, for the dashboard
    # The model's size before any trial (``trial.sizing``), for the memory model of sharding.
    model_size: Mapping[str, Any] | None = None

    @property
    def device(self) -> str:
        return str(self.fingerprint.get("device", "cpu"))

    @property
    def made_by_run(self) -> bool:
        """Whether `autotune run` made it (it records the fingerprint first)."""
        return isinstance(self.fingerprint, Mapping) and bool(self.fingerprint)


def read_facts(study: optuna.Study) -> StudyFacts:
    """What the study records of itself; a malformed attribute (a study shared through a
    database is others' data) is left out and said once, never the end of the run."""
    a = study.user_attrs
    return StudyFacts(
        name=study.study_name, fingerprint=_mapping(a, "fingerprint"),
        workload=_mapping(a, "workload"), space=_mapping(a, "space"),
        memory_limit_bytes=a.get("memory_limit_bytes"),
        memory_limit_spec=a.get("memory_limit_spec"),
        probe=cast(ProbeDoc, dict(a["probe"])) if isinstance(a.get("probe"), dict) else None,
        flops=_mapping(a, "flops"), unapplied=a.get("unapplied"),
        confirmation=_confirmation(a.get("confirmation")),
        diagnosis=tuple(d for d in a.get("diagnosis") or () if isinstance(d, Mapping))
        if isinstance(a.get("diagnosis"), list) else (),
        model_size=_model_size(a.get("model_size")))


def _model_size(stored: object) -> Mapping[str, Any] | None:
    if stored is None:
        return None
    try:
        if not isinstance(stored, Mapping):
            raise TypeError(f"a {type(stored).__name__}, not a mapping")
        return dict(check(stored))
    except (ValueError, TypeError) as exc:
        left_out("the study's model_size", exc)
        return None


def _mapping(attrs: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = attrs.get(key) or {}
    if isinstance(value, Mapping):
        return dict(value)
    left_out(f"the study's {key!r}", TypeError(f"a {type(value).__name__}, not a mapping"))
    return {}


def _confirmation(stored: object) -> Confirmation | None:
    if not stored:
        return None
    try:
        if not isinstance(stored, Mapping):
            raise TypeError(f"a {type(stored).__name__}, not a mapping")
        return Confirmation.from_dict(stored)
    except MALFORMED as exc:
        left_out("the study's confirmation", exc)
        return None


def write_identity(study: optuna.Study, identity: Mapping[str, object]) -> None:
    """What a new study measures (fingerprint, hardware, workload, space, baseline, created):
    the resume guard compares a later run's against it."""
    for key, value in identity.items():
        study.set_user_attr(key, value)


def write_memory_limit(study: optuna.Study, limit: int, spec: str | None) -> None:
    """The limit the study's trials are judged against, and how it was asked for."""
    study.set_user_attr("memory_limit_bytes", limit)
    study.set_user_attr("memory_limit_spec", spec)


def write_unverified_cpu(study: optuna.Study, fingerprint: Mapping[str, object],
                         unverified: Mapping[str, object]) -> None:
    """An old study's fingerprint completed with this CPU's identity, and which of its trials
    ran before the CPU was known."""
    study.set_user_attr("fingerprint", dict(fingerprint))
    study.set_user_attr("cpu_identity_unverified", dict(unverified))


def write_probe(study: optuna.Study, probe: ProbeDoc) -> None:
    study.set_user_attr("probe", probe)


def write_flops(study: optuna.Study, per_sample: float | None, source: str) -> None:
    """The FLOPs per sample, counted once per study: every later trial is measured against
    the same figure."""
    study.set_user_attr("flops", {"per_sample": per_sample, "source": source})


def write_unapplied(study: optuna.Study, reasons: Mapping[str, str]) -> None:
    """The knobs a script was found never to apply, and why (fixed for every later worker)."""
    study.set_user_attr("unapplied", dict(reasons))


def write_model_size(study: optuna.Study, size: Mapping[str, Any]) -> None:
    """The model's size, counted once per study before its first sharded prediction."""
    study.set_user_attr("model_size", dict(size))


def write_confirmation(study: optuna.Study, doc: ConfirmationDoc) -> None:
    study.set_user_attr("confirmation", doc)


def write_diagnosis(study: optuna.Study, findings: list[FindingDoc]) -> None:
    """The exported winner's findings, for the dashboard."""
    study.set_user_attr("diagnosis", findings)
