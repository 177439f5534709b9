"""``remat-client plan hf:NAME``: a Hugging Face model built from its configuration, planned, measured, stored.

Oracles: each plan's measured peak (the CPU live-storage meter) beside its prediction; the store answering
the second run; a mixture of experts refused with its reason (exit 2, one line).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.utils.cli import run_cli

pytest.importorskip("transformers")

TINY_GPT2 = '{"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 500}'
TINY_MIXTRAL = ('{"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
                '"num_key_value_heads": 2, "vocab_size": 500, "num_local_experts": 4}')
TOWER = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
TINY_CLIP = json.dumps({"projection_dim": 32, "text_config": {**TOWER, "vocab_size": 500},
                        "vision_config": {**TOWER, "image_size": 32, "patch_size": 8}})


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'plans.sqlite'}")
    return tmp_path


def test_plan_hf_gpt2_predicts_what_it_measures_and_keeps_it(capsys, store: Path) -> None:
    args = ("plan", "hf:gpt2", "--model-kwargs", TINY_GPT2, "--seq-len", "32", "--batch-size", "2", "--json")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    report = json.loads(out)
    assert report["from_store"] is False
    for plan in report["plans"]:
        assert plan["key"]["inputs"] == "input_ids: int64[2, 32]; labels: int64[2, 32]"
        error = abs(plan["predicted_peak_bytes"] - plan["measured_peak_bytes"]) / plan["measured_peak_bytes"]
        assert error < 0.01, plan
    assert any(plan["checkpoints"] for plan in report["plans"])
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and json.loads(out)["from_store"] is True, err


def test_plan_hf_clip_cuts_both_towers_and_predicts_what_it_measures(capsys, store: Path) -> None:
    args = ("plan", "hf:clip", "--model-kwargs", TINY_CLIP, "--seq-len", "16", "--batch-size", "4", "--json")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    report = json.loads(out)
    plans = {plan["algorithm"]: plan for plan in report["plans"]}
    for plan in plans.values():
        assert plan["key"]["inputs"] == ("input_ids: int64[4, 16]; pixel_values: float32[4, 3, 32, 32]; "
                                         "return_loss=True")
        error = abs(plan["predicted_peak_bytes"] - plan["measured_peak_bytes"]) / plan["measured_peak_bytes"]
        assert error < 0.01, plan
    # Both towers are cut (17 stages at this size, from embeddings to projections in each; a chain that cannot
    # cut past the tower handed on is one stage), and the least plan keeps less than training without
    # checkpoints does (24% less at this toy size).
    assert report["num_stages"] >= 14
    assert plans["linear"]["measured_peak_bytes"] < 0.85 * plans["none"]["measured_peak_bytes"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and json.loads(out)["from_store"] is True, err


def test_a_mixture_of_experts_is_refused_with_its_reason(capsys, store: Path) -> None:
    code, _, err = run_cli(capsys, "plan", "hf:mixtral", "--model-kwargs", TINY_MIXTRAL, "--seq-len", "32",
                           "--batch-size", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "MixtralForCausalLM routes tokens by their values" in err
