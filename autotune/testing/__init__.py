"""Test doubles that ship with autotune: fake hardware, small workloads, and stand-ins for what
a run measures and records.

Only what this machine cannot have is faked (a GPU); everything else in the tests is real. Where a
test is about what the tuner decides rather than about a process, the real tuner runs in-process
with its trials replayed (``replay.ReplayMeasurer``, injected as ``Runner(..., measure=)``), or
starts from a study crafted through the tuner's own record path (``records.CraftedStudy``).
"""
