"""Profiles: the exported winner, in schema ``autotune.profile/v2`` (v1 still loads; see
DESIGN.md), and how a training script applies one.

- ``schema``: the ``Profile``, its file form, and the calls a training script makes;
- ``documents``: the types of its blocks (result, baseline, confirmation, provenance, ...);
- ``load`` and ``validate``: reading a file safely and checking every value it holds;
- ``env``: the environment it sets (``apply_env``, ``autotune launch``);
- ``describe``: its summary and diffs, for a human.

Imported by training scripts: it needs torch only inside the methods that make torch objects,
and never the tuner or Optuna.
"""

from __future__ import annotations

from autotune.profile.describe import fingerprint_diff, profile_diff
from autotune.profile.documents import (
    BaselineDoc,
    CandidateDoc,
    CompileDoc,
    ConfirmationDoc,
    DecisionDoc,
    EfficiencyDoc,
    FindingDoc,
    ProbeDoc,
    ProvenanceDoc,
    RankDoc,
    ResultDoc,
)
from autotune.profile.env import PROFILE_ENV, launch_env
from autotune.profile.load import (
    MAX_PROFILE_BYTES,
    MAX_PROFILE_NODES,
    FingerprintWarning,
    load_profile,
)
from autotune.profile.schema import READS, SCHEMA, SCHEMA_VERSION, Profile
from autotune.profile.validate import from_dict

__all__ = [
    "MAX_PROFILE_BYTES", "MAX_PROFILE_NODES", "PROFILE_ENV", "READS", "SCHEMA", "SCHEMA_VERSION",
    "BaselineDoc", "CandidateDoc", "CompileDoc", "ConfirmationDoc", "DecisionDoc",
    "EfficiencyDoc", "FindingDoc", "FingerprintWarning", "ProbeDoc", "Profile", "ProvenanceDoc",
    "RankDoc", "ResultDoc", "fingerprint_diff", "from_dict", "launch_env", "load_profile",
    "profile_diff",
]
