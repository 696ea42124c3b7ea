"""Test doubles that ship with autotune: fake hardware and small workloads.

Only what this machine cannot have is faked (a GPU); everything else in the tests is real.
"""
