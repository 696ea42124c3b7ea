"""The bootstrap reaches training scripts nobody edited: a Hugging Face Trainer script and a
Lightning script, each of the usual shape and knowing nothing of autotune (tests/data/scripts),
tuned by `autotune run -- CMD` and run with their profile by `autotune launch`. Real
frameworks, real processes, no network; checked from what the trials recorded (the Trainer's
read-back), the user's folders and the scripts' own output."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
import yaml

from autotune.bootstrap import SITE
from tests.conftest import FAST, ROOT, autotune

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "data" / "scripts"
HF_SCRIPT, LIT_SCRIPT = SCRIPTS / "hf_mlm.py", SCRIPTS / "lit_unchanged.py"
HF_RESUME, LIT_OUTPUTS = SCRIPTS / "hf_resume.py", SCRIPTS / "lit_outputs.py"
# The suite's short trials, never pruned: a trial the pruner stops (a loaded machine slows one
# down) still reads back, but these tests count one read-back per trial asked for.
QUICK = [*FAST, "--no-prune"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2"]


def corpus(folder: Path) -> Path:
    """A local text file, one example per line."""
    rng = random.Random(0)
    words = "the a model trains on text and learns to fill masked words in each line".split()
    path = folder / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
                              for _ in range(1500)) + "\n")
    return path


def trials(folder: Path) -> list[optuna.trial.FrozenTrial]:
    url = f"sqlite:///{folder}/studies/autotune.db"
    (name,) = optuna.get_all_study_names(url)
    return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)


def read_backs(folder: Path) -> list[tuple[dict[str, object], dict[str, object]]]:
    """(config, the Trainer's read-back) of each trial that ran."""
    found = []
    for t in trials(folder):
        readback = (t.user_attrs.get("measurement") or {}).get("script", {}).get("readback")
        if readback is not None:
            found.append((t.user_attrs["config"], readback))
    return found


def files(folder: Path) -> dict[str, tuple[int, int]]:
    """Each file under ``folder`` but the study's (``studies/``): its size and when it was
    last written."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).parts[0] !=
            "studies"}


def trial_output(folder: Path) -> str:
    """What the study's only trial printed (its stdout and stderr)."""
    (log,) = (folder / "studies").glob("*/trials/*/stderr.log")
    return log.read_text(errors="replace")


def python(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{ROOT}", **env})


# -- inert where it must be ------------------------------------------------------------------------

HOOKED = textwrap.dedent("""
    import sys
    print(any(type(f).__name__ == "_PostImport" for f in sys.meta_path))
""")


def test_the_bootstrap_is_inert_outside_a_trial_and_in_processes_that_do_not_train(
        tmp_path: Path) -> None:
    trial = {"AUTOTUNE_BOOTSTRAP": "trial", "AUTOTUNE_TRIAL_DIR": str(tmp_path)}
    assert python(HOOKED, tmp_path, {}).stdout.split() == ["False"]  # on the path, not asked
    assert python(HOOKED, tmp_path, {"AUTOTUNE_BOOTSTRAP": "trial"}).stdout.split() == [
        "False"]  # a trial's mode without its folder
    # A process that trains is hooked; its multiprocessing workers (spawned, as DataLoader
    # workers under spawn are) are not.
    workers = textwrap.dedent("""
        import multiprocessing as mp, sys
        def hooked(_):
            return any(type(f).__name__ == "_PostImport" for f in sys.meta_path)
        if __name__ == "__main__":
            with mp.get_context("spawn").Pool(1) as pool:
                print(hooked(0), pool.map(hooked, [0])[0])
    """)
    script = tmp_path / "workers.py"
    script.write_text(workers)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{ROOT}", **trial})
    assert out.stdout.split() == ["True", "False"], out.stderr


def test_the_sitecustomize_it_shadows_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import pathlib\npathlib.Path('ran-theirs').write_text('yes')\n")
    out = subprocess.run([sys.executable, "-c", HOOKED], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={
                             **os.environ, "AUTOTUNE_BOOTSTRAP": "trial",
                             "AUTOTUNE_TRIAL_DIR": str(tmp_path),
                             "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT), str(theirs)])})
    assert out.stdout.split() == ["True"], out.stderr
    assert (tmp_path / "ran-theirs").read_text() == "yes"


# -- Hugging Face ----------------------------------------------------------------------------------

def hf_command(folder: Path, out: Path, *launcher: str) -> list[str]:
    return [*(launcher or [sys.executable]), str(HF_SCRIPT), "--train_file",
            str(corpus(folder)), "--output_dir", str(out), "--per_device_train_batch_size", "4",
            "--logging_steps", "5"]


def users_output(folder: Path) -> Path:
    out = folder / "my-output"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    return out


def test_an_unchanged_hf_trainer_script_is_tuned_and_runs_its_profile(tmp_path: Path) -> None:
    out = users_output(tmp_path)
    run = autotune("run", "--trials", "3", "--no-probe", *QUICK, "--param", "batch=4", "--",
                   *hf_command(tmp_path, out), cwd=tmp_path, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # no checkpoint, no model
    assert "autotune sets each trial's config on its Trainer (transformers" in run.stdout
    found = read_backs(tmp_path)
    assert len(found) == 3
    for config, readback in found:
        # What the Trainer ran, read back from its DataLoader and arguments, is the config.
        assert readback["seen"]["micro_batch_size"] == config["micro_batch_size"]
        assert readback["seen"]["malloc_retain"] == config["malloc_retain"]
        assert readback["seen"]["grad_accum_steps"] == config["grad_accum_steps"]
        assert readback["seen"]["num_workers"] == config["num_workers"]
        assert {"micro_batch_size", "grad_accum_steps", "num_workers"} <= set(
            readback["applied"])
        assert readback["fixed"] == {}
        assert {"output_dir", "save_strategy", "max_steps"} <= set(readback["isolated"])
    # The staged start retained host memory first (the lines carry it unless it read slower:
    # a tiny model's readings decide which), then moved the batch.
    assert [c["malloc_retain"] for c, _ in found][:2] == [False, True]
    assert {c["micro_batch_size"] for c, _ in found} != {4}
    assert not list((tmp_path / "studies").rglob("trainer-output"))  # removed after trials

    # The exported profile, applied to the same unchanged script with no edit and no flag.
    profile = next((tmp_path / "studies").glob("*/profile.yaml"))
    launched = autotune("launch", str(profile), "--", *hf_command(tmp_path, out),
                        "--max_steps", "3", cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    result = json.loads(launched.stdout.strip().splitlines()[-1])
    from autotune import load_profile

    tuned = load_profile(profile, check_fingerprint=False).config
    assert result["per_device_train_batch_size"] == tuned.micro_batch_size
    assert result["steps"] == 3 and result["output_dir"] == str(out)  # the user's, as set
    assert "the Trainer runs the profile's" in launched.stderr
    assert (out / "model.safetensors").exists()  # outside a trial the script saves as it does


def test_an_unchanged_hf_trainer_script_under_torchrun_reports_both_ranks(
        tmp_path: Path) -> None:
    out = users_output(tmp_path)
    run = autotune("run", "--trials", "1", "--no-probe", *QUICK, "--param", "batch=4", "--",
                   *hf_command(tmp_path, out, *TORCHRUN), cwd=tmp_path, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    done = [t for t in trials(tmp_path) if t.user_attrs.get("status") == "ok"]
    assert len(done) == 1
    for t in done:
        m = t.user_attrs["measurement"]
        assert [r["rank"] for r in m["ranks"]] == [0, 1]
        seen = m["script"]["readback"]["seen"]
        assert seen["micro_batch_size"] == t.user_attrs["config"]["micro_batch_size"]
        assert seen["ddp_bucket_cap_mb"] == t.user_attrs["config"]["ddp_bucket_cap_mb"]


def test_a_resume_asked_in_code_trains_from_the_start_in_a_trial(tmp_path: Path) -> None:
    """A script that resumes in code (``trainer.train(resume_from_checkpoint=True)``) and
    trains fine on its own is tuned: its trials train from the start, never read the user's
    checkpoints, and say so."""
    out = tmp_path / "my-output"
    command = [sys.executable, str(HF_RESUME), "--output_dir", str(out)]
    own = subprocess.run([*command, "--max_steps", "2", "--save_steps", "2"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert own.returncode == 0, own.stderr[-3000:]
    before = files(out)
    assert "checkpoint-2/model.safetensors" in before
    run = autotune("run", "--trials", "1", "--no-probe", *QUICK, "--", *command, "--resume",
                   "true", cwd=tmp_path, timeout=300)
    assert [t.user_attrs.get("status") for t in trials(tmp_path)] == ["ok"], \
        run.stdout[-3000:]
    assert files(out) == before
    ((_, readback),) = read_backs(tmp_path)
    assert "resume_from_checkpoint" in readback["isolated"]
    assert "autotune: train(resume_from_checkpoint=True) in a trial trains from the start" in \
        trial_output(tmp_path)


def test_launch_leaves_off_the_model_knobs_a_plain_module_under_a_trainer_cannot_take(
        tmp_path: Path) -> None:
    """Checkpointing on a plain ``torch.nn.Module`` under the Trainer once ended the script with
    ``AttributeError: ... gradient_checkpointing_enable``, while attention got a clean line:
    both are now left off with the reason, and the script trains."""
    from dataclasses import replace

    from autotune.config.knobs import Config
    from tests.test_profile import make

    config = Config(micro_batch_size=8, attention="eager", activation_checkpointing=True)
    profile = replace(make(), config=config).save(tmp_path / "profile.yaml")
    launched = autotune("launch", str(profile), "--", sys.executable, str(HF_RESUME),
                        "--output_dir", str(tmp_path / "out"), "--max_steps", "2",
                        cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert json.loads(launched.stdout.strip().splitlines()[-1])["steps"] == 2
    assert "autotune: not applied: activation_checkpointing=true needs a transformers model " \
           "(gradient_checkpointing_enable); Regression has none" in launched.stderr
    assert "autotune: not applied: attention=eager needs a transformers model " \
           "(set_attn_implementation); Regression has none" in launched.stderr


def test_a_value_the_trainer_refuses_after_the_baseline_fails_its_trial_and_is_fixed(
        tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"knobs": {"micro_batch_size": {"choices": [4]},
                                               "optimizer_impl": {"choices": ["default",
                                                                              "fused"]}}}))
    run = autotune("run", "--trials", "2", "--no-probe", *QUICK, "--param",
                   "batch=4", "--space", str(space), "--",
                   *hf_command(tmp_path, users_output(tmp_path)),
                   "--own_optimizer", "true", cwd=tmp_path, timeout=300)
    why = "optimizer_impl: the script passes its own optimizer to Trainer(optimizers=...)"
    outcomes = {t.user_attrs["config"]["optimizer_impl"]: (t.user_attrs["status"],
                                                           t.user_attrs.get("reason"))
                for t in trials(tmp_path)}
    assert outcomes == {"default": ("ok", None),
                        "fused": ("error", f"not this config's speed: {why}")}, run.stdout
    assert f"fixed: {why}" in run.stdout


# -- Lightning -------------------------------------------------------------------------------------

def test_an_unchanged_lightning_script_is_tuned_and_runs_its_profile(tmp_path: Path) -> None:
    package = "lightning"  # the older pytorch_lightning: the next test
    pytest.importorskip(package)
    command = [sys.executable, str(LIT_SCRIPT), "--package", package]
    second = tmp_path  # its DataLoader's batch is its own (16): measured against it
    space = second / "space.yaml"
    space.write_text(yaml.safe_dump({"knobs": {"micro_batch_size": {"choices": [16]},
                                               "grad_accum_steps": {"choices": [1, 2, 4]}}}))
    run = autotune("run", "--trials", "2", "--no-probe", *QUICK, "--param", "batch=16",
                   "--space", str(space), "--", *command, cwd=second)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = read_backs(second)
    assert len(found) == 2
    for config, readback in found:
        assert readback["via"].startswith(f"Lightning Trainer ({package.split('.')[0]}")
        assert readback["seen"]["grad_accum_steps"] == config["grad_accum_steps"]
        assert "grad_accum_steps" in readback["applied"]
        assert "a Lightning script sets its DataLoader's batch" in \
            readback["fixed"]["micro_batch_size"]
    assert {c["grad_accum_steps"] for c, _ in found} != {1}

    profile = next((second / "studies").glob("*/profile.yaml"))
    launched = autotune("launch", str(profile), "--", *command, "--epochs", "1", cwd=second)
    assert launched.returncode == 0, launched.stderr[-3000:]
    from autotune import load_profile

    tuned = load_profile(profile, check_fingerprint=False).config
    result = json.loads(launched.stdout.strip().splitlines()[-1])
    assert result["accumulate_grad_batches"] == tuned.grad_accum_steps


def test_what_a_lightning_script_sets_itself_wins_and_is_reported(tmp_path: Path) -> None:
    package = "pytorch_lightning"  # the older package here; the current one: the test above
    pytest.importorskip(package)
    run = autotune("run", "--trials", "1", "--no-probe", *QUICK, "--", sys.executable,
                   str(LIT_SCRIPT), "--package", package, "--precision", "bf16-mixed",
                   cwd=tmp_path)
    # Its DataLoader's batch (16) is out of the bootstrap's reach: the run stops at the
    # baseline, which trained another batch than its config's, and says what to pass.
    assert "autotune cannot set the batch of its Lightning Trainer" in run.stdout, \
        run.stdout[-3000:]
    assert "pass --param batch=16" in run.stdout
    # Its explicit precision wins over the environment's default, and is reported.
    ((config, readback),) = read_backs(tmp_path)
    assert config["amp"] == "off" and readback["seen"]["amp"] == "bf16", run.stdout[-2000:]
    assert readback["via"].startswith(f"Lightning Trainer ({package} ")
    assert readback["fixed"]["amp"] == (f"amp=off was set, but the {readback['via']} runs "
                                        "bf16: the script sets it itself")


def test_a_lightning_trial_leaves_the_users_logs_checkpoints_and_resume_alone(
        tmp_path: Path) -> None:
    """A script of the shape of Lightning's own examples: Lightning's default logger and
    checkpoint in the working directory, ``fit(ckpt_path=...)`` to resume, ``test`` and
    ``save_checkpoint`` after fitting. Under ``launch`` it writes all of that where it does;
    its trials write none of it, train from the start, and the run says so once."""
    pytest.importorskip("lightning")
    from dataclasses import replace

    from autotune.config.knobs import Config
    from tests.test_profile import make

    profile = replace(make(), config=Config()).save(tmp_path / "profile.yaml")
    command = [sys.executable, str(LIT_OUTPUTS)]
    own = autotune("launch", str(profile), "--", *command, "--epochs", "1", cwd=tmp_path)
    assert own.returncode == 0, own.stderr[-3000:]
    version = tmp_path / "lightning_logs" / "version_0"
    (checkpoint,) = (version / "checkpoints").glob("*.ckpt")
    assert (version / "metrics.csv").exists()
    before = files(tmp_path)

    run = autotune("run", "--trials", "1", "--no-probe", *QUICK, "--param", "batch=16", "--",
                   *command, "--resume", str(checkpoint), "--save", "final.ckpt",
                   cwd=tmp_path)
    assert [t.user_attrs.get("status") for t in trials(tmp_path)] == ["ok"], \
        run.stdout[-3000:]
    assert files(tmp_path) == before  # no lightning_logs/version_1, no final.ckpt
    assert not list((tmp_path / "studies").rglob("trainer-output"))  # removed after the trial
    ((_, readback),) = read_backs(tmp_path)
    off = ["default_root_dir", "logger", "checkpoint_callbacks", "ckpt_path"]
    assert readback["isolated"] == off
    assert f"in trials its outputs go to the trial's folder, with {', '.join(off)} " \
        "overridden" in run.stdout
    printed = trial_output(tmp_path)
    assert "training from step 0" in printed
    assert f"autotune: fit(ckpt_path={str(checkpoint)!r}) in a trial trains from the start" \
        in printed


def test_a_trials_lightning_trainer_writes_nothing_through_the_scripts_logger_or_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A logger and a checkpoint callback the script passes itself write nothing where it put
    them in a trial; the Trainer's folder (``trainer.log_dir``) is the trial's."""
    pl = pytest.importorskip("lightning.pytorch")
    import importlib.util

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from autotune import steps
    from autotune.bootstrap import TRAINER_OUTPUT
    from autotune.bootstrap import lightning as bootstrap

    spec = importlib.util.spec_from_file_location("lit_outputs", LIT_OUTPUTS)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    user, trial = tmp_path / "user", tmp_path / "trial"
    user.mkdir()
    monkeypatch.chdir(user)
    monkeypatch.setenv(steps.TRIAL_DIR_ENV, str(trial))
    monkeypatch.setattr(bootstrap, "_isolated", [])
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=CSVLogger("csv_logs"),
                         callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=1)],
                         enable_progress_bar=False, enable_model_summary=False)
    bootstrap.isolate(trainer, "lightning.pytorch")
    trainer.fit(script.Regression(), script.loader(64, 0), script.loader(16, 1))
    assert trainer.global_step == 3
    assert list(user.iterdir()) == []
    assert trainer.log_dir == str(trial / TRAINER_OUTPUT)
    assert bootstrap._isolated == ["default_root_dir", "logger", "checkpoint_callbacks"]


def test_a_resume_in_code_is_dropped_in_a_trial_and_kept_under_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """However the script passes it (a path or True, by position or keyword), a trial trains
    from the start; under ``launch`` the script's resume reaches its Trainer as written."""
    import inspect
    from typing import Any

    from autotune.bootstrap import hf, lightning
    from tests.test_profile import make

    asked: list[object] = []

    class Trainer:
        ckpt_path = None

        def train(self, resume_from_checkpoint: object = None, trial: object = None) -> None:
            asked.append(resume_from_checkpoint)

        def fit(self, model: object, train_dataloaders: object = None,
                val_dataloaders: object = None, datamodule: object = None,
                ckpt_path: object = None) -> None:
            asked.append(ckpt_path)

    train = hf._fresh_in_trials(Trainer.train)
    for mode in ("trial", "launch"):
        state = hf._State(mode, make().config, "cpu")
        monkeypatch.setattr(hf, "_state", lambda state=state: state)
        train(Trainer(), "out/checkpoint-2")
        train(Trainer(), resume_from_checkpoint=True)
        train(Trainer(), resume_from_checkpoint=False)
        assert state.isolated == (["resume_from_checkpoint"] if mode == "trial" else [])
    assert asked == [None, None, False, "out/checkpoint-2", True, False]

    asked.clear()
    monkeypatch.setattr(lightning, "_isolated", [])
    fit = inspect.signature(Trainer.fit)
    trainer: Any = Trainer()
    for args, kwargs in ((("model", None, None, None, "last.ckpt"), {}),
                         (("model",), {"ckpt_path": "last.ckpt"}), (("model",), {})):
        args, kwargs = lightning._fresh(trainer, fit, args, kwargs)
        trainer.fit(*args, **kwargs)
    trainer.ckpt_path = "set.ckpt"  # Lightning's trainer.ckpt_path, set before fit
    lightning._fresh(trainer, fit, ("model",), {})
    assert trainer.ckpt_path is None
    assert asked == [None, None, None] and lightning._isolated == ["ckpt_path"]


# -- what the bootstrap may set --------------------------------------------------------------------

def test_a_scripts_trial_caps_the_cuda_allocator_at_the_memory_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import torch

    from autotune.bootstrap.memory import LIMIT_ENV, cap_cuda_allocator
    from autotune.testing.cuda import recorded_cuda

    gpu, cpu = SimpleNamespace(type="cuda", index=0), SimpleNamespace(type="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with recorded_cuda(total_memory=80 * 2**30) as calls:
        assert cap_cuda_allocator(gpu) is None  # no limit in the environment
        monkeypatch.setenv(LIMIT_ENV, str(20 * 2**30))
        assert cap_cuda_allocator(cpu) is None
        assert cap_cuda_allocator(gpu) == 0.25
    assert calls == [("set_per_process_memory_fraction", 0.25, gpu)]


def test_only_tuned_fields_and_the_trials_isolation_reach_training_arguments() -> None:
    """A profile's values reach TrainingArguments only through the knobs' fields (checked by
    the knob registry when the profile loads); a trial adds only what keeps the user's outputs
    alone. Never a field that names a file or code to load, a hub or a tracker."""
    from dataclasses import replace

    from autotune.bootstrap.hf import ISOLATION
    from autotune.config.frameworks import HF_FIELD_KNOB
    from autotune.config.knobs import Config
    from autotune.integrations.hf import training_args
    from tests.test_profile import make

    every = make()
    for config in (Config(), Config(micro_batch_size=32, grad_accum_steps=4, amp="bf16",
                                    num_workers=2, prefetch_factor=4, compile="default",
                                    activation_checkpointing=True, matmul_precision="high",
                                    optimizer_impl="fused", world_size=2,
                                    ddp_static_graph=True)):
        for device in ("cpu", "cuda"):
            fields = set(training_args(config, device))
            assert fields <= set(HF_FIELD_KNOB) | {"use_cpu"}, fields
        # A profile in place of the config and device, as before they were taken apart.
        profile = replace(every, config=config)
        assert training_args(profile) == profile.hf_training_args()
    never = {"deepspeed", "accelerator_config", "hub_token",
             "hub_model_id", "push_to_hub", "report_to", "resume_from_checkpoint", "run_name"}
    assert not set(HF_FIELD_KNOB) & never
    # FSDP's fields (a sharded config on GPUs) carry a flag and a dict of fixed keys and plain
    # values, never a path (fsdp_config may name a JSON file) nor a class or module to load.
    sharded = training_args(Config(world_size=2, sharding="shard-grad-op", cpu_offload=True),
                            "cuda")
    assert sharded["fsdp"] is True
    assert sharded["fsdp_config"] == {"version": 2, "reshard_after_forward": False,
                                      "cpu_offload": True}
    # What a trial sets of those, it sets to off.
    assert {ISOLATION[k] for k in never & set(ISOLATION)} <= {None, False, "none"}


def test_hf_args_paste_into_the_trainers_own_parser_as_the_profile(tmp_path: Path) -> None:
    """`autotune profile show --hf-args` prints flags that HfArgumentParser reads back as the
    profile's values."""
    import shlex
    from dataclasses import replace

    from transformers import HfArgumentParser, TrainingArguments

    from autotune.config.knobs import Config
    from tests.test_profile import make

    path = tmp_path / "profile.yaml"
    config = Config(micro_batch_size=16, grad_accum_steps=2, num_workers=2, prefetch_factor=4,
                    optimizer_impl="foreach", activation_checkpointing=True)
    replace(make(), config=config).save(path)
    shown = autotune("profile", "show", "--hf-args", str(path), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    flags, *comments = shown.stdout.strip().splitlines()
    assert comments == ["# optimizer_impl=foreach: no TrainingArguments flag sets it; "
                        "`autotune launch` does"]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args=[*shlex.split(flags), "--output_dir", str(tmp_path / "out")])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (16, 2)
    assert (args.dataloader_num_workers, args.dataloader_prefetch_factor) == (2, 4)
    checkpointing = getattr(args, "activation_checkpointing", None) or \
        args.gradient_checkpointing
    assert checkpointing is True


def test_the_trainers_model_gets_the_attention_or_the_reason_it_cannot() -> None:
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from autotune.bootstrap.hf import _prepare_model, _State
    from autotune.config.knobs import Config

    state = _State("trial", Config(attention="eager"), "cpu")
    model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=32))
    _prepare_model(model, state)
    assert model.config._attn_implementation == "eager" and state.unreachable == {}
    _prepare_model(torch.nn.Linear(2, 2), state)
    assert state.unreachable == {"attention": "attention=eager needs a transformers model "
                                              "(set_attn_implementation); Linear has none"}


def test_a_trials_lightning_defaults_name_the_precision_as_the_profiles_kwargs_do() -> None:
    """The ``PL_TRAINER_PRECISION`` a trial's environment holds is the ``precision`` a script
    gets from ``lightning_trainer_kwargs()``: one name per amp value (``config.frameworks``)."""
    from autotune.bootstrap import trainer_env
    from autotune.config.frameworks import lightning_precision

    for amp, name in (("off", "32-true"), ("bf16", "bf16-mixed"), ("fp16", "16-mixed")):
        assert lightning_precision(amp) == trainer_env(amp, 1)["PL_TRAINER_PRECISION"] == name
