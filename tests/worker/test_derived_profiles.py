"""Traces derived at other batch sizes (issue 27) against real profiles at those batch sizes, field by field,
and the plans of a derived trace against measured training steps; ``max-batch`` against measured steps.

The model of the first tests is chosen so that two profiles cannot fit it without the profiler's peak levels:
the backward of its ``Switch`` stage first fills a constant 1 MiB scratch buffer and frees it, then makes the
input's gradient, which grows with the batch; the scratch is the stage's backward peak at batch 2 and 4, the
gradient from a few hundred on (ResNet-50's bottlenecks do the same at 64 px: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import shutil
from contextlib import closing
from pathlib import Path

import pytest
import torch
from torch import nn

from remat.client.derived_trace import LEVELS, fit_batches
from remat.client.graph.built_model import build
from remat.client.planning.max_batch import best_plan
from remat.client.planning.plans import make_plan, plans_to_store
from remat.client.request import ModelRequest, default_request
from remat.service.store import PlanStore
from remat.worker import pipeline
from remat.worker.measure import measure_step
from remat.worker.profilers import profile
from tests.utils.cli import run_cli, run_cli_with_store
from tests.worker.torch_models import SequentialChain


class _Scratch(torch.autograd.Function):
    """Doubles its input; its backward uses a constant 1 MiB scratch buffer before it makes the gradient."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(2**18)
        total = scratch.sum()
        del scratch
        return grad * 2 + total * 0


class Switch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scratch.apply(x)


def wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), Switch(), nn.Tanh(), nn.Linear(512, 16))


def _profile(model: nn.Module, batch: int, grads: str = "none"):  # type: ignore[no-untyped-def]
    return profile(model, torch.randn(batch, 64), device="cpu", grads=grads, chain=SequentialChain(model),
                   timing_repeats=0, model_hash="wide")


def _fields(trace) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    return [{k: v for k, v in s.to_dict().items() if k not in (LEVELS, "forward_ms", "backward_ms")}
            for s in trace.stages]


@pytest.mark.parametrize("grads", ["none", "kept"])
def test_traces_derived_from_batch_2_and_4_equal_the_profiles_at_larger_batches(grads: str) -> None:
    model = wide()
    fit = fit_batches([_profile(model, 2, grads), _profile(model, 4, grads)])
    for batch in (8, 300, 1024):
        profiled, derived = _profile(model, batch, grads), fit.trace_at(batch)
        assert _fields(derived) == _fields(profiled), batch
        assert derived.input_bytes == profiled.input_bytes
        assert derived.metadata["input_shape"] == profiled.metadata["input_shape"]


def test_the_levels_are_what_make_the_wide_stage_exact() -> None:
    model = wide()
    profiles = [_profile(model, b) for b in (2, 4, 1024)]
    peaks = [p.stages[2].backward_peak_bytes for p in profiles]  # Switch: 1 MiB of scratch, then the gradient
    # Not affine: the line through batch 2 and 4 would miss batch 1024's peak.
    assert peaks[2] != peaks[0] + (peaks[1] - peaks[0]) * (1024 - 2) // 2
    assert fit_batches(profiles[:2]).trace_at(1024).stages[2].backward_peak_bytes == peaks[2]


def test_a_derived_trace_predicts_what_a_step_at_its_batch_measures() -> None:
    """Its plans are the profiled trace's, to the byte, and within 1% of the measured step (the cost model's own
    accuracy: here 4 bytes, the scalar ``_Scratch`` keeps beside its gradient)."""
    model = wide()
    trace = fit_batches([_profile(model, 2), _profile(model, 4)]).trace_at(640)
    profiled = {p.label: p for p in plans_to_store(_profile(model, 640), frontier=False)}
    x = torch.randn(640, 64)
    for plan in plans_to_store(trace, frontier=False):
        assert plan.predicted_peak_bytes == profiled[plan.label].predicted_peak_bytes, plan.algorithm
        if plan.is_graph_plan:
            continue
        m = measure_step(model, x, plan.checkpoints, grads="none", chain=SequentialChain(model), trace=trace,
                         timing_repeats=0)
        assert m.measured_peak_bytes == pytest.approx(plan.predicted_peak_bytes, rel=0.01), plan.algorithm


