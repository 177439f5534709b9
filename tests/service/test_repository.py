"""The repository on SQLite and PostgreSQL: idempotent writes, lookups by key, measurements, jobs."""

from __future__ import annotations

import random
import string
from dataclasses import replace

import pytest
from sqlalchemy import func, select

from remat.client.plan_key import MAX_INPUTS_CHARS, PlanKey
from remat.client.trace import parse_trace
from remat.service import repository
from remat.service.db import Database
from remat.service.errors import TraceRejectedError
from remat.service.models import PlanRow, TraceRow, TraceStageRow
from remat.service.records import Measurement
from tests.service.factories import fixed_plans, make_trace, trace_dict

KEY = PlanKey(model_hash="arch-1", input_shape=(8, 3, 32, 32), dtype="float32", device="cpu")


def _count(db: Database, model: type) -> int:
    with db.read_session() as session:
        return session.execute(select(func.count()).select_from(model)).scalar_one()


def _store(db: Database, trace=None, plans=None):  # type: ignore[no-untyped-def]
    trace = trace or make_trace()
    with db.write_session() as session:
        stored = repository.store_trace(session=session, trace=trace)
        repository.store_plans(session=session, trace_id=stored.trace_id,
                               plans=plans if plans is not None else fixed_plans(trace))
    return stored


def test_store_trace_is_idempotent_by_content(db: Database) -> None:
    first = _store(db)
    again = _store(db)
    assert first.created and not again.created
    assert first.trace_id == again.trace_id and first.key == again.key == KEY
    assert _count(db, TraceRow) == 1
    assert _count(db, TraceStageRow) == 6
    assert _count(db, PlanRow) == 2


def test_trace_round_trips_through_stage_rows(db: Database) -> None:
    original = parse_trace({**trace_dict(), "custom_top": {"a": [1, 2]},
                            "stages": [{"name": "a", "output_bytes": 1, "saved_bytes": 2, "saves_input": True,
                                        "forward_peak_bytes": 7, "forward_ms": 0.25, "profiler_note": "x"},
                                       {"name": "b", "output_bytes": 3, "saved_bytes": 0}]})
    stored = _store(db, original, [])
    with db.read_session() as session:
        assert repository.load_trace(session=session, trace_id=stored.trace_id) == original
        assert repository.load_trace(session=session, trace_id=stored.trace_id + 999) is None


def test_a_new_profile_of_the_same_key_replaces_the_plan(db: Database) -> None:
    _store(db, make_trace(scale=1), fixed_plans(make_trace(), checkpoints=(2,)))
    newer = make_trace(scale=2)
    stored = _store(db, newer, fixed_plans(newer, checkpoints=(3, 5)))
    assert _count(db, TraceRow) == 2 and _count(db, PlanRow) == 2
    with db.read_session() as session:
        record = repository.get_plan(session=session, key=KEY, algorithm="linear")
    assert record is not None
    assert record.plan.checkpoints == (3, 5) and record.trace.trace_id == stored.trace_id


def test_budget_none_and_budgets_are_distinct_keys(db: Database) -> None:
    trace = make_trace()
    _store(db, trace, fixed_plans(trace, ["linear"]) + fixed_plans(trace, ["linear"], budget_bytes=123456))
    _store(db, trace, fixed_plans(trace, ["linear"]))  # None again: replaces, does not add
    assert _count(db, PlanRow) == 2
    with db.read_session() as session:
        unbounded = repository.get_plan(session=session, key=KEY, algorithm="linear")
        bounded = repository.get_plan(session=session, key=KEY, algorithm="linear", budget_bytes=123456)
        assert repository.get_plan(session=session, key=KEY, algorithm="linear", budget_bytes=1) is None
    assert unbounded is not None and unbounded.plan.budget_bytes is None
    assert bounded is not None and bounded.plan.budget_bytes == 123456


SIGNATURE = "input_ids: int64[8, 3]; attention_mask: int64[8, 3]; labels: int64[8, 3]; use_cache=False"


