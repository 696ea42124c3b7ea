from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from autotune.config.knobs import Config
from autotune.errors import ProfileError
from autotune.machine.hardware import detect
from autotune.profile import SCHEMA, FingerprintWarning, Profile, load_profile, profile_diff

FIXTURE = Path(__file__).parent / "data" / "profile_v1.yaml"


def make(fingerprint: dict | None = None) -> Profile:
    return Profile(
        workload={"name": "mlp", "spec": "mlp", "params": {}},
        config=Config(micro_batch_size=64, grad_accum_steps=2, amp="bf16"), env={},
        result={"samples_per_sec": 120.5, "spread_cv": 0.01, "peak_memory_bytes": 10,
                "memory_limit_bytes": 100},
        baseline={"config": Config().to_dict(), "samples_per_sec": 60.0}, speedup=2.008,
        fingerprint=fingerprint if fingerprint is not None else detect().fingerprint(),
        provenance={"study": "s", "storage": "sqlite:///x.db", "trials": 5})


def test_round_trip(tmp_path: Path) -> None:
    path = make().save(tmp_path / "p" / "profile.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same machine: no fingerprint warning
        loaded = load_profile(path)
    assert loaded == make()
    assert loaded.micro_batch_size == 64 and loaded.accumulation_steps == 2
    assert yaml.safe_load(path.read_text())["schema"] == SCHEMA


def test_example_profiles_load() -> None:
    examples = sorted((Path(__file__).parents[1] / "studies" / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        profile = load_profile(path, check_fingerprint=False)
        assert profile.samples_per_sec > 0 and profile.speedup and profile.speedup > 1


def test_the_example_saves_back_as_its_file_holds_it(tmp_path: Path) -> None:
    """The blocks are typed (``profile.documents``) but stay the plain dicts the YAML holds:
    a script reads ``profile.result["samples_per_sec"]``, and the file round-trips unchanged."""
    (path,) = sorted((Path(__file__).parents[1] / "studies" / "examples").glob("*.yaml"))
    profile = load_profile(path, check_fingerprint=False)
    assert type(profile.result) is dict and profile.result["samples_per_sec"] > 0
    assert profile.confirmation and profile.confirmation["decision"]["decided_by"] == "median"
    saved = profile.save(tmp_path / "again.yaml")
    assert yaml.safe_load(saved.read_text()) == yaml.safe_load(path.read_text())


def test_warnings_point_at_the_scripts_own_call(tmp_path: Path) -> None:
    """A warning names the line of the training script that caused it, not autotune's."""
    path = make(detect().fingerprint() | {"cpu_model": "Other CPU"}).save(tmp_path / "p.yaml")
    with pytest.warns(FingerprintWarning) as caught:
        load_profile(path)
    assert caught[0].filename == __file__
    p = load_profile(NCCL_FIXTURE, check_fingerprint=False)
    with pytest.warns(UserWarning, match="replaced by the profile's") as caught:
        p.apply_env({"NCCL_ALGO": "Ring"})
    assert caught[0].filename == __file__


def test_v1_fixture_still_loads() -> None:
    profile = load_profile(FIXTURE, check_fingerprint=False)
    assert profile.config.amp == "bf16" and profile.speedup == pytest.approx(2.41)


def test_unknown_schema_names_both_versions(tmp_path: Path) -> None:
    data = make().to_dict() | {"schema": "autotune.profile/v9"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="'autotune.profile/v9'.*'autotune.profile/v2'"):
        load_profile(tmp_path / "p.yaml")


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    text = make().save(tmp_path / "p.yaml").read_text()
    (tmp_path / "cut.yaml").write_text(text[: len(text) // 3])
    with pytest.raises(ProfileError, match="damaged|truncated"):
        load_profile(tmp_path / "cut.yaml")


def test_python_tags_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "evil.yaml").write_text(
        f"schema: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ProfileError, match="Python object tag"):
        load_profile(tmp_path / "evil.yaml")
    assert not marker.exists()


def test_fingerprint_mismatch_warns_naming_fields(tmp_path: Path) -> None:
    fp = detect().fingerprint() | {"cpu_model": "Other CPU", "gpu_count": 8}
    path = make(fp).save(tmp_path / "p.yaml")
    with pytest.warns(FingerprintWarning, match="cpu_model: 'Other CPU'.*gpu_count: 8"):
        load_profile(path)


DATA = Path(__file__).parent / "data"
DDP_FIXTURE = DATA / "profile_v1_ddp.yaml"
NCCL_FIXTURE = DATA / "profile_v1_nccl.yaml"


@pytest.mark.parametrize("path", [FIXTURE, DDP_FIXTURE, NCCL_FIXTURE], ids=lambda p: p.stem)
def test_every_v1_fixture_loads_and_saves_back_unchanged(path: Path, tmp_path: Path) -> None:
    profile = load_profile(path, check_fingerprint=False)
    again = load_profile(profile.save(tmp_path / "p.yaml"), check_fingerprint=False)
    assert again == profile and profile.schema == SCHEMA


@pytest.mark.parametrize("schema, needle", [
    ("autotune.profile/v3", "newer than this autotune reads .'autotune.profile/v2'.: upgrade"),
    ("autotune.profile/v0", "older than this autotune reads .'autotune.profile/v2'.: re-export"),
    ("deepspeed.config/v1", "not an autotune profile schema; this autotune reads "
                            "'autotune.profile/v2'"),
    (None, "None, which is not an autotune profile schema"),
])
def test_other_schemas_are_refused_naming_both_versions(tmp_path: Path, schema: str | None,
                                                        needle: str) -> None:
    data = make().to_dict() | {"schema": schema}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=needle):
        load_profile(tmp_path / "p.yaml")


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9])
def test_a_file_cut_anywhere_is_a_clear_error(tmp_path: Path, cut: float) -> None:
    text = make().save(tmp_path / "p.yaml").read_text()
    (tmp_path / "cut.yaml").write_text(text[: int(len(text) * cut)])
    with pytest.raises(ProfileError, match="damaged"):
        load_profile(tmp_path / "cut.yaml")


def test_damaged_contents_name_every_problem(tmp_path: Path) -> None:
    data = make().to_dict()
    del data["fingerprint"]
    data["config"]["warp_speed"] = 9
    data["env"] = {"NCCL_ALGO": 3}
    data["speedup"] = "fast"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError) as err:
        load_profile(tmp_path / "p.yaml")
    for needle in ("lacks fingerprint", "warp_speed", "env whose names and values",
                   "speedup that is not a positive number", "re-export"):
        assert needle in str(err.value)
    (tmp_path / "bin.yaml").write_bytes(b"\x00\xff\xfe garbage")
    with pytest.raises(ProfileError, match="damaged|not text"):
        load_profile(tmp_path / "bin.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ProfileError, match="expected a mapping, got list"):
        load_profile(tmp_path / "list.yaml")


def test_a_python_tag_deep_in_the_file_is_refused_too(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = make().save(tmp_path / "p.yaml").read_text().replace(
        "speedup: 2.008", f"speedup: !!python/object/apply:os.system ['touch {marker}']")
    (tmp_path / "evil.yaml").write_text(text)
    with pytest.raises(ProfileError, match="Python object tag .*never loaded"):
        load_profile(tmp_path / "evil.yaml")
    assert not marker.exists()


def test_load_profile_without_a_path_reads_the_launch_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune

    monkeypatch.delenv("AUTOTUNE_PROFILE", raising=False)
    with pytest.raises(ProfileError, match="AUTOTUNE_PROFILE is not set"):
        autotune.load_profile()
    monkeypatch.setenv("AUTOTUNE_PROFILE", str(make().save(tmp_path / "p.yaml")))
    assert autotune.load_profile() == make()


def test_training_kwargs_follow_the_config() -> None:
    p = load_profile(DDP_FIXTURE, check_fingerprint=False)
    assert (p.micro_batch_size, p.accumulation_steps, p.world_size, p.samples_per_step) == \
        (32, 2, 2, 128)
    assert p.dataloader_kwargs("cpu") == {"batch_size": 32, "num_workers": 1,
                                          "pin_memory": False, "prefetch_factor": 4,
                                          "persistent_workers": True}
    assert p.ddp_kwargs() == {"bucket_cap_mb": 10, "gradient_as_bucket_view": True}
    nccl = load_profile(NCCL_FIXTURE, check_fingerprint=False)
    assert nccl.dataloader_kwargs("cuda")["pin_memory"] is True
    assert nccl.dataloader_kwargs("cpu")["pin_memory"] is False  # pinning only feeds a GPU
    assert nccl.env == {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}
    single = load_profile(FIXTURE, check_fingerprint=False)
    assert single.dataloader_kwargs("cpu") == {"batch_size": 16, "num_workers": 0,
                                               "pin_memory": False}


def test_autocast_and_grad_scaler_follow_the_precision() -> None:
    import torch

    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    bf16 = load_profile(FIXTURE, check_fingerprint=False)
    with bf16.autocast("cpu"):
        assert layer(x).dtype == torch.bfloat16
    fp32 = make()
    fp32 = Profile(**{**fp32.__dict__, "config": Config(amp="off")})
    with fp32.autocast("cpu"):
        assert layer(x).dtype == torch.float32
    assert not bf16.grad_scaler("cpu").is_enabled()  # bf16 needs no loss scaling
    from autotune.trial.apply import uses_grad_scaler

    assert uses_grad_scaler(Config(amp="fp16"), "cuda")
    assert not uses_grad_scaler(Config(amp="bf16"), "cuda")


def test_apply_env_sets_warns_on_replace_and_refuses_in_a_process_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    p = load_profile(NCCL_FIXTURE, check_fingerprint=False)
    environ: dict[str, str] = {"NCCL_ALGO": "Ring"}
    with pytest.warns(UserWarning, match="NCCL_ALGO=Ring in the environment replaced by the "
                                         "profile's NCCL_ALGO=Tree"):
        assert p.apply_env(environ) == {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}
    assert environ == {"NCCL_ALGO": "Tree", "NCCL_PROTO": "Simple"}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ProfileError, match="after the process group started"):
            p.apply_env({})
    finally:
        dist.destroy_process_group()


def test_hugging_face_training_arguments_take_the_kwargs(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    p = load_profile(DDP_FIXTURE, check_fingerprint=False)
    kwargs = p.hf_training_args()
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)
    assert args.per_device_train_batch_size == 32 and args.gradient_accumulation_steps == 2
    assert args.bf16 and not args.fp16 and args.use_cpu
    assert (args.dataloader_num_workers, args.dataloader_prefetch_factor,
            args.dataloader_pin_memory) == (1, 4, False)
    assert args.ddp_bucket_cap_mb == 10


def test_lightning_trainer_takes_the_kwargs() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    p = load_profile(DDP_FIXTURE, check_fingerprint=False)
    kwargs = p.lightning_trainer_kwargs()
    assert kwargs["precision"] == "bf16-mixed" and kwargs["accumulate_grad_batches"] == 2
    assert isinstance(kwargs["strategy"], DDPStrategy)
    assert kwargs["strategy"]._ddp_kwargs == {"bucket_cap_mb": 10,
                                              "gradient_as_bucket_view": True}
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu", **kwargs)
    assert trainer.accumulate_grad_batches == 2 and trainer.num_devices == 2
    single = load_profile(FIXTURE, check_fingerprint=False).lightning_trainer_kwargs()
    assert single == {"precision": "bf16-mixed", "accumulate_grad_batches": 1}


def test_diff_and_summary_name_what_matters() -> None:
    a = load_profile(DDP_FIXTURE, check_fingerprint=False)
    b = load_profile(NCCL_FIXTURE, check_fingerprint=False)
    lines = profile_diff(a, b)
    assert "config.nccl_algo: 'default' -> 'Tree'" in lines
    assert "env.NCCL_ALGO: None -> 'Tree'" in lines
    assert "workload.spec: 'mlp' -> 'bert'" in lines
    assert any(line.startswith("fingerprint.device: 'cpu' -> 'cuda'") for line in lines)
    assert profile_diff(a, a) == []
    text = b.summary()
    for needle in ("32 per micro-batch x 2 accumulation x 2 rank(s) = 128", "9,000.00 samples/s",
                   "NCCL_ALGO=Tree NCCL_PROTO=Simple", "2 x NVIDIA H200", "speedup 1.5x"):
        assert needle in text, text


def test_a_v1_profile_loads_with_the_model_knobs_at_their_baseline() -> None:
    p = load_profile(FIXTURE, check_fingerprint=False)
    assert (p.config.compile, p.config.optimizer_impl, p.config.matmul_precision,
            p.config.attention, p.config.activation_checkpointing, p.config.cpu_threads) == \
        ("off", "default", "highest", "default", False, 0)
    assert p.optimizer_kwargs() == {} and p.attn_implementation is None
    assert "torch_compile" not in p.hf_training_args()


def test_the_model_knobs_reach_a_training_script_through_the_profile(tmp_path: Path) -> None:
    import torch
    from transformers import BertConfig, BertForMaskedLM, TrainingArguments

    tuned = Config(micro_batch_size=8, optimizer_impl="fused", compile="default",
                   attention="eager", activation_checkpointing=True, cpu_threads=1)
    p = replace(make(), config=tuned)
    before = torch.get_num_threads()
    try:
        assert p.apply_torch_flags()["threads"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    model = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=64))
    prepared = p.prepare_model(model)
    assert type(prepared).__name__ == "OptimizedModule"  # compiled, lazily: nothing ran yet
    assert model.config._attn_implementation == "eager" and model.is_activation_checkpointing
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **p.optimizer_kwargs())
    assert optimizer.param_groups[0]["fused"] is True
    assert p.attn_implementation == "eager"
    kwargs = p.hf_training_args()
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)
    assert args.torch_compile and args.activation_checkpointing
    assert str(args.optim.value) == "adamw_torch_fused"
    assert kwargs["activation_checkpointing_kwargs"] == {"use_reentrant": False}