def _request(batch: int, sample: tuple[int, ...] = (3, 16, 16)) -> ModelRequest:
    return default_request("resnet18", batch_size=batch, sample_shape=sample, device="cpu", grads="kept",
                           dtype="float32", model_kwargs={})


@pytest.mark.slow
def test_plan_at_a_new_batch_derives_from_stored_profiles_and_measures_every_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    monkeypatch.setenv("REMAT_DATABASE_URL", url)
    with PlanStore(url) as store:  # two stored profiles, as `plan` or `max-batch` at batch 2 and 4 leave them
        for batch in (2, 4):
            store.save_trace(pipeline.profile(build(_request(batch))))
    code, out, err = run_cli(capsys, "plan", "resnet18", "--input-shape", "3,16,16", "--grads", "kept", "--json",
                             "--batch-size", "12")
    assert code == 0, err
    report = json.loads(out)
    assert report["derived_from"] == [2, 4] and report["key"]["input_shape"] == [12, 3, 16, 16]
    chain_plans = [e for e in report["plans"] if e.get("dropped_vertices") is None]
    assert len(chain_plans) >= 6
    for entry in chain_plans:
        assert entry["measured_peak_bytes"] == pytest.approx(entry["predicted_peak_bytes"], rel=0.01), entry
    # The graph plan is searched on a graph profile of this batch's step, as after a profile, and priced by it.
    (graph_plan,) = [e for e in report["plans"] if e["algorithm"] == "acg"]
    assert graph_plan["cost_model"] == "pytorch" and graph_plan["dropped_vertices"]
    assert graph_plan["measured_peak_bytes"] == pytest.approx(graph_plan["predicted_peak_bytes"], rel=0.01)


MAX_BATCH_LIMIT = 10 * 2**20
MAX_BATCH_ARGS = ("max-batch", "resnet18", "--input-shape", "3,64,64", "--grads", "kept", "--memory",
                  str(MAX_BATCH_LIMIT))
"""At this limit ResNet-18's best plan is ``nested`` (9 against ``linear``'s 7 on 2026-12-07): one run checks the
search, the nested plan's measured step and what nesting gains."""


@pytest.fixture(scope="module")
def max_batch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """``MAX_BATCH_ARGS --json`` run once into a store of its own (profiles at two batches, a measured step):
    the store's file and the answer, for the tests below to judge and to run again from."""
    store = tmp_path_factory.mktemp("max_batch") / "store.sqlite"
    code, out = run_cli_with_store(f"sqlite:///{store}", *MAX_BATCH_ARGS, "--json")
    assert code == 0
    return store, json.loads(out)


@pytest.mark.slow
def test_max_batch_is_the_largest_batch_measured_steps_fit(max_batch_run: tuple[Path, dict]) -> None:
    """The oracle is a measured step at the next batch with its best plan: over the limit (or, if the answer
    is one below the truth, the one after is)."""
    limit = MAX_BATCH_LIMIT
    answer = max_batch_run[1]
    batch = answer["batch_size"]
    assert answer["measured_peak_bytes"] <= limit and answer["predicted_peak_bytes"] <= limit
    assert answer["next"]["predicted_peak_bytes"] > limit and answer["profiled_batches"] == [2, 4]
    over = []
    for b in (batch + 1, batch + 2):
        built = build(_request(b, (3, 64, 64)))
        trace = pipeline.profile(built, timing_repeats=0, with_graph=False)  # linear's peak needs no times
        plan = best_plan(trace, None)
        measured = pipeline.validate(built, trace, [plan], timing_rounds=1, check_gradients=False)[plan.label]
        over.append(measured.measured_peak_bytes > limit)
    assert over[0] or over[1], "the true largest batch is more than one above the answer"


@pytest.mark.slow
def test_max_batch_nests_where_that_fits_a_larger_batch(max_batch_run: tuple[Path, dict]) -> None:
    """Nesting gains batches: the answer's plan is ``nested``, the same search over one-level plans alone
    stops lower, and at the answer's batch ``linear``, profiled there and measured, does not fit the limit."""
    from remat.client.planning.max_batch import largest_batch

    store, answer = max_batch_run
    batch, limit = answer["batch_size"], MAX_BATCH_LIMIT
    assert answer["plan"].get("nested") is True, answer["plan"]
    with PlanStore(f"sqlite:///{store}") as plans:
        profiles = plans.size_profiles(build(_request(2, (3, 64, 64))).key, include_own=True)
    one_level = largest_batch(fit_batches(profiles), lambda b: limit, nested=False)
    assert one_level.plan.algorithm == "linear" and one_level.batch_size < batch
    built = build(_request(batch, (3, 64, 64)))
    trace = pipeline.profile(built, timing_repeats=0, with_graph=False)
    linear = make_plan(trace, "linear", cost_model="pytorch")
    measured = pipeline.validate(built, trace, [linear], timing_rounds=1, check_gradients=False)[linear.label]
    assert measured.measured_peak_bytes > limit >= answer["measured_peak_bytes"]


