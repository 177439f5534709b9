"""A zoo run: which models a filter selects, and one summary row per model, however it was produced.

``remat-client zoo torchvision --filter 'resnet*'`` (or ``zoo hf``) plans a whole model zoo — in this process one
model after another (the local planner's ``plan_zoo``, remat.client.local_planner), or as one batch of service jobs
(``POST /v1/zoo``). Both end in the same table, and the service's ``GET /v1/zoo/{id}`` reports the same rows:
``ZooRow`` is the one definition of a zoo result, built from a ``ModelReport`` (the plans of one model with
their measurements) or from a failure's reason.

Selecting torchvision models needs torchvision's registry; the hf zoo (``remat.client.hf_models.hf_zoo``) is a
fixed list; summarising needs no torch.

Public API::

    ZOOS                                                  # ("torchvision", "hf")
    select_models(zoo, pattern=None) -> list[str]         # the models' specs matching a glob, registry order
    select_zoo_models(zoo, pattern=None) -> list[ZooModel]  # the same with each model's builder kwargs
    zoo_requests(models, *, batch_size, sample_shape, seq_len, device, grads, dtype) -> list[ModelRequest]
    ZooRow.from_report(report) / ZooRow.failed(model, reason) / ZooRow.from_job(model, job)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

from remat.client.errors import ModelError, PlanError, UnknownModelError
from remat.client.hf_models import text_positions
from remat.client.job_state import JobState
from remat.client.model_spec import fixed_sample_shape
from remat.client.report import BASELINE_ALGORITHM, ModelReport, Trade
from remat.client.request import ModelRequest, default_request

__all__ = ["ROW_STATUSES", "ZOOS", "ZooModel", "ZooRow", "select_models", "select_zoo_models", "zoo_requests"]

ZOOS = ("torchvision", "hf")
ROW_STATUSES = ("planned", "stored", "failed")
"""``planned``: profiled, planned and measured now; ``stored``: answered from stored plans; ``failed``."""
REFERENCE_ALGORITHM = "linear"
"""The plan a zoo row reports beside no checkpointing: the minimum-peak plan of the PyTorch-faithful model."""


class ZooModel(NamedTuple):
    """One model of a zoo: its spec and its builder's keyword arguments (an hf model's configuration fields)."""

    spec: str
    """``resnet50`` (a torchvision name) or ``hf:gpt2``."""
    model_kwargs: dict[str, Any]


def select_zoo_models(zoo: str, pattern: str | None = None) -> list[ZooModel]:
    """The zoo's models whose name (without ``hf:``) matches the glob ``pattern`` (all when None): torchvision's
    classification models in registry order, or the hf zoo's (``remat.client.hf_models.hf_zoo``).

    Raises:
        UnknownModelError: an unknown zoo, or a pattern that matches no model (the message says so).
    """
    if zoo not in ZOOS:
        raise UnknownModelError(f"zoo: unknown zoo {zoo!r}; known: {', '.join(ZOOS)}")
    if zoo == "hf":
        from remat.client.hf_models import hf_zoo

        entries = [(m.name, ZooModel(m.spec, dict(m.model_kwargs))) for m in hf_zoo()]
        what = "hf"
    else:
        import torchvision

        entries = [(n, ZooModel(n, {})) for n in torchvision.models.list_models(module=torchvision.models)]
        what = f"{zoo} classification"
    if pattern is None:
        return [model for _, model in entries]
    patterns = [p.strip() for p in pattern.split(",") if p.strip()]
    chosen = [model for name, model in entries if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    if not chosen:
        example = "gpt2,l*" if zoo == "hf" else "resnet*"
        raise UnknownModelError(f"filter: {pattern!r} matches none of the {len(entries)} {what} models (a glob "
                                f"such as {example!r}; several separated by commas)")
    return chosen


def select_models(zoo: str, pattern: str | None = None) -> list[str]:
    """The specs of :func:`select_zoo_models` (torchvision names as the registry spells them, ``hf:gpt2``)."""
    return [model.spec for model in select_zoo_models(zoo, pattern)]


def _takes_tokens(spec: str) -> bool:
    from remat.client.model_spec import source_of

    if source_of(spec) != "hf":
        return False
    from remat.client.hf_models import is_token_model

    return is_token_model(spec)


def zoo_requests(models: Sequence[ZooModel], *, batch_size: int | None, sample_shape: Sequence[int] | None,
                 seq_len: int | None, device: str, grads: str, dtype: str) -> list[ModelRequest]:
    """One request per model, sharing everything else: ``seq_len`` applies to the token models and
    ``sample_shape`` to the others (an hf zoo holds both kinds); each model's default where not given. A
    two-tower model's captions stop at its text tower's positions (CLIP: 77 tokens), as its default does: a
    zoo asked for longer sequences still plans it, at the longest caption it takes (its key says which). So a
    model built for one image size (ViT, MaxViT: ``fixed_sample_shape``) is planned at that size whatever
    ``sample_shape`` the zoo was given; its row's input shape says which.

    Raises:
        ModelError: ``seq_len`` (or ``input_shape``) given while no selected model takes it; a request error
            (``PlanError`` or ``ModelError``) with the model it is about.
    """
    tokens = [_takes_tokens(model.spec) for model in models]
    if seq_len is not None and not any(tokens):
        raise ModelError("seq_len: none of the selected models takes token sequences (it applies to hf: token "
                         "models)")
    if sample_shape is not None and tokens and all(tokens):
        raise ModelError("input_shape: every selected model takes token ids; give seq_len (--seq-len) instead")
    fixed = [not token and fixed_sample_shape(model.spec, model.model_kwargs) is not None
             for model, token in zip(models, tokens, strict=True)]
    if sample_shape is not None and all(a or b for a, b in zip(tokens, fixed, strict=True)):
        one_size = [model.spec.rsplit(":", 1)[-1] for model, f in zip(models, fixed, strict=True) if f]
        raise ModelError(f"input_shape: every selected model that takes images is built for one size "
                         f"({', '.join(one_size[:4])}{', …' if len(one_size) > 4 else ''}) and is planned at it")
    out = []
    for model, token, one in zip(models, tokens, fixed, strict=True):
        length = seq_len if token else None
        limit = text_positions(model.spec, model.model_kwargs) if length is not None else None
        if limit is not None:
            length = min(length, limit)
        shape = None if token or one else sample_shape
        try:
            out.append(default_request(model.spec, batch_size=batch_size, sample_shape=shape,
                                       seq_len=length, device=device, grads=grads, dtype=dtype,
                                       model_kwargs=dict(model.model_kwargs)))
        except (ModelError, PlanError) as exc:
            raise type(exc)(f"{exc} (model {model.spec})") from None
    return out


@dataclass(frozen=True, kw_only=True)
class ZooRow:
    """One model of a zoo run: the saving of the reference plan against no checkpointing, or why it failed."""

    model: str
    """Canonical zoo name, ``torchvision:resnet50``."""
    status: str
    input_shape: tuple[int, ...] | None = None
    """Full input shape, batch included."""
    num_stages: int | None = None
    none_peak_bytes: int | None = None
    """Measured activation peak without checkpointing."""
    linear_peak_bytes: int | None = None
    """Measured activation peak of the ``linear`` plan."""
    saving: float | None = None
    """1 - linear / none, measured."""
    overhead: float | None = None
    """Step time of the ``linear`` plan against none, minus 1 (the recompute overhead)."""
    overhead_within_noise: bool = False
    """The two steps differ by no more than their timing spreads (``Trade.within_noise``): tables say "within
    noise" instead of the percentage."""
    prediction_error: float | None = None
    """(predicted - measured) / measured for the ``linear`` plan."""
    grad_check_passed: bool | None = None
    """Whether every validated plan's gradients equal the unmodified step's."""
    least_algorithm: str | None = None
    """The planner whose plan measured the least activation peak (``linear`` on a tie with it): ``nested`` or
    ``acg`` where re-runs inside re-runs or cuts inside stages keep less than every chain plan."""
    least_peak_bytes: int | None = None
    """That plan's measured activation peak."""
    least_saving: float | None = None
    """1 - least / none, measured."""
    reason: str | None = None
    """Why it failed (one line), for ``failed`` rows."""

    @classmethod
    def from_report(cls, report: ModelReport) -> ZooRow:
        """The row of one model's ``ModelReport``."""
        base, ref = report.row(BASELINE_ALGORITHM), report.row(REFERENCE_ALGORITHM)
        trade = Trade.of(base, ref)
        checks = [r.grad_check_passed for r in report.rows]
        grad_ok = None if any(c is None for c in checks) or not checks else all(checks)
        measured = [r for r in report.rows if r is not base and r.measured_peak_bytes is not None]
        least = min(measured, key=lambda r: (r.measured_peak_bytes, r is not ref), default=None)
        least_trade = Trade.of(base, least) if least is not None else None
        return cls(model=report.request.name, status="stored" if report.from_store else "planned",
                   input_shape=tuple(report.request.input_shape), num_stages=report.num_stages,
                   none_peak_bytes=base.measured_peak_bytes if base else None,
                   linear_peak_bytes=ref.measured_peak_bytes if ref else None, saving=trade.saving,
                   overhead=trade.overhead, overhead_within_noise=trade.within_noise,
                   prediction_error=trade.prediction_error, grad_check_passed=grad_ok,
                   least_algorithm=least.plan.planned_by if least is not None else None,
                   least_peak_bytes=least.measured_peak_bytes if least is not None else None,
                   least_saving=least_trade.saving if least_trade is not None else None)

    @classmethod
    def failed(cls, model: str, reason: str, input_shape: Sequence[int] | None = None) -> ZooRow:
        return cls(model=model, status="failed", reason=" ".join(reason.split())[:500],
                   input_shape=tuple(input_shape) if input_shape is not None else None)

    @classmethod
    def from_job(cls, job: Mapping[str, Any]) -> ZooRow | None:
        """The row of a finished service job (``GET /v1/jobs/{id}``); None while it has not finished."""
        request = ModelRequest.from_dict(job["request"])
        if job["state"] == JobState.FAILED:
            return cls.failed(request.name, job.get("error") or "failed", request.input_shape)
        if job["state"] != JobState.SUCCEEDED or not job.get("result"):
            return None
        return cls.from_report(ModelReport.from_job(dict(job)))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape) if self.input_shape is not None else None
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ZooRow:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in obj.items() if k in names}
        if values.get("input_shape") is not None:
            values["input_shape"] = tuple(values["input_shape"])
        return cls(**values)
