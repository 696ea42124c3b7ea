from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autotune.errors import WorkloadError
from autotune.trial.bench import tokens_per_sample
from autotune.workloads import WorkloadSpec, builtin_workloads, parse_params, resolve

DATA = Path(__file__).parent / "data"


def test_builtins_are_listed_and_resolve_cheaply() -> None:
    assert {"bert", "gpt2", "mlp"} <= set(builtin_workloads())
    bert = resolve("bert")
    assert bert.name == "bert" and bert.default_micro_batch == 8 and bert.seq_len == 128


def test_params_are_typed_and_checked() -> None:
    assert parse_params(["seq_len=256", "size=tiny", "lr=1e-3", "flag=true"]) == {
        "seq_len": 256, "size": "tiny", "lr": 1e-3, "flag": True}
    with pytest.raises(WorkloadError, match="name=value"):
        parse_params(["seq_len"])
    assert resolve("bert", {"seq_len": 256}).seq_len == 256
    with pytest.raises(WorkloadError, match="has no parameter seq_length; it takes: seq_len, size"):
        resolve("bert", {"seq_length": 256})
    with pytest.raises(WorkloadError, match="seq_len must be >= 8"):
        resolve("bert", {"seq_len": 2})


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(WorkloadError, match="built-in workloads: bert, gpt2, mlp"):
        resolve("resnet")
    with pytest.raises(WorkloadError, match="does not exist"):
        resolve("missing.py")
    with pytest.raises(WorkloadError, match="cannot import workload module"):
        resolve("no_such_pkg.mod:build")


def test_user_file_and_module_workloads() -> None:
    w = resolve(str(DATA / "custom_workload.py"), {"width": 8})
    assert w.name == "regression" and w.width == 8
    assert WorkloadSpec(str(DATA / "custom_workload.py"), {}).name == "custom_workload"
    tiny = resolve("autotune.testing.workloads:tiny")
    assert tiny.default_micro_batch == 4
    with pytest.raises(WorkloadError, match="has no function 'nope'"):
        resolve("autotune.testing.workloads:nope")


def test_bert_data_is_tokenised_and_masked() -> None:
    ds = resolve("bert", {"seq_len": 64}).build_dataset()
    items = [ds[i] for i in range(50)]
    item = items[0]
    assert item["input_ids"].shape == (64,) and item["input_ids"][0] == 2  # [CLS]
    assert ds[0]["input_ids"].equal(item["input_ids"])  # deterministic per index
    masked = sum(int((it["labels"] != -100).sum()) for it in items)
    real = sum(int(it["attention_mask"].sum()) - 2 for it in items)
    assert 0.10 < masked / real < 0.20  # 15% masking
    # Unseen words are split into pieces, as WordPiece does with real text.
    pieces = ds.tokenizer.encode("Zoustrabrouk").tokens
    assert len(pieces) > 1 and pieces[2].startswith("##")


@pytest.mark.parametrize("spec", ["bert", "gpt2"])
def test_tiny_language_models_train_one_step(spec: str) -> None:
    w = resolve(spec, {"seq_len": 32, "size": "tiny"})
    model, ds = w.build_model(), w.build_dataset()
    batch = torch.utils.data.default_collate([ds[i] for i in range(2)])
    loss = w.loss(model, batch)
    loss.backward()
    w.build_optimizer(model).step()
    assert torch.isfinite(loss) and w.flops_per_sample() > 0
    # What a trial records for tokens per second (`profile show --train-tokens`).
    assert tokens_per_sample(ds) == 32


def test_a_workload_without_token_ids_records_no_tokens_per_sample() -> None:
    assert tokens_per_sample(resolve("mlp", {}).build_dataset()) is None
    assert tokens_per_sample([{"input_ids": torch.zeros(2, 8)}]) is None  # not one sequence


def test_module_workloads_next_to_the_user_work_without_pythonpath(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_jobs.py").write_text((DATA / "custom_workload.py").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert resolve("my_jobs:build", {"width": 4}).width == 4


def test_a_broken_workload_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("def build(:\n")
    with pytest.raises(WorkloadError, match="fails to import: SyntaxError"):
        resolve(str(path))


def test_workload_missing_methods_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("def build():\n    return object()\n")
    with pytest.raises(WorkloadError, match="lacks build_model"):
        resolve(str(path))