@pytest.mark.parametrize("args, message", [
    (["--memory", "70%"], "--memory: 70% is a share of a batch's peak"),
    ([], "--memory: give the activation memory to fit on the cpu"),
    (["--memory", "8GiB", "--batch-size", "8"], "--batch-size: max-batch finds the batch size"),
    (["--memory", "8GiB", "--profile-batches", "4"], "--profile-batches: '4' must name two or more"),
    (["--memory", "8GiB", "--overhead", "lots"], "--overhead: 'lots' is not a percentage"),
    (["--device", "cuda", "--overhead", "25%"], "--overhead: on cuda the stage times of small-batch profiles"),
    (["--memory", "lots"], "--memory: 'lots' is not a size"),
    (["--memory", "fit"], "--memory: fit is the CUDA device's free memory"),
    (["--memory", "1KiB"], "--memory: not even batch 1 fits: its best plan (linear) needs"),
])
def test_max_batch_refuses_bad_input_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], args: list[str],
                                                 message: str) -> None:
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'store.sqlite'}")
    code, out, err = run_cli(capsys, "max-batch", "resnet18", "--input-shape", "3,16,16", *args)
    assert code == 2, (out, err)
    assert err.startswith(f"remat-client: error: {message}"), err
    assert err.count("\n") == 1
    store = tmp_path / "store.sqlite"
    if "not even batch 1" not in message:  # refused from its arguments alone: nothing was profiled first
        assert not store.exists() or _stored_traces(store) == 0, "profiled before the refusal"


def _stored_traces(path: Path) -> int:
    import sqlite3

    with closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT count(*) FROM traces").fetchone()[0]


@pytest.mark.slow
def test_checkpoint_at_a_batch_never_profiled_runs_no_profile_and_trains_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """remat.client.checkpoint at batch 16 of a model profiled at 2 and 4: derived, no profiler run, and the
    model trains bit-equal to the unmodified one."""
    import remat.client
    from remat.client.apply_plan import applied_plan
    from remat.client.local_plans import LocalPlanCache
    from remat.client.plan_lookup import build_held_model
    from tests.utils.user_model import user_model

    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'local.sqlite'}")
    monkeypatch.setenv("REMAT_PLAN_CACHE_DIR", str(tmp_path / "plans"))
    for name in ("REMAT_SERVER", "REMAT_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with PlanStore() as store:  # what checkpoint() keeps after profiling at batch 2 and 4
        for batch in (2, 4):
            built = build_held_model(user_model(depth=3), torch.randn(batch, 3, 16, 16), grads="none",
                                     dtype="float32", cache=LocalPlanCache())
            store.save_trace(pipeline.profile(built))

    def no_profile(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled a batch size the stored profiles answer")

    monkeypatch.setattr(pipeline, "profile", no_profile)
    torch.manual_seed(1)
    x, target = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    reference, planned = user_model(depth=3), remat.client.checkpoint(user_model(depth=3), x)
    applied = applied_plan(planned)
    assert applied is not None and applied.checkpoints  # a real plan, not none
    losses = []
    for model in (reference, planned):
        torch.manual_seed(2)
        loss = nn.functional.cross_entropy(model(x), target)
        loss.backward()
        losses.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(losses[0][0], losses[1][0])
    assert all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1], strict=True))