@pytest.mark.parametrize("field, value", [("mode", "eval"), ("grads", "kept"), ("device", "cuda"),
                                          ("dtype", "bfloat16"), ("input_shape", (16, 3, 32, 32)),
                                          ("inputs", SIGNATURE)])
def test_every_key_component_separates_plans(db: Database, field: str, value: object) -> None:
    _store(db)
    other = {"mode": "train", "grads": "none", **trace_dict(), field: list(value) if field == "input_shape" else value}
    _store(db, parse_trace(other))
    assert _count(db, PlanRow) == 4
    with db.read_session() as session:
        assert len(repository.find_plans(session=session, key=KEY)) == 2


def test_a_key_differing_only_in_its_call_inputs_is_another_plan(db: Database) -> None:
    """The same model and input shape called with one tensor, with a signature, and with the longest signature
    a key holds (noise, so that PostgreSQL cannot compress it under the unique index's row limit): three plans,
    each found by its own key, measured and replaced on its own."""
    longest = "".join(random.Random(0).choice(string.printable[:-5]) for _ in range(MAX_INPUTS_CHARS))
    _store(db)
    several = _store(db, make_trace(inputs=SIGNATURE, scale=2), fixed_plans(make_trace(), checkpoints=(3,)))
    widest = _store(db, make_trace(inputs=longest, scale=3), fixed_plans(make_trace(), checkpoints=(4,)))
    assert (several.key, widest.key) == (replace(KEY, inputs=SIGNATURE), replace(KEY, inputs=longest))
    assert _count(db, PlanRow) == 6
    with db.write_session() as session:
        repository.store_measurement(session=session, key=several.key, algorithm="linear",
                                     measurement=Measurement(measured_peak_bytes=777))
    with db.read_session() as session:
        found = {key.inputs: repository.get_plan(session=session, key=key, algorithm="linear")
                 for key in (KEY, several.key, widest.key)}
        assert repository.get_plan(session=session, key=replace(KEY, inputs="input_ids: int64[8, 3]"),
                                   algorithm="linear") is None
        assert [r.key for r in repository.find_plans(session=session, key=several.key)] == [several.key] * 2
    assert {inputs: (r.plan.checkpoints, r.key.inputs) for inputs, r in found.items() if r is not None} == {
        "": ((2,), ""), SIGNATURE: ((3,), SIGNATURE), longest: ((4,), longest)}
    assert [m.measured_peak_bytes for m in found[SIGNATURE].measurements] == [777]
    assert found[""].measurements == () and found[longest].measurements == ()
    newer = make_trace(inputs=SIGNATURE, scale=5)
    _store(db, newer, fixed_plans(newer, checkpoints=(5,)))  # a new profile of that call replaces only its plans
    assert _count(db, PlanRow) == 6
    with db.read_session() as session:
        assert repository.get_plan(session=session, key=several.key, algorithm="linear").plan.checkpoints == (5,)
        assert repository.get_plan(session=session, key=KEY, algorithm="linear").plan.checkpoints == (2,)


def test_lookup_normalises_dtype_and_device(db: Database) -> None:
    _store(db, make_trace(device="cuda:1", dtype="torch.float16"))
    key = PlanKey(model_hash="arch-1", input_shape=(8, 3, 32, 32), dtype="float16", device="CUDA")
    with db.read_session() as session:
        assert repository.get_plan(session=session, key=key, algorithm="linear") is not None


def test_trace_without_hash_is_keyed_by_content(db: Database) -> None:
    stored = _store(db, make_trace(model_hash=None))
    assert stored.key.model_hash == f"trace:{stored.content_sha256[:40]}"


