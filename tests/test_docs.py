"""The README and docs/ stay navigable and true: every relative link resolves, the README stays
short, its Python code runs against a real profile, every install line installs this project.

Run as a script (``python tests/test_docs.py BLOCKS.json``), this file is also the runner that
executes the documentation's code blocks in a fresh interpreter (``run_snippets``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Complete snippets (the profile's every method, the callbacks' imports) cost lines: 256 in use.
README_MAX_LINES = 250

_FENCE = re.compile(r"^ {0,3}(```+|~~~+)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target), with an optional "title" after the target.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*)>?(?:\s+[^)]*)?\)")
# [label]: target
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)[0] * len(match.group(1))
                continue
            yield number, line
        elif match and match.group(1).startswith(fence):
            fence = None


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    for number, line in prose_lines(text):
        reference = _REFERENCE.match(line)
        if reference:
            yield number, reference.group(1)
            continue
        for match in _INLINE_LINK.finditer(_INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (hyphens, spaces and
    underscores kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        anchor = github_anchor(match.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link in `path` that does not resolve, named relative to `root`."""
    broken: list[str] = []
    for number, target in links(path.read_text(encoding="utf-8")):
        if not target or _EXTERNAL.match(target):
            continue  # http(s), mailto and other schemes are not checked
        file_part, _, fragment = target.partition("#")
        file_part = unquote(file_part.split("?", 1)[0])
        where = f"{os.path.relpath(path, root)}:{number}: {target}"
        resolved = (path.parent / file_part).resolve() if file_part else path
        if file_part and not resolved.exists():
            broken.append(f"{where} (no such file: {os.path.relpath(resolved, root)})")
            continue
        if fragment and resolved.suffix.lower() == ".md" and resolved.is_file():
            if unquote(fragment).lower() not in anchors(resolved):
                broken.append(f"{where} (no heading with anchor #{fragment} in "
                              f"{os.path.relpath(resolved, root)})")
    return broken


def test_docs_pages_exist() -> None:
    assert (ROOT / "docs").is_dir(), "docs/ is missing"
    assert len(markdown_files()) > 1, "docs/ has no Markdown pages"


def test_every_relative_link_resolves() -> None:
    broken = [line for path in markdown_files() for line in broken_links(path)]
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def test_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move detail into docs/")


def test_github_anchor_rule() -> None:
    assert github_anchor("Know the machine: probe, MFU and what limits a config") == \
        "know-the-machine-probe-mfu-and-what-limits-a-config"
    assert github_anchor("`autotune profile check`: a regression check") == \
        "autotune-profile-check-a-regression-check"
    assert github_anchor("What watching a trial's memory costs") == \
        "what-watching-a-trials-memory-costs"
    assert github_anchor("Run-to-run noise") == "run-to-run-noise"


def test_broken_links_are_reported(tmp_path: Path) -> None:
    """The checker itself finds a missing file and a missing heading, and ignores code."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\n## Real heading\n", encoding="utf-8")
    page = docs / "b.md"
    page.write_text(
        "# B\n\n[ok](a.md#real-heading) [web](https://example.com/x.md) [self](#b)\n"
        "[gone](missing.md) [bad anchor](a.md#nope)\n"
        "`[in code](nowhere.md)`\n\n```bash\n[in a fence](nowhere.md)\n```\n",
        encoding="utf-8")
    broken = broken_links(page, root=tmp_path)
    assert len(broken) == 2, broken
    assert "missing.md" in broken[0] and "#nope" in broken[1]


# -- the documentation's Python code runs ------------------------------------------------------

# Pages whose ```python blocks are training-script code that applies a profile. Each block runs
# in a fresh interpreter against a real profile; the names a block leaves to the reader's script
# are tiny real objects (``user_names``): ``model``, ``dataset``, ``loss_fn``, and ``profile``,
# ``torch`` and ``DataLoader`` for a block that continues an earlier one.
SNIPPET_PAGES = [README, ROOT / "docs" / "profiles.md", ROOT / "docs" / "scripts.md"]
_PYTHON_FENCE = re.compile(r"^ {0,3}```python\s*$")
# A call through a dotted path from the autotune package, in code or in a comment.
_AUTOTUNE_CALL = re.compile(r"\bautotune((?:\.\w+)+)\s*\(")
# Knobs only a script with several ranks applies (DDP's arguments; NCCL's come from the launcher).
_DDP_KNOBS = {"ddp_bucket_cap_mb", "ddp_gradient_as_bucket_view", "ddp_static_graph"}


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """(``page:line``, code) of every ```python block of a Markdown page."""
    blocks: list[tuple[str, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    start: int | None = None
    for number, line in enumerate(lines, start=1):
        if start is None and _PYTHON_FENCE.match(line):
            start = number
        elif start is not None and re.match(r"^ {0,3}```\s*$", line):
            blocks.append((f"{os.path.relpath(path, ROOT)}:{start}",
                           "\n".join(lines[start:number - 1]) + "\n"))
            start = None
    return blocks


