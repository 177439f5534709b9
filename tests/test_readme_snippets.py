"""The README's train-time snippet runs as written, on a small custom model on CPU.

Only what a reader must supply is substituted (their model class, loader and loss, and ``.cuda()`` on a machine
without one); each substitution must find its text, so a README edit that drops it fails here instead of
leaving an untested snippet.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from remat.client.apply_plan import applied_plan
from tests.utils.user_model import UserNet, user_batches

README = Path(__file__).resolve().parents[1] / "README.md"


def _block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block after {heading!r}"
    return match.group(1)


def test_the_one_call_snippet_trains_a_custom_model(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'local.sqlite'}")
    monkeypatch.delenv("REMAT_SERVER", raising=False)
    code = _block_after("## Your own model, in one call")
    for needle in ("MyNet()", ".cuda()", "loader"):
        assert needle in code, f"the README snippet no longer contains {needle!r}: update this test"
    code = code.replace(".cuda()", "")
    namespace = {"MyNet": UserNet, "loader": user_batches(3), "criterion": F.cross_entropy}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - the README's own code, by design
    model = namespace["model"]
    assert isinstance(model, UserNet) and applied_plan(model) is not None
    assert isinstance(namespace["optimizer"], torch.optim.AdamW)
    assert torch.isfinite(namespace["loss"])