def _pasted(profile: Profile, own: list[str], tmp_path: Path) -> tuple[object, str]:
    """What HfArgumentParser makes of a script's ``own`` flags with ``profile show --hf-args``
    pasted after them, and the printed text."""
    import shlex

    from transformers import HfArgumentParser, TrainingArguments
    from typer.testing import CliRunner

    from autotune.cli import app

    path = profile.save(tmp_path / "profile.yaml")
    shown = CliRunner().invoke(app, ["profile", "show", "--hf-args", str(path)])
    assert shown.exit_code == 0, shown.output
    flags = shown.stdout.splitlines()[0]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args=[*own, *shlex.split(flags), "--output_dir", str(tmp_path / "out")])
    return args, shown.stdout


def test_hf_args_keep_the_trainers_optimizer_and_its_defaults(tmp_path: Path) -> None:
    """A profile that kept the optimizer's own implementation moves neither the Trainer's
    default optimizer nor a script's own; every tuned field is printed, also at
    TrainingArguments' default, so that pasted after the script's own flags it is what was
    measured."""
    from transformers import TrainingArguments

    kept = replace(make(), config=Config(micro_batch_size=8, pin_memory=True))
    kwargs = kept.hf_training_args()
    assert "optim" not in kwargs, kwargs
    own_default = TrainingArguments(output_dir=str(tmp_path)).optim
    assert TrainingArguments(output_dir=str(tmp_path), **kwargs).optim == own_default
    args, shown = _pasted(kept, [], tmp_path)
    assert args.optim == own_default and "--optim" not in shown and "optimizer_impl" not in shown
    assert "--per_device_train_batch_size 8" in shown and "--bf16 False" in shown
    args, _ = _pasted(kept, ["--optim", "adafactor", "--per_device_train_batch_size", "32",
                             "--bf16", "--dataloader_num_workers", "4"], tmp_path)
    assert (args.optim, args.per_device_train_batch_size) == ("adafactor", 8)
    assert (args.bf16, args.dataloader_num_workers) == (False, 0)  # fp32, no workers: tuned