def framework(code: str) -> str:
    """Which interpreter a block runs in: the framework it imports, else torch alone."""
    for name in ("transformers", "lightning"):
        if re.search(rf"^\s*(?:from|import) {name}\b", code, re.MULTILINE):
            return name
    return "torch"


def user_names(code: str) -> dict[str, Any]:
    """The reader's own objects a block uses without making them: a tiny model, its data and
    loss (a tiny BERT and token samples for a Hugging Face block)."""
    import torch
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    names: dict[str, Any] = {"torch": torch, "DataLoader": DataLoader,
                             "model": torch.nn.Linear(8, 1), "dataset": torch.randn(64, 8),
                             "loss_fn": lambda out: out.float().pow(2).mean()}
    if framework(code) == "transformers":
        from transformers import BertConfig, BertForMaskedLM

        names["model"] = BertForMaskedLM(BertConfig(
            vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16))
        names["dataset"] = [{"input_ids": torch.randint(0, 100, (16,)),
                             "labels": torch.randint(0, 100, (16,))} for _ in range(8)]
    return names


def unimported_paths(code: str, fresh: set[str]) -> list[str]:
    """Calls like ``autotune.integrations.hf.AutotuneCallback()``, in code or comments, whose
    first step ``import autotune`` alone does not provide (the block does not import it)."""
    found = []
    for match in _AUTOTUNE_CALL.finditer(code):
        first = match.group(1).split(".")[1]
        if first not in fresh and not re.search(rf"^\s*import autotune\.{first}\b", code,
                                                re.MULTILINE):
            found.append(f"autotune{match.group(1)}(): `import autotune` does not import "
                         f"autotune.{first}; write `from autotune.{first}... import ...`")
    return found


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run_snippets(blocks_file: str) -> None:
    """Execute each block of ``blocks_file`` (a JSON list of [where, code]) in this fresh
    interpreter, in a trial of ``autotune run`` (AUTOTUNE_TRIAL_DIR and AUTOTUNE_PROFILE set by
    the caller), and print one ``SNIPPET {json}`` line per block: its error, the profile methods
    it called, and the optimizer steps it reported."""
    import traceback

    import torch.distributed as dist

    import autotune
    from autotune import steps

    fresh = set(vars(autotune))  # before any block imports a submodule
    trial = steps._trial()
    assert trial is not None, "run_snippets runs in a trial: set AUTOTUNE_TRIAL_DIR"
    for where, code in json.loads(Path(blocks_file).read_text()):
        namespace = {**user_names(code), "profile": autotune.load_profile()}
        trial.accessed.clear()
        before = trial.steps
        report: dict[str, Any] = {"where": where, "errors": unimported_paths(code, fresh)}
        ranks = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(), "RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        if "init_process_group" in code:  # torchrun's environment, for one rank
            os.environ.update(ranks)
        try:
            exec(compile(code, where, "exec"), namespace)
        except Exception:
            report["errors"].append(traceback.format_exc(limit=-3))
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            for name in ranks:
                os.environ.pop(name, None)
        report.update(accessed=sorted(trial.accessed), steps=trial.steps - before)
        print("SNIPPET " + json.dumps(report), flush=True)


