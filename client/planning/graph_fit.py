"""A graph profile at any batch size, derived from graph profiles of one model at a few batch sizes.

A graph plan (``acg``) is searched under the graph predictor, which replays one instrumented step of the
unmodified model (:class:`~remat.client.planning.graph_predict.GraphProfile`). The stage trace has a twin at
any batch size (remat.client.derived_trace); until this module the graph profile had none, so a question asked
across batch sizes (``max-batch``) could not search graph plans, and on models whose blocks branch (CrossViT,
DARTS-like cells, GoogLeNet, DenseNet) it answered from chain plans that keep up to 5x more.

What a graph profile records is the same step at every batch: the same fx nodes, packs, autograd nodes and
storages, in the same order, and per record a byte count. Measured on ResNet-18 and DenseNet-121 at 32²,
CrossViT-Tiny at 240² and GPT-2 at 32 tokens, profiled at batch 2, 4, 6 and 9 (tests/client/planning/
test_graph_fit.py keeps the check): every record's structure equal, and every byte count of every storage,
gradient, transient and pack peak affine in the batch, to the byte. The one field that is not is the step's
own measured peak, a maximum over the step's events (GPT-2's is its parameter gradients' until batch 6, an
activation's at 9). So:

- **byte counts** (:data:`BYTE_FIELDS`) take the piecewise-linear function through the profiled points
  (``derived_trace.piecewise_at``: exact at each profile, the end pieces extended), as a derived trace's do;
  the measured peak too, which only :func:`remat.worker.pipeline.explains_its_step`'s check reads, never a
  plan's prediction (a replay computes a plan's peak from the per-event fields).
- **what numbers things** must be equal in every profile, except two labels that depend on the process, not
  the model: autograd sequence numbers (a process-wide counter: only their order is read, so they are compared
  and carried relative to the profile's first) and the BatchNorm restore's slot names (``id(module).buffer``:
  compared and carried by the order in which each module first appears). Any other difference is refused,
  naming the record: the profiles then do not describe one step.

A transient that is a maximum of terms within one op could be off the line past the last profile, as a stage's
backward peak can (shared/any-batch.md); none was in the models above. A plan from a derived graph profile is
a prediction like every derived trace's, and ``max-batch`` measures the step at its answer before it answers.

Torch-free, like the predictor.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.client.derived_trace import SizeFitError, piecewise_at
from remat.client.planning.graph_predict import GraphProfile

__all__ = ["BYTE_FIELDS", "GraphProfileFit", "fit_graph_profiles"]

BYTE_FIELDS = frozenset({"sizes", "root_grad", "measured_peak", "peak", "pack_peaks", "extra", "bytes", "storage",
                         "incoming_bytes", "leftover"})
"""Keys of a graph profile's wire format (``GraphProfile.to_dict``) whose values are byte counts, or lists of
them: what grows with the batch. A node's ``slots`` entries carry theirs as their second item."""
_SLOT_NAME = re.compile(r"^(\d+)\.(.+)$")
"""``id(module).buffer``: ``remat.worker.graph_profile``'s name for a BatchNorm restore slot."""


@dataclass(frozen=True)
class GraphProfileFit:
    """Graph profiles of one model at several batch sizes, lined up: :meth:`at` writes the profile at any."""

    sizes: tuple[int, ...]
    _trees: tuple[dict[str, Any], ...] = field(repr=False)
    _memo: dict[int, GraphProfile] = field(default_factory=dict, repr=False, compare=False)

    def at(self, size: int) -> GraphProfile:
        """The graph profile at batch ``size`` (a profiled one is returned as it was profiled, relabelled)."""
        if size < 1:
            raise SizeFitError(f"batch_size: must be at least 1, got {size}")
        if size not in self._memo:
            if len(self._memo) >= 64:  # a batch search visits O(log B) sizes; a long-lived fit stays bounded
                self._memo.clear()
            self._memo[size] = GraphProfile.from_dict(_carry(self._trees, self.sizes, size, ()))
        return self._memo[size]


