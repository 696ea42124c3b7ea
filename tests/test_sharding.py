"""Sharding: the knob's rules, the sized GPT-2, and (2 real gloo ranks) that FSDP2 trains the
same model as DDP, as a trial builds and steps it.

The loss test is the issue's correctness rule: in fp32, each sharding strategy's losses over the
first 3 optimizer steps equal DDP's within ``LOSS_RTOL`` (the same model, seed and data order;
only the order of the gradient reductions differs, and Adam's first steps are sensitive to the
gradient's sign and scale, so a wrong reduction shows at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.config.knobs import Config
from autotune.config.space import Choices, SearchSpace, narrow
from autotune.testing.hardware import fake_cpu, fake_gpus
from objectives.gpt2 import build as gpt2

from .conftest import ROOT

LOSS_RTOL = 1e-5  # relative, per step


def _space(**knobs: tuple[object, ...]) -> SearchSpace:
    return SearchSpace("t", "t.yaml", {k: Choices(v) for k, v in knobs.items()})


def test_sharding_needs_ranks_and_hybrid_needs_nodes() -> None:
    hw = fake_cpu()
    space = _space(sharding=("replicated", "shard-grad-op", "full-shard", "hybrid-shard"))
    one = narrow(space, hw, 1, Config())
    assert one.fixed["sharding"][0] == "replicated"
    assert "one rank" in one.fixed["sharding"][1]
    two = narrow(space, hw, 2, Config(world_size=2))
    assert two.searched["sharding"] == Choices(("replicated", "shard-grad-op", "full-shard"))
    assert "--nnodes" in two.removed["sharding"][0][1]
    nodes = narrow(space, hw, 4, Config(world_size=4), nodes=2)
    assert "hybrid-shard" in nodes.searched["sharding"].values  # type: ignore[union-attr]


def test_ddp_knobs_apply_only_to_ddp_and_offload_only_to_cuda() -> None:
    space = _space(sharding=("replicated", "full-shard"), ddp_bucket_cap_mb=(25, 100),
                   amp=("off", "bf16"), fsdp_reduce_dtype=("fp32", "amp"),
                   cpu_offload=(False, True))
    cpu = narrow(space, fake_cpu(), 2, Config(world_size=2))
    assert "no CUDA GPU" in cpu.fixed["cpu_offload"][1]
    sharded = cpu.variant(Config(world_size=2), sharding="full-shard", ddp_bucket_cap_mb=100)
    assert sharded.ddp_bucket_cap_mb == 25  # not DDP: the bucket knob takes its fallback
    assert sharded.fsdp_reduce_dtype == "fp32"  # no amp: nothing to reduce in but fp32
    reduced = cpu.variant(sharded, amp="bf16", fsdp_reduce_dtype="amp")
    assert reduced.fsdp_reduce_dtype == "amp"
    assert "reduce in bf16" in reduced.describe() and "full-shard" in reduced.describe()
    plain = cpu.variant(reduced, sharding="replicated")
    assert plain.fsdp_reduce_dtype == "fp32" and "bucket 25MB" in plain.describe()
    cuda = narrow(space, fake_gpus(2), 2, Config(world_size=2))
    assert cuda.searched["cpu_offload"] == Choices((False, True))
    assert not cuda.variant(Config(world_size=2), cpu_offload=True).cpu_offload  # DDP


@pytest.mark.parametrize(("size", "layers"), [("100M", 9), ("small", 12), ("0.35B", 44)])
def test_sized_gpt2(size: str, layers: int) -> None:
    assert gpt2(size=size).config().n_layer == layers


def test_sized_gpt2_refuses_what_it_cannot_build() -> None:
    with pytest.raises(ValueError, match="at least 46M"):
        gpt2(size="10M")
    with pytest.raises(ValueError, match="parameter count like 350M"):
        gpt2(size="big")


@pytest.mark.slow
def test_sharded_losses_equal_ddp_on_two_gloo_ranks(tmp_path: Path) -> None:
    """One process group of 2 real ranks builds each config as a trial does and steps it 3
    times: full and grad-op sharding, with and without accumulation, against DDP; and bf16's
    policy with the gradients reduced in bf16, read back from FSDP."""
    configs = [
        {"micro_batch_size": 4},
        {"micro_batch_size": 4, "sharding": "shard-grad-op"},
        {"micro_batch_size": 4, "sharding": "full-shard"},
        {"micro_batch_size": 2, "grad_accum_steps": 2},
        {"micro_batch_size": 2, "grad_accum_steps": 2, "sharding": "full-shard"},
        {"micro_batch_size": 2, "amp": "bf16", "sharding": "full-shard",
         "fsdp_reduce_dtype": "amp"},
    ]
    out = tmp_path / "losses.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "autotune.testing.losses", str(out), 'gpt2:{"size": "tiny", "seq_len": 32}', "3",
         *(json.dumps({**c, "world_size": 2}) for c in configs)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp, grad_op, full, ddp_accum, full_accum, bf16 = json.loads(out.read_text())
    for sharded, reference in ((grad_op, ddp), (full, ddp), (full_accum, ddp_accum)):
        assert sharded["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL), \
            sharded["config"]
    # The three steps trained (a loss that never moves would match anything).
    assert ddp["losses"][0] != ddp["losses"][2]
    assert ddp["applied"].get("sharding") is None and ddp["ddp"]["bucket_cap_bytes"] == 25 * 2**20
    assert grad_op["applied"]["sharding"] == {
        "strategy": "shard-grad-op", "units": 3, "mesh": [2], "reshard_after_forward": False,
        "param_dtype": None, "reduce_dtype": "float32", "offload": False}
    assert full["applied"]["sharding"]["reshard_after_forward"] is True
    assert full["ddp"] is None  # no DDP around a sharded model
    assert (bf16["applied"]["sharding"]["param_dtype"],
            bf16["applied"]["sharding"]["reduce_dtype"]) == ("bfloat16", "bfloat16")
    # Each rank holds half of the parameters under sharding, all of them under DDP.
    state, shard = ddp["applied"]["model_state"], full["applied"]["model_state"]
    assert state["params"] == shard["params"]
    assert shard["param_bytes"] == pytest.approx(state["param_bytes"] / 2, rel=0.01)
    assert shard["optimizer_bytes"] == pytest.approx(state["optimizer_bytes"] / 2, rel=0.01)


# -- the tuner: the memory model of sharding and the baseline that moves to it -----------------

SIZE = {"params": 100_000_000, "param_bytes": 400_000_000, "largest_unit_bytes": 150_000_000,
        "units": 10, "optimizer": "AdamW", "states_per_param": 2, "assumed": True,
        "base_bytes": 300_000_000}


def test_the_memory_model_orders_strategies_and_learns_from_trials() -> None:
    from autotune.trial.measurement import Status
    from autotune.tuner.search import Observation
    from autotune.tuner.sharding import ShardingModel, next_strategy

    cfg = Config(world_size=2, micro_batch_size=4)
    model = ShardingModel(SIZE, [], "cpu", 2)
    peaks = {s: model.predict(Config(world_size=2, micro_batch_size=4, sharding=s))
             for s in ("replicated", "shard-grad-op", "full-shard")}
    assert peaks["replicated"].counted > peaks["shard-grad-op"].counted \
        > peaks["full-shard"].counted
    # Nothing measured: the process's own memory, no activations, twice (CPU: both ranks).
    assert peaks["replicated"].lower_bound
    assert peaks["replicated"].counted == 2 * (5 * 400e6 + 300e6)  # P + G + 2P Adam + buckets
    assert "predicted at least" in model.words(cfg, peaks["replicated"])
    # A trial measures AdamW's real state (half of it per rank under full sharding) and the
    # rest of a rank's peak: activations at two batches, whatever the strategy.
    ran = [Observation(Config(world_size=2, micro_batch_size=m, sharding="full-shard"),
                       Status.OK, 10.0, int(2 * (model.state(Config(
                           world_size=2, micro_batch_size=m, sharding="full-shard"))
                           + 500e6 + 50e6 * m)), number=m,
                       model_state={"params": 1, "param_bytes": 200_000_000,
                                    "grad_bytes": 200_000_000, "optimizer_bytes": 400_000_000})
           for m in (2, 8)]
    learned = ShardingModel(SIZE, ran, "cpu", 2)
    assert "measured in trial 8" in learned.predict(cfg).basis
    replicated = learned.predict(Config(world_size=2, micro_batch_size=4))
    assert not replicated.lower_bound
    assert replicated.counted == pytest.approx(2 * (5 * 400e6 + 500e6 + 50e6 * 4))
    assert next_strategy(["replicated"], ("replicated", "full-shard")) == "full-shard"
    assert next_strategy(["replicated", "full-shard"], ("replicated", "full-shard")) is None


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_model_that_fits_never_tries_sharding(memdir: Path, nproc: int) -> None:
    """mlp fits: every trial replicated, with one rank (the knob fixed) and with two."""
    from autotune.testing.replay import ReplayMeasurer, Row

    from .conftest import JOURNAL, replayed

    measure = ReplayMeasurer(lambda asked: Row(100.0 * asked.config.micro_batch_size ** 0.5))
    replayed(measure, model="mlp", trials=8, nproc=nproc, storage=JOURNAL, seed=1)
    assert len(measure.asked) >= 8
    assert {a.config.sharding for a in measure.asked} == {"replicated"}


def test_a_baseline_that_does_not_fit_moves_to_the_least_sharded_that_does(
        memdir: Path) -> None:
    """gpt2 at 100M parameters on 2 ranks under a 4.4 GiB limit (for both together, on
    CPU): replicated is predicted not to fit before anything runs (recorded, not run);
    shard-grad-op is predicted to fit, runs and runs out of memory (replayed), as does
    full-shard at the default micro-batch 8; full-shard at 4 fits, becomes the baseline, and
    every later trial keeps its strategy."""
    from autotune.testing.replay import ReplayMeasurer, Row

    from .conftest import JOURNAL, replayed

    def answer(asked: object) -> Row:
        config = asked.config  # type: ignore[attr-defined]
        if config.sharding != "full-shard" or config.micro_batch_size >= 8:
            return Row(status="oom", reason="process tree passed the memory limit")
        return Row(10.0 * config.micro_batch_size ** 0.5, peak_memory_bytes=3 * 2**30)

    measure = ReplayMeasurer(answer)
    summary, shown = replayed(measure, model="gpt2", params={"size": "100M"}, trials=5,
                              nproc=2, memory_limit="4.4GiB", storage=JOURNAL)
    assert "model: 103.2M parameters" in shown
    first = summary.trials[0]
    assert first.is_baseline and first.predicted and first.config.sharding == "replicated"
    assert "replicated: predicted at least" in (first.reason or "")
    assert "for the 2 ranks together" in (first.reason or "")
    assert [(a.config.sharding, a.config.micro_batch_size) for a in measure.asked][:3] == [
        ("shard-grad-op", 8), ("full-shard", 8), ("full-shard", 4)]
    assert "the baseline again with sharding shard-grad-op" in shown
    assert "the baseline again with sharding full-shard" in shown
    assert "the baseline again with micro-batch 4 (full-shard)" in shown
    assert {a.config.sharding for a in measure.asked[1:]} == {"full-shard"}
    assert summary.baseline is not None and summary.baseline.config.sharding == "full-shard"
    assert summary.baseline.config.micro_batch_size == 4
    assert summary.best is not None and summary.best.config.sharding == "full-shard"


def test_the_trainer_gets_fsdp2_on_gpus_and_is_told_why_not_elsewhere() -> None:
    from autotune.config.frameworks import hf_unreached
    from autotune.integrations.hf import training_args

    full = Config(world_size=2, amp="bf16", sharding="full-shard")
    args = training_args(full, "cuda")
    assert args["fsdp"] is True
    assert args["fsdp_config"] == {"version": 2, "reshard_after_forward": True}
    grad_op = training_args(Config(world_size=2, sharding="shard-grad-op", cpu_offload=True),
                            "cuda")["fsdp_config"]
    assert grad_op == {"version": 2, "reshard_after_forward": False, "cpu_offload": True}
    assert "fsdp" not in training_args(full, "cpu")
    assert "accelerate shards only on GPUs" in hf_unreached(full, "cpu")["sharding"]
    hybrid = Config(world_size=4, sharding="hybrid-shard")
    assert "fsdp" not in training_args(hybrid, "cuda") and "hybrid" in \
        hf_unreached(hybrid, "cuda")["sharding"]
    assert "fsdp" not in training_args(Config(world_size=2), "cuda")  # replicated: DDP


def test_a_memory_bound_finding_cites_each_strategy_measured_or_predicted() -> None:
    from autotune.trial.measurement import Status
    from autotune.tuner.search import Observation
    from autotune.tuner.sharding import ShardingModel, with_strategies

    full = Config(world_size=2, micro_batch_size=8, sharding="full-shard")
    ran = [Observation(full, Status.OK, 10.0, 3 * 2**30, number=1)]
    model = ShardingModel(SIZE, ran, "cpu", 2)
    text, evidence = with_strategies("memory-bound", "memory-bound: peak 3 GiB", {}, full,
                                     model, ran)
    assert "full-shard measured 3.00 GiB" in text and "replicated predicted" in text
    strategies = evidence["strategies"]
    assert strategies["full-shard"]["measured_bytes"] == 3 * 2**30  # type: ignore[index]
    assert strategies["replicated"]["measured_bytes"] is None  # type: ignore[index]
    assert with_strategies("input-bound", "x", {}, full, model, ran) == ("x", {})


def test_when_no_strategy_fits_any_batch_the_run_says_so_and_goes_on(
        memdir: Path) -> None:
    """Every strategy out of memory down to the space's smallest micro-batch: the run says
    so and goes on to its end (it once died enqueuing a batch the space does not hold)."""
    from autotune.testing.replay import ReplayMeasurer, Row

    from .conftest import JOURNAL, replayed

    measure = ReplayMeasurer(lambda asked: Row(status="oom", reason="passed the limit"))
    summary, shown = replayed(measure, model="gpt2", params={"size": "100M"}, trials=6,
                              nproc=2, memory_limit="4.4GiB", storage=JOURNAL)
    assert "the space has no smaller micro-batch" in shown
    assert summary.baseline is None and not summary.interrupted
    micro = [(a.config.sharding, a.config.micro_batch_size) for a in measure.asked]
    assert ("full-shard", 4) in micro and min(m for _, m in micro) == 4


def test_a_lightning_trainer_is_told_that_autotune_does_not_shard_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Outside a trial (`autotune launch`), a sharded profile's Lightning Trainer read-back
    names sharding as not applied, with why; a replicated profile claims nothing of it."""
    from types import SimpleNamespace

    from autotune.bootstrap.lightning import report

    trainer = SimpleNamespace(precision="bf16-mixed", accumulate_grad_batches=1, global_rank=0)
    sharded = report(trainer, Config(world_size=2, amp="bf16", sharding="full-shard"), "launch",
                     "lightning.pytorch")
    assert "does not set Lightning's FSDP strategy" in sharded.fixed["sharding"]
    assert "autotune: not applied: sharding=full-shard" in capsys.readouterr().err
    plain = report(trainer, Config(world_size=2, amp="bf16"), "launch", "lightning.pytorch")
    assert "sharding" not in plain.fixed and "sharding" not in plain.applied


def test_a_model_size_from_a_process_or_a_study_is_checked() -> None:
    """The sizing process's line and a study's stored size are data: numbers only, bounded."""
    import json

    import optuna

    from autotune.trial.sizing import MAX_LINE, parse
    from autotune.tuner.record import read_facts

    assert parse(json.dumps(SIZE)) == SIZE
    with pytest.raises(ValueError, match="no result"):
        parse(json.dumps({**SIZE, "pad": "x" * MAX_LINE}))
    with pytest.raises(ValueError, match="malformed"):
        parse(json.dumps({**SIZE, "params": -1}))
    with pytest.warns(UserWarning):
        study = optuna.create_study()
        study.set_user_attr("model_size", {**SIZE, "param_bytes": "os.system"})
        assert read_facts(study).model_size is None
    study.set_user_attr("model_size", SIZE)
    assert read_facts(study).model_size == SIZE
