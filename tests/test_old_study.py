"""A study written by an earlier autotune still lists, draws its dashboard and resumes.

The fixture is the SQLite file of a real `mlp` study tuned by autotune 0.1.0 at commit c7a29dd,
before the tuner's record of a trial became typed; ``tests/fixtures/README.md`` says how it was
made and what it holds. The tests drive today's code through the `autotune` command and
`autotune.load_profile` only, each on its own copy of the file, and check what cannot flake:
counts, states, which trials exist, that the exported profile loads. Optuna reads the copy
directly only to compare the old trials before and after the resume.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import optuna
import pytest

import autotune
from tests.conftest import autotune as run_cli

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "study-0.1.0-c7a29dd.db"
STUDY = "old-mlp"
# The flags that tuned it (tests/fixtures/README.md), but for --trials and --storage.
FLAGS = ["run", "--model", "mlp", "--study", STUDY, "--memory-limit", "420MiB",
         "--trial-seconds", "6", "--window-seconds", "0.5", "--trial-timeout", "60s",
         "--confirm-top", "1", "--confirm-rounds", "2"]
MEASURED = 12  # its --trials: every trial ran (none was ruled out by a model)
# (Optuna state, autotune's status) of its trials, as the earlier autotune recorded them.
OUTCOMES = {("COMPLETE", "ok"): 7, ("COMPLETE", "oom"): 2, ("PRUNED", "pruned"): 3}
BASELINE_TRIAL = 0
WINNER_TRIAL, WINNER_BATCH = 3, "256x1"  # confirmed side by side: micro-batch 256, no accumulation


@pytest.fixture
def old_study(tmp_path: Path) -> Path:
    """A copy of the fixture (the tests write to their study; the fixture stays as it was)."""
    db = tmp_path / "old-study.db"
    shutil.copyfile(FIXTURE, db)
    return db


def url(db: Path) -> str:
    return f"sqlite:///{db}"


def trials(db: Path) -> list[optuna.trial.FrozenTrial]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=STUDY, storage=url(db)).get_trials(deepcopy=False)


def listed_row(db: Path) -> list[str]:
    """The words of the study's row in `autotune studies`."""
    result = run_cli("studies", "--storage", url(db), cwd=db.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if STUDY in line]
    assert len(rows) == 1, result.stdout
    return re.findall(r"[\w.,:%-]+", rows[0])


def test_the_fixture_is_the_study_it_says(old_study: Path) -> None:
    """What the other tests take for granted about the file (read with Optuna, as written)."""
    found = trials(old_study)
    assert len(found) == MEASURED
    assert Counter((t.state.name, t.user_attrs.get("status")) for t in found) == OUTCOMES
    assert found[BASELINE_TRIAL].user_attrs.get("baseline") is True
    assert found[WINNER_TRIAL].user_attrs["config"]["micro_batch_size"] == 256


def test_an_old_study_is_listed_with_its_trials(old_study: Path) -> None:
    row = listed_row(old_study)
    assert row[0] == STUDY
    assert str(MEASURED) in row


