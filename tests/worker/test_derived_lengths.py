"""Traces derived at other sequence lengths (issue 27, item 4) against real profiles of small Hugging Face
models at those lengths, field by field; the plans of a derived trace against measured training steps; and
checkpoint() at a length never profiled, which runs no profile and trains bit-equal to the unmodified model.

The models hold what attention holds per pair of positions (``sdpa`` falls back to its math kernel on the CPU
in training with attention dropout), so their traces are quadratic in the length: three profiled lengths fit
them, and the stored families are found because the architecture hash no longer names the length."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from remat.client.derived_trace import LEVELS, derived_along, derived_sizes, fit_lengths
from remat.client.graph.model_call import ModelCall
from remat.client.local_plans import LocalPlanCache
from remat.client.plan_lookup import build_held_model
from remat.client.trace import Trace
from remat.service.store import PlanStore
from remat.worker import pipeline
from remat.worker.profilers import profile
from tests.utils.cli import run_cli
from tests.utils.tiny_transformers import VOCAB, step, tiny

PROFILED = (8, 16, 24)


def call(seq_len: int, *, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _built(model: torch.nn.Module, seq_len: int, tmp_path: Path):  # type: ignore[no-untyped-def]
    return build_held_model(model, ModelCall.bind(model, (), call(seq_len)), grads="none", dtype="float32",
                            cache=LocalPlanCache(tmp_path / "plans"))


def _profile(model: torch.nn.Module, seq_len: int, tmp_path: Path) -> Trace:
    built = _built(model, seq_len, tmp_path)
    return profile(built.model, built.example, device="cpu", grads="none", chain=built.chain,
                   model_hash=built.key.model_hash, timing_repeats=0)


def _fields(trace: Trace) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.to_dict().items() if k != LEVELS and not k.endswith("_ms")} for s in trace.stages]


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_traces_derived_from_three_lengths_equal_the_profiles_at_longer_ones(arch: str, tmp_path: Path) -> None:
    """A decoder and an encoder–decoder (whose decoder reads the encoder's output at every block). Llama and
    BERT passed the same comparison when it was written (docs/benchmarks.md, "Any sequence length"); the
    default run keeps these two for its time."""
    model = tiny(arch)
    profiles = [_profile(model, L, tmp_path) for L in PROFILED]
    assert len({p.metadata["model_hash"] for p in profiles}) == 1  # one family: the hash names no length
    assert {p.metadata["attention"] for p in profiles} == {"sdpa"}
    fit = fit_lengths(profiles)
    assert fit.degree == 2, fit.describe()
    quadratic = [s for s in range(len(profiles[0].stages))
                 if profiles[2].stages[s].saved_bytes - 2 * profiles[1].stages[s].saved_bytes
                 + profiles[0].stages[s].saved_bytes != 0]
    assert quadratic, "no stage holds bytes in L²: the test would not tell degree 2 from 1"
    for seq_len in (64,):
        profiled, derived = _profile(model, seq_len, tmp_path), fit.trace_at(seq_len)
        assert _fields(derived) == _fields(profiled), (arch, seq_len)
        assert derived.input_bytes == profiled.input_bytes
        assert derived.metadata["inputs"] == profiled.metadata["inputs"]
        assert derived.side_values == profiled.side_values  # what prices their lifetimes plan by plan
        assert derived_along(derived) == "seq_len" and derived_sizes(derived) == PROFILED


def _store_profiles(reference: torch.nn.Module, tmp_path: Path) -> set[str]:
    hashes = set()
    with PlanStore() as store:  # what checkpoint() keeps after profiling at three lengths
        for seq_len in PROFILED:
            model = copy.deepcopy(reference)
            built = _built(model, seq_len, tmp_path)
            hashes.add(built.key.model_hash)
            store.save_trace(pipeline.profile(built))
    return hashes


@pytest.fixture
def local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'local.sqlite'}")
    monkeypatch.setenv("REMAT_PLAN_CACHE_DIR", str(tmp_path / "plans"))
    for name in ("REMAT_SERVER", "REMAT_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.mark.slow
def test_checkpoint_at_a_length_never_profiled_derives_its_plan_and_trains_exactly(
        local_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.client
    from remat.client.apply_plan import applied_plan

    reference = tiny("gpt2")
    hashes = _store_profiles(reference, local_store)
    assert len(hashes) == 1

    def no_profile(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled a sequence length the stored profiles answer")

    monkeypatch.setattr(pipeline, "profile", no_profile)
    planned = remat.client.checkpoint(copy.deepcopy(reference), **call(48, seed=1))
    applied = applied_plan(planned)
    assert applied is not None and applied.checkpoints  # a real plan, not none
    assert applied.extra["key"]["model_hash"] in hashes and applied.extra["key"]["input_shape"] == [2, 48]
    expected, got = step(reference, call(48, seed=2)), step(planned, call(48, seed=2))
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1], strict=True))


@pytest.mark.slow
def test_plan_at_a_new_length_derives_from_stored_profiles_and_measures_every_plan(
        local_store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from remat.client.graph.built_model import build
    from remat.client.request import default_request

    kwargs = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512}
    with PlanStore() as store:  # as `plan hf:gpt2 --seq-len L` leaves them at three lengths
        for seq_len in PROFILED:
            request = default_request("hf:gpt2", batch_size=2, sample_shape=None, device="cpu", grads="none",
                                      dtype="float32", model_kwargs=kwargs, seq_len=seq_len)
            store.save_trace(pipeline.profile(build(request)))
    code, out, err = run_cli(capsys, "plan", "hf:gpt2", "--batch-size", "2", "--seq-len", "64", "--model-kwargs",
                             json.dumps(kwargs), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["derived_from"] == list(PROFILED) and report["derived_along"] == "seq_len"
    assert report["key"]["input_shape"] == [2, 64]
    chain_plans = [e for e in report["plans"] if e.get("dropped_vertices") is None]
    assert len(chain_plans) >= 6
    for entry in chain_plans:
        assert entry["measured_peak_bytes"] == pytest.approx(entry["predicted_peak_bytes"], rel=0.01), entry