def test_hf_args_name_a_fused_optimizer_without_replacing_the_scripts(tmp_path: Path) -> None:
    fused = replace(make(), config=Config(optimizer_impl="fused"))
    args, shown = _pasted(fused, ["--optim", "adafactor"], tmp_path)
    assert args.optim == "adafactor" and "--optim" not in shown.splitlines()[0]
    (note,) = [line for line in shown.splitlines() if "optimizer_impl" in line]
    assert note.startswith("# optimizer_impl=fused: ") and "`autotune launch`" in note
    # In code, an AdamW Trainer steps fused (TrainingArguments' own default, or optim=).
    from transformers import TrainingArguments

    built = TrainingArguments(output_dir=str(tmp_path), **fused.hf_training_args())
    assert str(getattr(built.optim, "value", built.optim)) == "adamw_torch_fused"


def test_hf_args_of_a_sharded_gpu_profile_parse_as_fsdp2(tmp_path: Path) -> None:
    """A profile sharded on GPUs prints --fsdp with the strategy's name (the command line
    refuses True) and its FSDP2 config as JSON, which HfArgumentParser reads back."""
    for sharding, reshard in (("full-shard", True), ("shard-grad-op", False)):
        sharded = replace(make({**detect().fingerprint(), "device": "cuda"}),
                          config=Config(world_size=2, sharding=sharding))
        args, shown = _pasted(sharded, [], tmp_path)
        assert f"--fsdp {sharding.replace('-', '_')}" in shown
        assert args.fsdp_config["version"] == 2
        assert args.fsdp_config["reshard_after_forward"] is reshard
