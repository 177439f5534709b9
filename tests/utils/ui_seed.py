"""A plan store holding what the web pages show, without profiling anything: architectures planned by every
registered planner from synthetic traces, each plan measured (a memory timeline included) and two frontier points
measured, plus jobs in every state and a zoo batch. Used by the web pages' tests and benchmarks/ui_pages.py.

The plans are the real planners' (``plans_to_store``); only the measurements are made up, close to the
predictions, with timelines shaped like a step's (activations grow through forward, shrink through backward,
and a checkpointed plan's rise again where a segment is recomputed).
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from sqlalchemy.orm import Session

from remat.client.job_state import JobState
from remat.client.measurement import Measurement
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey, current_torch_version
from remat.client.planning.plans import frontier_to_validate, plans_to_store
from remat.client.request import ModelRequest
from remat.client.trace import TRACE_FORMAT, Trace, parse_trace
from remat.service import jobs, repository, zoo
from remat.service.db import Database
from remat.service.models import JobRow
from remat.service.records import JobRecord

TORCH = current_torch_version()
MODELS = ("resnet18", "resnet50", "vgg11", "mobilenet_v3_small", "densenet121", "vit_b_16", "convnext_tiny",
          "efficientnet_b0", "regnet_y_400mf", "squeezenet1_1")


@lru_cache(maxsize=16)
def _template(num_stages: int) -> tuple[Trace, tuple[Plan, ...]]:
    """A trace of ``num_stages`` stages and its stored plans (every planner, the frontier): computed once."""
    stages = [{"name": f"features.{i}.block", "output_bytes": 400_000 + 37_000 * ((i * 7) % 11),
               "saved_bytes": 900_000 + 55_000 * ((i * 5) % 9), "forward_peak_bytes": 1_600_000 + 40_000 * (i % 5),
               "backward_peak_bytes": 2_100_000 + 30_000 * (i % 7), "forward_ms": 0.4 + 0.05 * (i % 6),
               "backward_ms": 0.9 + 0.08 * (i % 5), "saves_input": i % 3 == 0}
              for i in range(1, num_stages + 1)]
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 393_216, "input_shape": [2, 3, 64, 64],
                         "dtype": "float32", "device": "cpu", "torch_version": TORCH, "model_hash": "template",
                         "stages": stages})
    return trace, tuple(plans_to_store(trace))


def _timeline(peak: int, segments: int, ops: int = 1200) -> dict[str, object]:
    """A step's activation memory in at most 400 buckets: up through forward, down through backward, with a rise
    per recomputed segment (``segments`` > 1 for a checkpointed plan)."""
    backward = int(ops * 0.42)
    index = list(range(0, ops, 3))
    levels = []
    for i in index:
        if i < backward:
            level = peak * (0.15 + 0.75 * i / backward) if segments == 1 else peak * (0.1 + 0.35 * i / backward)
        else:
            t = (i - backward) / (ops - backward)
            if segments == 1:
                level = peak * (0.9 + 0.1 * math.sin(math.pi * t * 3) ** 2) * (1 - t)
            else:
                phase = (t * segments) % 1.0
                level = peak * ((0.45 * (1 - t)) + 0.55 * math.sin(math.pi * phase) ** 2 * (1 - 0.3 * t))
        levels.append(max(0, int(level)))
    top = max(levels)
    levels = [int(v * peak / top) for v in levels]
    return {"ops": ops, "backward_op": backward, "op_index": index, "bytes": levels, "sample": "aten op"}


def _measured(plan: Plan, none_step_ms: float, wobble: float, *, timeline: bool = True) -> Measurement:
    peak = int(plan.predicted_peak_bytes * (1.0 + wobble))
    step = none_step_ms + (plan.recompute_ms or 0.0) * (1.1 + wobble)
    return Measurement(predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=peak, step_ms=step,
                       baseline_step_ms=none_step_ms, grad_check_passed=True, device_name="seeded CPU",
                       torch_version=TORCH,
                       extra={"timeline": _timeline(peak, len(plan.checkpoints) + 1)} if timeline else {})


@dataclass
class Seeded:
    keys: list[PlanKey] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    batch_id: str | None = None


def seed_keys(db: Database, count: int, *, start: int = 0, names: Sequence[str] | None = None,
              stages: Sequence[int] = (12, 24, 40), timelines: bool = True, metadata: dict[str, Any] | None = None,
              into: Seeded | None = None) -> Seeded:
    """Store ``count`` architectures (one key each), planned and measured; hashes are 64 hex digits from the
    index (:func:`architecture_hash`), names ``torchvision:<zoo name>`` cycling through :data:`MODELS` unless
    ``names`` are given. ``timelines=False`` stores measurements without memory timelines (a third of the time
    a store takes goes to checking their JSON). ``metadata`` goes into every trace (``inputs``, ``grads``...)."""
    out = into or Seeded()
    with db.write_session() as session:
        for i in range(start, start + count):
            template, plans = _template(stages[i % len(stages)])
            name = names[i - start] if names else f"torchvision:{MODELS[i % len(MODELS)]}"
            trace = parse_trace({**template.to_dict(), "model_hash": architecture_hash(i), "model": name,
                                 "batch_size": 2, "device_name": "seeded CPU", **(metadata or {})})
            none_step = sum((s.forward_ms or 0) + (s.backward_ms or 0) for s in trace.stages) * 1.05
            measured = {p.label: _measured(p, none_step, wobble=0.02 * ((i + k) % 5) - 0.03, timeline=timelines)
                        for k, p in enumerate([*(p for p in plans if not p.budget_bytes),
                                               *frontier_to_validate(list(plans))])}
            stored = repository.store_profile(session=session, trace=trace, plans=plans, measurements=measured)
            out.keys.append(stored.key)
            out.names.append(name)
    return out


def architecture_hash(i: int) -> str:
    """The ``i``-th seeded architecture's hash: 64 hex digits, like the client's."""
    return hashlib.sha256(f"seeded architecture {i}".encode()).hexdigest()


def _request(model: str) -> ModelRequest:
    return ModelRequest(spec=model, batch_size=2, sample_shape=(3, 64, 64))


def seed_jobs(db: Database, *, into: Seeded | None = None) -> Seeded:
    """One job in each state (the running one at 40% measuring, the failed one with its reason, the succeeded one
    keyed on the first seeded key when there is one) and a zoo batch of four models: two finished (one succeeded,
    one failed), one running, one queued."""
    out = into or Seeded()
    plan_key = out.keys[0].to_dict() if out.keys else None
    with db.write_session() as session:
        for state, model in ((JobState.PENDING, "vgg11"), (JobState.RUNNING, "resnet50"),
                             (JobState.SUCCEEDED, "resnet18"), (JobState.FAILED, "densenet121")):
            job, _ = jobs.create_job(session=session, request=_request(model).to_dict(), queue="cpu",
                                     request_key=uuid.uuid4().hex)
            out.jobs[state.value] = _advance(session, job.id, state, plan_key=plan_key)
        batch, _ = zoo.create_batch(session=session, zoo="torchvision", filter="resnet*,mobilenet_v3_small,vgg11",
                                    template={"batch_size": 2, "input_shape": [3, 64, 64], "device": "cpu",
                                              "grads": "none", "dtype": "float32", "queue": "cpu",
                                              "refresh": False},
                                    requests=[_request(m) for m in ("resnet18", "mobilenet_v3_small", "resnet50",
                                                                    "vgg11")],
                                    queue="cpu", refresh=False)
        for job, state in zip(batch.jobs, (JobState.SUCCEEDED, JobState.FAILED, JobState.RUNNING, JobState.QUEUED),
                              strict=True):
            _advance(session, job.id, state, plan_key=plan_key)
        out.batch_id = batch.id
    return out


def _advance(session: Session, job_id: str, state: JobState, *, plan_key: dict[str, Any] | None) -> JobRecord:
    if state == JobState.QUEUED:
        jobs.update_job(session=session, job_id=job_id, state=state, message="sent to queue cpu")
    elif state == JobState.RUNNING:
        jobs.update_job(session=session, job_id=job_id, state=state, progress=0.4, message="measuring linear")
    elif state == JobState.FAILED:
        jobs.update_job(session=session, job_id=job_id, state=state, progress=0.2, message="failed",
                        error="RuntimeError: out of memory while profiling stage features.3 <script>x</script>")
    elif state == JobState.SUCCEEDED:
        jobs.update_job(session=session, job_id=job_id, state=state, progress=1.0, message="done: 8 plans measured",
                        result=job_result())
        row = session.get(JobRow, job_id)
        assert row is not None
        row.plan_key = plan_key or job_result()["key"]  # a worker records the key it built
        session.flush()
    found = jobs.get_job(session=session, job_id=job_id)
    assert found is not None
    return found


def job_result() -> dict[str, Any]:
    """A profiling job's result as a worker writes it: the key, and each plan with its newest measurement."""
    template, plans = _template(12)
    none_step = sum((s.forward_ms or 0) + (s.backward_ms or 0) for s in template.stages)
    registered = [p for p in plans if not p.budget_bytes]
    key = PlanKey.from_trace(template)
    return {"key": key.to_dict(), "trace_id": 1, "reused": False, "device_name": "seeded CPU",
            "plans": [{"plan": p.to_dict(), "measurement": _measured(p, none_step, 0.01).to_dict()}
                      for p in registered]}