def snippet_profile(path: Path) -> Path:
    """A real profile for this machine that sets every knob one CPU rank can feel: 4 x 2
    accumulation, bf16, the fused optimizer."""
    from autotune.config.knobs import Config
    from autotune.machine.hardware import detect
    from autotune.profile import Profile

    config = Config(micro_batch_size=4, grad_accum_steps=2, amp="bf16", optimizer_impl="fused")
    Profile(workload={"name": "mlp", "spec": "mlp", "params": {}}, config=config, env={},
            result={"samples_per_sec": 100.0}, baseline={"samples_per_sec": 50.0},
            speedup=2.0, fingerprint=detect().fingerprint(),
            provenance={"study": "docs", "trials": 1}).save(path)
    return path


def run_blocks(blocks: list[tuple[str, str]], folder: Path) -> list[dict[str, Any]]:
    """Run ``blocks`` in one fresh interpreter in ``folder`` (where ``profile.yaml`` is the
    trial's candidate, asked to stop after its first optimizer step); one report per block."""
    snippet_profile(folder / "profile.yaml")
    trial = folder / "trial"
    trial.mkdir()
    (trial / "stop.json").write_text(json.dumps({"at_step": 1}))
    (folder / "blocks.json").write_text(json.dumps(blocks))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")
           or k in ("AUTOTUNE_CACHE_DIR", "AUTOTUNE_LOCK_DIR")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", AUTOTUNE_TRIAL_DIR=str(trial),
               AUTOTUNE_PROFILE=str(folder / "profile.yaml"))
    out = subprocess.run([sys.executable, __file__, str(folder / "blocks.json")], cwd=folder,
                         env=env, capture_output=True, text=True, timeout=180)
    reports = [json.loads(line.removeprefix("SNIPPET ")) for line in out.stdout.splitlines()
               if line.startswith("SNIPPET ")]
    assert out.returncode == 0 and len(reports) == len(blocks), \
        out.stdout[-2000:] + out.stderr[-4000:]
    return reports


def _snippets(kind: str) -> list[tuple[str, str]]:
    return [block for page in SNIPPET_PAGES for block in python_blocks(page)
            if framework(block[1]) == kind]


@pytest.mark.parametrize("kind", ["torch", "transformers", "lightning"])
def test_the_docs_python_runs_against_a_real_profile(tmp_path: Path, kind: str) -> None:
    """Every ```python block of the README, profiles.md and scripts.md runs: its imports exist,
    every profile method it calls exists and accepts what it passes, a loop that reports its
    steps leaves when the trial says stop, and no call goes through a submodule that
    ``import autotune`` does not import. The plain-PyTorch blocks also apply every knob."""
    blocks = _snippets(kind)
    if kind != "torch" and importlib.util.find_spec(kind) is None:
        pytest.skip(f"{kind} is not installed (the dev extra installs it)")
    assert blocks or kind == "lightning", f"no {kind} block found in the docs"
    if not blocks:
        pytest.skip(f"no {kind} block in the docs")
    reports = run_blocks(blocks, tmp_path)
    failed = [f"{r['where']}: {error}" for r in reports for error in r["errors"]]
    assert not failed, "\n".join(failed)
    for (where, code), report in zip(blocks, reports, strict=True):
        if "autotune.step()" in code or ".fit(" in code:  # a loop that reports its steps
            assert report["steps"] == 1, f"{where}: reported {report['steps']} step(s) where " \
                "the trial asked it to stop after one"
    if kind == "torch":
        assert_every_knob_applied(reports)


def assert_every_knob_applied(reports: list[dict[str, Any]]) -> None:
    """One README block applies every knob one rank has, and one profiles.md block every knob:
    a reader who copies it drops nothing the profile was measured with (the fused optimizer,
    the threads, the model knobs)."""
    from autotune.config.knobs import APPLIED_BY

    def unapplied(report: dict[str, Any]) -> set[str]:
        return {knob for knob, methods in APPLIED_BY.items()
                if not set(methods) & set(report["accessed"])}

    for page, allowed in (("README.md", _DDP_KNOBS), ("docs/profiles.md", set())):
        left = min((unapplied(r) for r in reports if r["where"].startswith(page + ":")),
                   key=len, default=set(APPLIED_BY))
        assert not left - allowed, f"no Python block of {page} applies {sorted(left)}"


