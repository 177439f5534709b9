"""The worker app's delivery settings, one task per child process on CUDA queues, and its bounded settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from remat.service.celery_client import PLAN_TASK, PROFILE_TASK
from remat.service.config import ServiceSettings
from remat.worker.celery_app import _one_task_per_child_on_gpu, make_app


def test_crash_safe_delivery_settings() -> None:
    settings = ServiceSettings(broker_url="redis://127.0.0.1:1/0", visibility_timeout_s=5000, task_time_limit_s=900,
                               plan_time_limit_s=120, queue_prefix="x-")
    app = make_app(settings)
    conf = app.conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == 5000
    assert conf.result_backend_transport_options["visibility_timeout"] == 5000 and conf.visibility_timeout == 5000
    assert conf.visibility_timeout > max(settings.task_time_limit_s, settings.plan_time_limit_s)
    assert conf.accept_content == ["json"] and conf.task_default_queue == "x-cpu"
    profile, plan = app.tasks[PROFILE_TASK], app.tasks[PLAN_TASK]
    assert (profile.time_limit, profile.soft_time_limit) == (900, 870)
    assert (plan.time_limit, plan.soft_time_limit) == (120, 90)


def test_cuda_queues_get_one_task_per_child() -> None:
    app = make_app(ServiceSettings(broker_url="redis://127.0.0.1:1/0", queue_prefix="x-"))
    for queues, expected in (("x-cuda", 1), (["x-cpu", "x-cuda-h100"], 1), ("x-cpu,x-plan", None)):
        conf = SimpleNamespace(worker_max_tasks_per_child=None)
        _one_task_per_child_on_gpu(instance=SimpleNamespace(app=app), conf=conf, options={"queues": queues})
        assert conf.worker_max_tasks_per_child == expected, queues


@pytest.mark.parametrize("seconds", [-1.0, 601.0])
def test_the_certification_time_is_bounded(seconds: float) -> None:
    """REMAT_CERTIFY_S bounds the MILP a worker runs per graph plan: never negative, never past ten minutes."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="certify_s"):
        ServiceSettings(certify_s=seconds)