def fit_graph_profiles(profiles: Sequence[GraphProfile], sizes: Sequence[int]) -> GraphProfileFit:
    """Line up graph profiles of one model taken at ``sizes`` (two or more different batch sizes).

    Raises:
        remat.client.derived_trace.SizeFitError: fewer than two sizes, or the profiles differ in anything but
            their byte counts (naming the first record that does).
    """
    if len(profiles) != len(sizes):
        raise SizeFitError(f"graph profiles: {len(profiles)} profiles for {len(sizes)} batch sizes")
    if len(set(sizes)) != len(sizes) or len(sizes) < 2:
        raise SizeFitError(f"graph profiles: need two or more different batch sizes, got {list(sizes)}")
    order = sorted(range(len(sizes)), key=lambda k: sizes[k])
    trees = tuple(_relabelled(profiles[k].to_dict()) for k in order)
    fit = GraphProfileFit(sizes=tuple(sizes[k] for k in order), _trees=trees)
    # Every difference but the byte counts refused now, not later; the walk's result is the smallest batch's.
    fit._memo[fit.sizes[0]] = GraphProfile.from_dict(_carry(trees, fit.sizes, fit.sizes[0], ()))
    return fit


def _relabelled(tree: dict[str, Any]) -> dict[str, Any]:
    """The profile's wire format with its process-dependent labels made the model's: sequence numbers relative
    to the first autograd node's, slot names numbered by the order their module first appears."""
    numbered = [rec["seq"] for rec in tree["autograd"] if rec["seq"] >= 0]
    first = min(numbered, default=0)
    autograd = [{**rec, "seq": rec["seq"] - first} if rec["seq"] >= 0 else rec for rec in tree["autograd"]]
    modules: dict[str, int] = {}
    nodes = []
    for node in tree["nodes"]:
        slots = []
        for name, nbytes in node["slots"]:
            matched = _SLOT_NAME.match(name)
            if matched is not None:
                number = modules.setdefault(matched.group(1), len(modules))
                name = f"{number}.{matched.group(2)}"
            slots.append([name, nbytes])
        nodes.append({**node, "slots": slots})
    return {**tree, "autograd": autograd, "nodes": nodes}


def _carry(trees: Sequence[Any], sizes: Sequence[int], size: int, path: tuple[Any, ...]) -> Any:
    """Every value at ``size``: byte counts fitted, everything else equal in every profile (module docstring)."""
    first = trees[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path) or "the profile"
    if isinstance(first, dict):
        if any(not isinstance(t, dict) or list(t) != list(first) for t in trees):
            raise SizeFitError(f"graph profile{where}: its fields differ between the batch sizes {list(sizes)}")
        return {key: _carry([t[key] for t in trees], sizes, size, (*path, key)) for key in first}
    if isinstance(first, list):
        if any(not isinstance(t, list) or len(t) != len(first) for t in trees):
            raise SizeFitError(f"graph profile{where}: its length differs between the batch sizes {list(sizes)} "
                               f"({', '.join(str(len(t)) if isinstance(t, list) else '-' for t in trees)})")
        return [_carry([t[k] for t in trees], sizes, size, (*path, k)) for k in range(len(first))]
    if all(t == first for t in trees) and all(type(t) is type(first) for t in trees):
        return first
    if _is_bytes(path) and all(isinstance(t, int) and not isinstance(t, bool) for t in trees):
        return piecewise_at(sizes, trees, size, 1)
    shown = ", ".join(f"{b}: {t!r}" for b, t in zip(sizes, trees, strict=True))
    raise SizeFitError(f"graph profile{where}: differs between the batch sizes ({shown}); only byte counts may")


def _is_bytes(path: tuple[Any, ...]) -> bool:
    """Whether the value at ``path`` is a byte count: under a :data:`BYTE_FIELDS` key, or a slot's bytes."""
    keys = [p for p in path if isinstance(p, str)]
    if not keys:
        return False
    if keys[-1] == "slots":
        return path[-1] == 1
    return keys[-1] in BYTE_FIELDS