@pytest.mark.slow
def test_a_transformer_at_a_batch_never_profiled_is_derived_and_trains_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model called with several inputs (GPT-2: ids, mask, labels), profiled at batch 2 and 4: export writes
    the batch into its graph, yet the three batch sizes share one architecture hash, so checkpoint() at batch 6
    derives its plan without a profile, and the model trains bit-equal to the unmodified one, dropout on."""
    import copy

    import remat.client
    from remat.client.apply_plan import applied_plan
    from remat.client.graph.model_call import ModelCall
    from remat.client.local_plans import LocalPlanCache
    from remat.client.plan_lookup import build_held_model
    from tests.utils.tiny_transformers import step, tiny

    def call(batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 512, (batch, 16), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        mask[0, -1] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'local.sqlite'}")
    monkeypatch.setenv("REMAT_PLAN_CACHE_DIR", str(tmp_path / "plans"))
    for name in ("REMAT_SERVER", "REMAT_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    reference = tiny("gpt2")
    hashes = set()
    with PlanStore() as store:  # what checkpoint() keeps after profiling at batch 2 and 4
        for batch in (2, 4):
            model = copy.deepcopy(reference)
            built = build_held_model(model, ModelCall.bind(model, (), call(batch)), grads="none",
                                     dtype="float32", cache=LocalPlanCache())
            hashes.add(built.key.model_hash)
            store.save_trace(pipeline.profile(built))
    assert len(hashes) == 1

    def no_profile(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled a batch size the stored profiles answer")

    monkeypatch.setattr(pipeline, "profile", no_profile)
    planned = remat.client.checkpoint(copy.deepcopy(reference), **call(6, seed=1))
    applied = applied_plan(planned)
    assert applied is not None and applied.checkpoints  # a real plan, not none
    assert applied.extra["key"]["model_hash"] in hashes
    assert applied.extra["key"]["input_shape"] == [6, 16]
    expected, got = step(reference, call(6, seed=2)), step(planned, call(6, seed=2))
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1], strict=True))


def test_max_batch_steps_back_when_the_verifying_step_runs_out_of_device_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        max_batch_run: tuple[Path, dict]) -> None:
    """A device whose allocator cannot hold what the prediction says fits (fragmentation, measured on the H100
    at batch 2,558 of ResNet-152): the step's out-of-memory error is a step back, not the command's failure,
    and the answer is a batch whose step really ran."""
    from remat.client.graph.built_model import OutOfMemoryProfiling

    shutil.copyfile(max_batch_run[0], tmp_path / "store.sqlite")  # the profiles it found: no profile runs here
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'store.sqlite'}")
    unconstrained = max_batch_run[1]["batch_size"]
    room = unconstrained - 3  # the device runs out of memory above this batch
    validate = pipeline.validate
    ran: list[int] = []

    def fragmented(built, *a, **k):  # type: ignore[no-untyped-def]
        ran.append(built.request.batch_size)
        if built.request.batch_size > room:
            raise OutOfMemoryProfiling(f"out of memory profiling at batch {built.request.batch_size}")
        return validate(built, *a, **k)

    monkeypatch.setattr(pipeline, "validate", fragmented)
    code, out, err = run_cli(capsys, *MAX_BATCH_ARGS, "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert answer["batch_size"] <= room and answer["measured_peak_bytes"] is not None
    assert answer["out_of_memory_batch"] > room and answer["stepped_back"] >= 1
    assert ran[0] == unconstrained and ran[-1] == answer["batch_size"]
    code, out, err = run_cli(capsys, *MAX_BATCH_ARGS)
    assert code == 0, err
    assert f"batch {answer['out_of_memory_batch']} was predicted to fit but its step ran out of device memory" in out


GRAPH_MODEL = "tests.utils.nas_cell:nas_net"
"""DARTS-like cells (tests/utils/nas_cell.py): each cell reads the two before it, so the chain cannot cut a cell
stack and only a graph plan saves much (docs/benchmarks.md, "Graph plans (`acg`) against chain plans")."""
GRAPH_SAMPLE = (3, 32, 32)
GRAPH_LIMIT = 16 * 2**20
"""At this limit the graph plan's answer is batch 17, the chain plans' far lower (2026-12-08)."""


def _graph_request(batch: int) -> ModelRequest:
    return default_request(GRAPH_MODEL, batch_size=batch, sample_shape=GRAPH_SAMPLE, device="cpu", grads="kept",
                           dtype="float32", model_kwargs={})


def _graph_profiled(batch: int):  # type: ignore[no-untyped-def]
    built = build(_graph_request(batch))
    pipeline.profile_op_graph(built)
    assert built.graph_profile is not None
    return built


@pytest.mark.slow
def test_a_graph_profile_derived_at_a_batch_is_the_one_profiled_there() -> None:
    """The oracle is a real graph profile at batch 7: every record equal to the one derived from batch 2 and 4
    (labels as the fit carries them), and the replay of a graph plan on each the same peak. Only the profiled
    step's own measured peak, a maximum over its events, may differ: no plan's prediction reads it."""
    from remat.client.planning.graph_fit import _relabelled, fit_graph_profiles
    from remat.client.planning.graph_predict import predict_graph_peak
    from remat.worker.graph_profile import executor_units

    small = [_graph_profiled(b) for b in (2, 4)]
    real = _graph_profiled(7)
    derived = fit_graph_profiles([b.graph_profile for b in small], [2, 4]).at(7)
    expected, got = _relabelled(real.graph_profile.to_dict()), derived.to_dict()
    assert {**got, "measured_peak": None} == {**expected, "measured_peak": None}
    trace = pipeline.profile(real, timing_repeats=0)
    plan = pipeline.graph_planned(real, trace, make_plan(trace, "acg"))
    assert plan.dropped_vertices
    units = executor_units(real.op_graph, plan.dropped_vertices)
    assert predict_graph_peak(derived, units).peak == predict_graph_peak(real.graph_profile, units).peak


@pytest.fixture(scope="module")
def graph_max_batch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    store = tmp_path_factory.mktemp("graph_max_batch") / "store.sqlite"
    code, out = run_cli_with_store(f"sqlite:///{store}", "max-batch", GRAPH_MODEL, "--input-shape",
                                   ",".join(map(str, GRAPH_SAMPLE)), "--grads", "kept", "--memory", str(GRAPH_LIMIT),
                                   "--json")
    assert code == 0
    return store, json.loads(out)


@pytest.mark.slow
def test_max_batch_searches_graph_plans_and_measured_steps_agree(graph_max_batch_run: tuple[Path, dict]) -> None:
    """The answer's plan is the graph plan and its measured step fits; the chain plans alone answer lower; and
    the oracle, a real profile at the next batch with its least-peak plan (the graph plan searched on that
    batch's own graph profile, or a chain plan), measures over the limit."""
    from remat.client.planning.max_batch import largest_batch

    store, answer = graph_max_batch_run
    batch, limit = answer["batch_size"], GRAPH_LIMIT
    assert answer["plan"]["algorithm"] == "acg" and answer["graph_plans_not_searched"] is None
    assert answer["measured_peak_bytes"] <= limit and answer["predicted_peak_bytes"] <= limit
    assert answer["measured_peak_bytes"] == pytest.approx(answer["predicted_peak_bytes"], rel=0.01)
    with PlanStore(f"sqlite:///{store}") as plans:
        profiles = plans.size_profiles(build(_graph_request(2)).key, include_own=True)
    chains = largest_batch(fit_batches(profiles), lambda b: limit)
    assert chains.batch_size < batch
    built = _graph_profiled(batch + 1)
    trace = pipeline.profile(built, timing_repeats=0)
    least = min([best_plan(trace, None), pipeline.graph_planned(built, trace, make_plan(trace, "acg"))],
                key=lambda p: p.predicted_peak_bytes)
    assert least.predicted_peak_bytes == answer["next"]["predicted_peak_bytes"]
    measured = pipeline.validate(built, trace, [least], timing_rounds=1, check_gradients=False)[least.label]
    assert measured.measured_peak_bytes > limit


@pytest.mark.slow
def test_max_batch_says_why_it_searched_no_graph_plans(graph_max_batch_run: tuple[Path, dict],
                                                       tmp_path: Path) -> None:
    """Under --overhead a graph plan, which has no recompute estimate, is no candidate, and the answer says so;
    the stored profiles are found again, so nothing is profiled twice."""
    shutil.copyfile(graph_max_batch_run[0], tmp_path / "store.sqlite")
    code, out = run_cli_with_store(f"sqlite:///{tmp_path / 'store.sqlite'}", "max-batch", GRAPH_MODEL,
                                   "--input-shape", ",".join(map(str, GRAPH_SAMPLE)), "--grads", "kept", "--memory",
                                   str(GRAPH_LIMIT), "--overhead", "1000%")
    assert code == 0
    assert "graph plans (acg) not searched: a graph plan has no recompute estimate to hold to --overhead" in out
    assert "plan acg" not in out