@pytest.mark.parametrize("change, message", [
    ({"stages": [{"name": "a", "output_bytes": 2**41, "saved_bytes": 0}]}, r"stages\[0\]\.output_bytes"),
    ({"stages": [{"name": "a\x00b", "output_bytes": 1, "saved_bytes": 0}]}, r"stages\[0\]\.name: .*NUL"),
    ({"input_shape": [0, 3]}, r"^input_shape: "),
    ({"input_shape": [2**20] * 3}, r"^input_shape: .* elements"),
    ({"dtype": "Float 32"}, r"^dtype: "),
    ({"model": "m" * 201}, r"^model: at most 200"),
    ({"batch_size": 0}, r"^batch_size: "),
])
def test_implausible_traces_are_rejected_naming_the_field(db: Database, change: dict, message: str) -> None:
    with pytest.raises(TraceRejectedError, match=message), db.write_session() as session:
        repository.store_trace(session=session, trace=parse_trace({**trace_dict(), **change}))
    assert _count(db, TraceRow) == 0


def test_measurements_attach_to_the_current_checkpoints(db: Database) -> None:
    _store(db)
    with db.write_session() as session:
        stored = repository.store_measurement(session=session, key=KEY, algorithm="linear",
                                              measurement=Measurement(measured_peak_bytes=4321, step_ms=12.5,
                                                                      grad_check_passed=True))
        missing = repository.store_measurement(session=session, key=KEY, algorithm="cubic",
                                               measurement=Measurement(measured_peak_bytes=1))
    assert stored is not None and stored.checkpoints == (2,) and missing is None
    with db.read_session() as session:
        record = repository.get_plan(session=session, key=KEY, algorithm="linear")
    assert record is not None and [m.measured_peak_bytes for m in record.measurements] == [4321]
    newer = make_trace(scale=3)
    _store(db, newer, fixed_plans(newer, checkpoints=(4,)))  # the plan changes: old measurement is not its
    with db.read_session() as session:
        record = repository.get_plan(session=session, key=KEY, algorithm="linear")
    assert record is not None and record.measurements == ()


def test_list_plans_filters_and_pages(db: Database) -> None:
    _store(db)
    other = make_trace(model_hash="arch-2", model="other-net")
    _store(db, other, fixed_plans(other, ["linear", "none", "cubic"]))
    with db.read_session() as session:
        page, total = repository.list_plans(session=session, limit=2)
        assert total == 5 and len(page) == 2
        rest, _ = repository.list_plans(session=session, limit=10, offset=2)
        assert {r.plan_id for r in page}.isdisjoint({r.plan_id for r in rest}) and len(rest) == 3
        assert repository.list_plans(session=session, model="other-net")[1] == 3
        assert repository.list_plans(session=session, model_hash="arch-1", algorithm="none")[1] == 1
        assert repository.list_plans(session=session, device="cuda")[1] == 0




def test_every_key_field_is_stored_and_read_back(db: Database) -> None:
    """The key-to-row mapping covers every PlanKey field: a key unlike the defaults in each comes back whole."""
    trace = make_trace(input_shape=(2, 5), dtype="autocast_bfloat16", device="cuda:1", mode="eval", grads="kept",
                       torch_version="2.5.1+cu121")
    key = PlanKey(model_hash="arch-1", input_shape=(2, 5), dtype="autocast_bfloat16", device="cuda", mode="eval",
                  grads="kept", torch_version="2.5")
    assert _store(db, trace).key == PlanKey.from_trace(trace)
    with db.read_session() as session:
        record = repository.get_plan(session=session, key=key, algorithm="linear")
        assert record is not None and record.key == key
        assert [r.key for r in repository.find_plans(session=session, key=key)] == [key, key]
        for field, other in (("mode", "train"), ("grads", "none"), ("device", "cpu"), ("torch_version", "2.6"),
                             ("dtype", "bfloat16"), ("input_shape", (2, 6))):
            assert repository.find_plans(session=session, key=PlanKey(**{**key.to_dict(), field: other})) == []
        anyversion = PlanKey(**{**key.to_dict(), "torch_version": "unknown"})
        assert [r.key for r in repository.find_plans(session=session, key=anyversion)] == [key, key]