_PROFILE_ATTRIBUTE = re.compile(r"(?<![\w./-])profile\.([A-Za-z_]\w*)")
_NOT_ATTRIBUTES = {"yaml", "yml", "py", "md"}  # file names: profile.yaml, autotune/profile.py


def test_every_profile_attribute_the_docs_name_exists() -> None:
    """``profile.NAME`` anywhere in the README or docs/ (prose, comments, code) is a real
    attribute or method of ``autotune.Profile``."""
    from autotune.profile import Profile

    known = {f.name for f in dataclasses.fields(Profile)} | set(dir(Profile))
    missing = [f"{os.path.relpath(path, ROOT)}:{number}: profile.{match.group(1)}"
               for path in markdown_files()
               for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
               for match in _PROFILE_ATTRIBUTE.finditer(line)
               if match.group(1) not in known | _NOT_ATTRIBUTES]
    assert not missing, "no such Profile attribute:\n" + "\n".join(missing)


def test_the_snippet_checks_catch_what_the_readme_once_got_wrong() -> None:
    """The checks themselves: a call through an unimported submodule, even in a comment, and a
    block's framework."""
    fresh = {"load_profile", "step", "should_stop", "profile", "steps"}
    code = "autotune.step()  # HF: callbacks=[autotune.integrations.hf.AutotuneCallback()]\n"
    assert len(unimported_paths(code, fresh)) == 1
    assert not unimported_paths("import autotune.integrations.hf\n"
                                "autotune.integrations.hf.AutotuneCallback()\n", fresh)
    assert framework("from transformers import Trainer\n") == "transformers"
    assert framework("import lightning.pytorch as pl\n") == "lightning"
    assert framework("import torch\n") == "torch"


_EXAMPLE_FILE = re.compile(r"examples/(\w+\.py)")
_LINE_COUNT = re.compile(r"(~?)(\d+)[- ]lines?\b")


def test_line_counts_of_examples_are_true() -> None:
    """A paragraph that names one file of examples/ and a line count ("a 170-line loop", "~170
    lines") states that file's length: exactly, or within 10% with a ~."""
    wrong = []
    for path in markdown_files():
        for paragraph in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            files = set(_EXAMPLE_FILE.findall(paragraph))
            if len(files) != 1:
                continue
            (name,) = files
            actual = len((ROOT / "examples" / name).read_text(encoding="utf-8").splitlines())
            for about, count in _LINE_COUNT.findall(paragraph):
                if int(count) != actual and not (about and abs(int(count) - actual) <= actual / 10):
                    wrong.append(f"{os.path.relpath(path, ROOT)}: examples/{name} has {actual} "
                                 f"lines, the text says {about}{count}")
    assert not wrong, "\n".join(wrong)


# -- every install line installs this project --------------------------------------------------

_PIP_INSTALL = re.compile(r"\bpip3? install\s+([^`\n]*)")


def _requirement_name(token: str) -> str:
    name = re.split(r"[\[<>=!~;@ ]", token.strip("'\""), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def test_install_lines_install_this_project() -> None:
    """No `pip install` line in the README or docs/ names `autotune`: that name on PyPI is an
    unrelated project. Lines install from a clone (`.`, `-e .`) or name the distribution."""
    distribution = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert _requirement_name(distribution) != "autotune"
    wrong = [f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}"
             for path in markdown_files()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for match in _PIP_INSTALL.finditer(line)
             for token in match.group(1).split()
             if not token.startswith("-") and _requirement_name(token) == "autotune"]
    assert not wrong, "installs PyPI's unrelated `autotune`:\n" + "\n".join(wrong)
    assert _requirement_name("'autotune[png]'") == "autotune"  # the check itself
    assert _requirement_name("'.[png]'") != "autotune"


if __name__ == "__main__":
    run_snippets(sys.argv[1])