def test_an_old_study_draws_its_dashboard(old_study: Path) -> None:
    html = old_study.parent / "dashboard.html"
    result = run_cli("dashboard", "--storage", url(old_study), "--study", STUDY,
                     "--out", str(html), cwd=old_study.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    page = html.read_text()
    # What a reader sees, without the figures' scripts (their colours read "#3...").
    shown = re.sub(r"<script.*?</script>", "", page, flags=re.S)
    assert STUDY in shown
    assert re.search(rf"#{WINNER_TRIAL}(?![0-9A-Fa-f])", shown), "the winner's trial is not named"
    assert WINNER_BATCH in shown, "the winner's config is not shown"


def measured_here(db: Path) -> Path:
    """Make the copy's fingerprint this machine's, in the old record's own keys, and return a
    search space that searches here what the study searched there: the fixture was tuned on a
    CPU without native bf16, and the resume guard rightly refuses a study from other hardware
    or over another space (tests/test_study.py tests both refusals); here the point is that an
    old record resumes, on whatever CPU runs the tests. The space is the default one with amp
    fp32 only, which is what that CPU narrowed it to."""
    from autotune.machine.hardware import detect

    default = (Path(__file__).parent.parent / "search_spaces" / "default.yaml").read_text()
    line = '  amp: {choices: ["off", fp16, bf16]}'
    assert line in default, "the default space's amp line changed: update this test"
    space = db.parent / "fp32.yaml"
    space.write_text(default.replace(line, '  amp: {choices: ["off"]}'))
    with sqlite3.connect(db) as c:
        (stored,) = c.execute("select value_json from study_user_attributes "
                              "where key = 'fingerprint'").fetchone()
        here = detect().fingerprint()
        mine = {k: here.get(k, v) for k, v in json.loads(stored).items()}
        c.execute("update study_user_attributes set value_json = ? where key = 'fingerprint'",
                  (json.dumps(mine),))
    return space


def test_an_old_study_resumes_and_exports_a_profile(old_study: Path) -> None:
    space = measured_here(old_study)
    before = trials(old_study)
    # No confirmation this time (its rounds are tested elsewhere): the resume is the point.
    result = run_cli(*FLAGS, "--confirm-top", "0", "--trials", str(MEASURED + 1), "--storage",
                     url(old_study), "--space", str(space),
                     cwd=old_study.parent, timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # A knob newer than the study is searched from now on, and said so.
    assert "before malloc_retain could be searched" in result.stdout + result.stderr

    after = trials(old_study)
    assert after[:len(before)] == before, "the resume changed the old trials"
    new = after[len(before):]
    assert new, "the resume ran no trial"
    assert all(t.state.is_finished() for t in new), [t.state.name for t in new]
    row = listed_row(old_study)
    assert str(MEASURED + 1) in row

    profile = autotune.load_profile(old_study.parent / "studies" / STUDY / "profile.yaml")
    assert profile.workload["name"] == "mlp"
    assert profile.provenance["study"] == STUDY
    assert profile.provenance["trials"] == MEASURED + 1


def tamper(db: Path, trial_config: dict[int, object], confirmation: object) -> None:
    """Rewrite stored attributes as another member of a shared study could (Optuna will not
    update a finished trial: SQL does)."""
    with sqlite3.connect(db) as c:
        for number, value in trial_config.items():
            c.execute("update trial_user_attributes set value_json = ? where key = 'config' and "
                      "trial_id = (select trial_id from trials where number = ?)",
                      (json.dumps(value), number))
        c.execute("update study_user_attributes set value_json = ? where key = 'confirmation'",
                  (json.dumps(confirmation),))


def test_malformed_records_of_a_shared_study_are_left_out_and_said_once(old_study: Path) -> None:
    bad = {2: "rm -rf /", 5: {"micro_batch_size": "8; rm"}}
    tamper(old_study, bad, confirmation="not a confirmation")
    result = run_cli("studies", "--storage", url(old_study), cwd=old_study.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    row = [line for line in result.stdout.splitlines() if STUDY in line]
    assert re.findall(r"[\w.,:%-]+", row[0])[1] == str(MEASURED - len(bad))
    said = [line for line in result.stderr.splitlines() if "not a record autotune wrote" in line]
    assert sorted(re.findall(r"trial (\d+)", " ".join(said))) == ["2", "5"]
    assert len([s for s in said if "confirmation" in s]) == 1
    assert all(s.startswith("autotune: warning: ") for s in said), said
    assert "search only" in row[0]  # the confirmation was left out, so nothing is confirmed

    html = old_study.parent / "dashboard.html"
    drawn = run_cli("dashboard", "--storage", url(old_study), "--study", STUDY,
                    "--out", str(html), cwd=old_study.parent)
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    assert html.is_file()
