"""Every shell command of the README's single-machine part runs (the cluster part has its own test,
tests/service/test_cluster_quickstart.py).

Each ``uv run remat-client …`` line of the bash blocks before "## Cluster quickstart" runs in-process. A zoo
model is shrunk to batch 2 at 32 px so the suite stays fast (the command is otherwise as written); a
``--device cuda`` line runs as written where a GPU is present and, elsewhere, must stop with the one-line
"no CUDA device" error — its arguments still have to parse. ``pip install uv`` and ``uv run pytest`` are the
set-up and this suite itself.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from remat.client.model_spec import fixed_sample_shape, size_argument
from tests.utils.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SMALL = ["--batch-size", "2", "--input-shape", "3,32,32"]


def _single_machine_commands() -> list[list[str]]:
    text = README.read_text()
    part = text[:text.index("## Cluster quickstart")]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", part, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["uv", "run"] and words[2] == "remat-client":
                commands.append(words[3:])
            else:
                assert words in ([], ["pip", "install", "uv"], ["uv", "run", "pytest"]), f"untested: {line}"
    return commands


COMMANDS = _single_machine_commands()


def test_the_readme_has_the_commands_this_test_expects() -> None:
    assert ["plan", "resnet152"] in COMMANDS
    assert any("--trace" in c for c in COMMANDS) and any("--device" in c for c in COMMANDS)


def _shrunk(args: list[str]) -> list[str]:
    """Batch 2 at 32 px instead of the command's own size (a model name is the argument after ``plan``); a model
    built for one size (ViT) is built for 32 px, as the README says."""
    out, skip = [], False
    for word in args:
        if skip:
            skip = False
            continue
        if word in ("--batch-size", "--input-shape"):
            skip = True
            continue
        out.append(word)
    if "--trace" in out:
        return out
    argument = size_argument(out[1]) if fixed_sample_shape(out[1]) is not None else None
    return out + SMALL + (["--model-kwargs", json.dumps({argument: 32})] if argument else [])


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_a_readme_command_runs(capsys, args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'plans.sqlite'}")
    monkeypatch.chdir(ROOT)  # the README's paths (examples/…) are relative to a clone's root
    command = _shrunk(args)
    needs_cuda = "cuda" in args
    if needs_cuda and not torch.cuda.is_available():
        code, out, err = run_cli(capsys, *command)
        assert code == 2 and "torch sees no CUDA device" in err and len(err.strip().splitlines()) == 1, err
        return
    code, out, err = run_cli(capsys, *command, "--json")
    assert code == 0, err
    result = json.loads(out)
    plans = result["plans"]
    assert {p["algorithm"] for p in plans} >= {"none", "linear"}
    if "--trace" not in command:
        assert all(p["measured_peak_bytes"] for p in plans), "a model's plans are measured"
