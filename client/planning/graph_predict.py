"""Predict the measured activation peak of an op-graph plan by replaying one profiled step as events.

Pure Python, no torch: the planners can judge plans with it wherever they run. Its input is the record of
one instrumented step of the unmodified model (:class:`GraphProfile`, which
``remat.worker.graph_profile.profile_graph`` records) and the order
in which the plan's executor runs the fx nodes (``graph_profile.executor_units``: kept nodes alone, each
checkpointed call as one unit). ``predict_graph_peak`` returns the peak of ``measure_step``'s
``measured_peak_bytes`` for that plan (CPU, exact storage bytes) and the event that reached it.

The simulation keeps a ledger of storages, each alive while it has a holder, and replays the step:

Forward, unit by unit. A node's transient (its profiled peak above the level it started at) is a peak
candidate on top of what is alive; then its surviving storages are held by
- ``env``: the fx value, until its last reader has run (a checkpointed call reads its inputs for its whole
  duration; the model's outputs are read by the loss);
- ``saved``: for a kept node, each storage autograd packed, until the autograd node that unpacks it has run
  its backward (``release_variables``);
- ``frame``: a checkpointed call that packed anything keeps its inputs (``frame.saved_args``) until the last
  of its autograd nodes holding a pack has run backward (the unpack hooks, which hold the frame, die with
  their saved variables). A call that packs nothing (cats, adds, views) keeps no input.
Inside a call nothing packed is kept: internal storages die with their node unless read later.

Backward, as the CPU engine runs it: the ready node of highest sequence number first, where sequence numbers
follow the plan's creation order (a checkpointed call is created when its unit runs) and ``AccumulateGrad``
runs as soon as it is ready. Each node's profiled apply transient is a candidate on top of the ledger; the
gradients it sends are new storages, the very tensor it received (``AddBackward0``) or views of a received
storage (``CatBackward0``); the engine then frees its inputs and saved tensors and adds each gradient into
the next node's input buffer, always into a new buffer (NOTE [ accumulation under the meter ]).

Recompute (non-reentrant, early stop): when the first autograd node of a call that holds a pack runs, the
call's nodes are re-run on top of everything alive then (the node's received gradients included), with the
BatchNorm buffer snapshot (``stage_chain._RestoreBuffers``) alive meanwhile; every packed storage is kept
(``frame.recomputed``) until its consumer runs, others die after their last reader, and the re-run stops at
the call's last pack, which may fall before the output of that op exists (an op packs its inputs before it
runs): that node is charged its profiled peak up to that pack only.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from remat.client.errors import PlanError

__all__ = ["LOSS", "AutogradRecord", "BackwardNeed", "GradientRecord", "GraphProfile", "NodeRecord", "PackRecord",
           "Prediction", "SearchResult", "autograd_ancestors", "autograd_senders", "backward_needs", "call_groups",
           "forced_peak", "group_cuts", "predict_graph_peak", "saved_weights", "search_plan"]

LOSS = "<loss>"
"""The pseudo fx node of the loss: it reads the model's outputs and runs after every node."""
_INF = float("inf")


# --- the recorded step ----------------------------------------------------------------------------------
# A storage is named by its sid, an index into ``GraphProfile.storage_bytes``: every storage born during the
# profiled step gets one, in birth order. Records are plain JSON-able dicts (typed below) so that a profile
# can be stored as it is; the predictor only reads them.


class NodeRecord(TypedDict):
    """One fx node's forward (the loss's pseudo node ``LOSS`` included), in traced order."""

    name: str
    reads: list[str]
    """The fx nodes whose values it reads (``get_attr`` nodes left out)."""
    packs: list[int]
    """Indices into ``GraphProfile.packs`` of the tensors autograd packed while it ran, in order."""
    pack_peaks: list[int]
    """Per pack: the peak in bytes above the level at the node's start, reached up to that pack (a re-run that
    stops at the call's last pack is charged this)."""
    pack_alive: list[list[int]]
    """Per pack: the sids born in the node still alive at that pack."""
    slots: list[list[Any]]
    """``[slot name, bytes]`` of each buffer the checkpoint's BatchNorm restore snapshots for this node."""
    autograd: list[int]
    """Indices into ``GraphProfile.autograd`` of the nodes it created, by sequence number (``AccumulateGrad``
    left out: the engine runs those as soon as they are ready)."""
    peak: int
    """Its transient peak in bytes above the level at its start."""
    births: list[int]
    """The sids it created that survive it."""
    value: list[int]
    """The sids its value refers to (a view or an in-place op refers to an earlier node's storage)."""


class PackRecord(TypedDict):
    """One tensor autograd packed in forward."""

    node: str | None
    """The fx node that was running (None outside every node)."""
    sid: int | None
    """The packed storage; None for a storage born before the step (parameters, buffers, the input batch)."""
    consumer: int | None
    """The autograd node that unpacked it in backward, which releases it; None when nothing did."""


class GradientRecord(TypedDict):
    """One gradient an autograd node sent; exactly one of ``new``, ``same``, ``view``, ``other`` is present."""

    bytes: int
    """The gradient tensor's own bytes (numel times element size)."""
    dense: bool
    """Whether the engine may accumulate into it in place (contiguous, or channels-last 4-d)."""
    new: NotRequired[int]
    """A storage the apply created: its index among the apply's births (several gradients may share one)."""
    storage: NotRequired[int]
    """With ``new``: that storage's bytes."""
    same: NotRequired[int]
    """The very tensor received at this input slot (``AddBackward0``)."""
    view: NotRequired[int]
    """A view of the storage received at this input slot (``CatBackward0``'s slices)."""
    other: NotRequired[int | None]
    """A storage from elsewhere (a saved tensor, a parameter): no new memory."""


class AutogradRecord(TypedDict):
    """One autograd node of the step; the keys after ``seq`` exist once its backward has run."""

    index: int
    type: str
    """Its class name (``AccumulateGrad``, ``AddBackward0``, ...)."""
    fx: str
    """The fx node that created it (the first whose outputs reach it)."""
    seq: int
    """Its sequence number in the profiled step; -1 for ``AccumulateGrad``."""
    next: NotRequired[list[list[int]]]
    """``[autograd index or -1, input slot]`` per gradient it sends, as ``next_functions``."""
    extra: NotRequired[int]
    """Its apply's transient peak in bytes above the level at the apply's start."""
    outs: NotRequired[list[GradientRecord | None]]
    """Per gradient it sends, in ``next`` order (None for an undefined gradient)."""
    inputs: NotRequired[int]
    """How many gradients it receives (the length of its input buffer)."""
    incoming_sids: NotRequired[list[int | None]]
    """The sid of each gradient it received."""
    incoming_bytes: NotRequired[list[int]]
    """The bytes of each gradient it received."""
    leftover: NotRequired[int]
    """Bytes the apply left alive that none of its gradients holds."""


@dataclass(frozen=True, slots=True)
class GraphProfile:
    """One instrumented training step of the unmodified model on its op graph, as the predictor replays it.

    Produced by ``remat.worker.graph_profile.profile_graph``; pure data, no torch, so the planners can judge
    plans with it wherever they run. The records are shared, not copied: treat them as read-only.
    """

    nodes: list[NodeRecord]
    """Every fx node's forward in traced order, the loss's pseudo node ``LOSS`` last."""
    packs: list[PackRecord]
    """Every tensor autograd packed in forward, in order (``NodeRecord.packs`` index it)."""
    autograd: list[AutogradRecord]
    """Every autograd node of the step, in order of discovery (``AutogradRecord.index`` is its position)."""
    storage_bytes: list[int]
    """Bytes of each storage born during the step, indexed by sid."""
    root: int
    """The autograd index of the loss's ``grad_fn``, where backward starts."""
    root_grad_bytes: list[int]
    """Bytes of each storage born for the loss's seed gradient (``torch.ones_like(loss)``)."""
    param_grad_sids: list[int]
    """Sorted sids of the parameters' ``.grad`` storages after the step (kept under ``grads="kept"``)."""
    measured_peak_bytes: int
    """The profiled step's own peak above its baseline: what ``measure_step`` measures for no checkpointing."""
    grads: str = "kept"
    """The gradient convention of the step (``"kept"`` or ``"none"``); a prediction uses the same."""
    version: int = 1
    """The wire format's version (:meth:`to_dict`)."""
    _facts: _StepFacts | None = field(default=None, init=False, repr=False, compare=False)
    """What every replay of this step reads and no plan changes (:meth:`facts`), made at the first replay."""

    def facts(self) -> _StepFacts:
        """The replay's plan-independent facts of this step, made once: the search replays up to 2,000 plans
        of one profile, and a profile is never changed."""
        if self._facts is None:
            object.__setattr__(self, "_facts", _StepFacts.of(self))
        assert self._facts is not None
        return self._facts

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able wire format (the untyped dict ``profile_graph`` returned before this class): the same
        keys in the same order, the records shared."""
        return {"version": self.version, "grads": self.grads, "nodes": self.nodes, "packs": self.packs,
                "autograd": self.autograd, "sizes": self.storage_bytes, "root": self.root,
                "root_grad": self.root_grad_bytes, "param_grad_sids": self.param_grad_sids,
                "measured_peak": self.measured_peak_bytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GraphProfile:
        """A profile from its wire format (:meth:`to_dict`, e.g. read back from JSON); a missing
        ``param_grad_sids`` reads as none, as the predictor always took it."""
        if data.get("version", 1) != 1:
            raise ValueError(f"graph profile version {data.get('version')!r} is not 1")
        return cls(nodes=data["nodes"], packs=data["packs"], autograd=data["autograd"], storage_bytes=data["sizes"],
                   root=data["root"], root_grad_bytes=data["root_grad"],
                   param_grad_sids=list(data.get("param_grad_sids", ())), measured_peak_bytes=data["measured_peak"],
                   grads=data.get("grads", "kept"), version=data.get("version", 1))


@dataclass(slots=True)
class Prediction:
    """A predicted step: its activation peak in bytes and a description of the event that reached it."""

    peak: int
    where: str
    events: int = 0
    unexplained: int = 0
    """Bytes of storages a node left alive that the profile cannot attribute (0 on the models tested)."""
    events_at_peak: int = 0
    peaks: int = 0
    """Events that reach the peak: identical blocks (ResNet's, DenseNet's layers) tie at one peak, and a plan
    search that lowers one of them has made progress the peak alone does not show."""
    live: dict[Any, int] | None = None
    """With ``capture=True``: the storages alive when the peak was reached (key -> bytes). A forward storage's
    key is its profile sid, a recomputed one ``("r", call, sid)``, a gradient or scratch ``("g", k)``."""


@dataclass(eq=False, slots=True)
class _Grad:
    """A gradient tensor object of the engine: its storage, its own bytes, its layout, its owners."""

    storage: Any
    nbytes: int
    dense: bool
    refs: int = 0


@dataclass(slots=True)
class _Ledger:
    """The storages alive during the replay, each with its holders, and the peak so far.

    Why named holders rather than reference counts: a storage dies when its last holder lets go, and each
    holder (``("env", node)``, ``("saved", pack)``, ``("frame", call)``, ...) is released by the event that
    ends it, whichever of them comes last; a holder that holds twice still holds once.
    """

    sizes: dict[Any, int] = field(default_factory=dict)
    """Bytes of each live storage, by key (see ``Prediction.live``)."""
    holders: dict[Any, set[Any]] = field(default_factory=dict)
    level: int = 0
    """Bytes alive now."""
    peak: int = 0
    where: str = "nothing"
    peak_event: int = 0
    peak_count: int = 0
    events: int = 0
    counter: int = 0
    """Keys handed out by :meth:`new`."""
    capture_at: int = -1
    live: dict[Any, int] | None = None
    stop_above: float = _INF
    """A peak above this ends the replay (``_AbovePeak``): the search's judge needs no more of such a plan
    (NOTE [ replays stopped above the running ])."""

    def observe(self, transient: int, what: str) -> None:
        """An event: ``transient`` bytes on top of the level are a peak candidate (and, at event
        ``capture_at``, the live storages are copied)."""
        self.events += 1
        level = self.level + transient
        if level > self.peak:
            if level > self.stop_above:
                raise _AbovePeak(level)
            self.peak = level
            self.where = what
            self.peak_event = self.events
            self.peak_count = 1
        elif level == self.peak:
            self.peak_count += 1
        if self.events == self.capture_at:
            self.live = dict(self.sizes)

    def alloc(self, key: Any, nbytes: int) -> None:
        """A storage comes alive, held by nobody yet; a storage already alive stays as it is."""
        if key in self.sizes:
            return
        self.sizes[key] = nbytes
        self.holders[key] = set()
        self.level += nbytes

    def new(self, nbytes: int) -> Any:
        """A storage the profile has no sid for (a gradient, a snapshot, scratch): a fresh key."""
        self.counter += 1
        key = ("g", self.counter)
        self.alloc(key, nbytes)
        return key

    def hold(self, key: Any, holder: Any) -> None:
        """``holder`` keeps ``key`` alive (nothing for a storage that is not alive)."""
        if key in self.sizes:
            self.holders[key].add(holder)

    def release(self, key: Any, holder: Any) -> None:
        """``holder`` lets go of ``key``, which dies with its last holder."""
        hs = self.holders.get(key)
        if hs is None:
            return
        hs.discard(holder)
        if not hs:
            self.free(key)

    def free(self, key: Any) -> None:
        """``key`` dies whoever holds it."""
        if key in self.sizes:
            self.level -= self.sizes.pop(key)
            del self.holders[key]

    def free_if_unheld(self, key: Any) -> None:
        """``key`` dies if nobody took it up: a storage born and let go of within one event."""
        if key in self.holders and not self.holders[key]:
            self.free(key)


class _AbovePeak(Exception):  # noqa: N818 -- a signal that ends a replay, not an error
    """A replay passed its ``stop_above``: its peak is at least ``level`` bytes."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.level = level


def _flatten(units: Sequence[dict[str, Any]]) -> list[tuple[str, int | None]]:
    """Every fx node in run order with the index of its checkpointed call (None when kept), ``LOSS`` last:
    the replay needs the order and the call membership, not the units' nesting."""
    flat: list[tuple[str, int | None]] = []
    calls = 0
    for unit in units:
        if unit["call"]:
            flat += [(name, calls) for name in unit["nodes"]]
            calls += 1
        else:
            flat += [(name, None) for name in unit["nodes"]]
    flat.append((LOSS, None))
    return flat


def predict_graph_peak(profile: GraphProfile, units: Sequence[dict[str, Any]], *,
                       capture: bool = False) -> Prediction:
    """The measured activation peak of one training step run as ``units`` (see the module docstring).

    Args:
        profile: ``profile_graph``'s record of the unmodified model's step (with the same grads convention as
            the step to predict).
        units: ``executor_units(graph, dropped)``: fx node names in the order the plan's executor runs them,
            checkpointed calls marked.
        capture: also report the storages alive at the peak (``Prediction.live``; replays the step twice).
    """
    if capture:
        first = _simulate(profile, units, -1)
        return _simulate(profile, units, first.events_at_peak)
    return _simulate(profile, units, -1)


def backward_labels(profile: GraphProfile) -> list[str]:
    """What each autograd node's backward is called where it is the peak (``Prediction.where``)."""
    return [f"backward of {node['type']} #{a} ({node['fx']})" for a, node in enumerate(profile.autograd)]


def _simulate(profile: GraphProfile, units: Sequence[dict[str, Any]], capture_at: int,
              stop_above: float = _INF) -> Prediction:
    """One replay of the step: the plan's schedule, then forward and backward on one ledger (module docstring).

    ``capture_at``: the event at which to copy the ledger's storages into ``Prediction.live`` (-1: none).
    ``stop_above``: raise ``_AbovePeak`` as soon as the peak passes it.
    """
    schedule = _Schedule.of(profile, units)
    led = _Ledger(capture_at=capture_at, stop_above=stop_above)
    unexplained = _replay_forward(profile, schedule, led)
    _Backward(profile, schedule, led).run()
    return Prediction(peak=led.peak, where=led.where, events=led.events, unexplained=unexplained, live=led.live,
                      events_at_peak=led.peak_event, peaks=led.peak_count)


_CALLS_REMEMBERED = 256
"""Calls whose facts a profile keeps (then it forgets them all): a search step's moves share the calls of the plan
it stands on, while 2,000 plans of ResNet-152 meet 1,300 calls whose facts held 28 MiB as long as the profile."""


@dataclass(slots=True)
class _CallFacts:
    """What a checkpointed call of given nodes packs, keeps and re-runs: a function of its nodes alone, and the
    search's plans share most of their calls."""

    packs: list[int]
    """The packs its nodes made (indices into ``GraphProfile.packs``)."""
    owners: set[int]
    """The autograd nodes that unpack one of its packs (the first to run triggers the re-run)."""
    inputs: list[int]
    """The storages of the values it reads from outside, first read first (its frame's ``saved_args``)."""
    last: int
    """The position of its last node that packs anything: where its re-run stops (-1: it packs nothing)."""
    snapshot_bytes: int
    """Bytes of the BatchNorm buffer snapshot its re-run keeps."""
    names: tuple[str, ...]
    """Its nodes in run order."""
    _free_after: dict[int, list[str]] | None = None

    def free_after(self, readers: Mapping[str, Sequence[str]]) -> dict[int, list[str]]:
        """Per position in its re-run, the values that die after it (:func:`_recompute_frees`); made at its
        first re-run, since most plans the search judges stop before their calls re-run."""
        if self._free_after is None:
            self._free_after = _recompute_frees(self.names, self.last, readers)
        return self._free_after


@dataclass(frozen=True, slots=True)
class _StepFacts:
    """What every replay of one profiled step reads and no plan changes (``GraphProfile.facts``)."""

    nodes: dict[str, NodeRecord]
    """The profile's node records by name."""
    readers: dict[str, list[str]]
    """Per node, the nodes that read its value (every node runs once in any plan, in some order)."""
    labels: list[str]
    """What each autograd node's backward is called where it is the peak (:func:`backward_labels`)."""
    deps: list[int]
    """Per autograd node, the gradients it waits for before it is ready (see ``_Backward.deps``)."""
    consumed: dict[int, list[int]]
    """Per autograd node, the packs it unpacks (it releases them when it has run)."""
    param_grads: set[int]
    """The sids of the parameters' ``.grad`` storages."""
    accumulate_grads: list[int]
    """The ``AccumulateGrad`` nodes: they run as soon as they are ready (:func:`_sequence_numbers`)."""
    calls: dict[tuple[str, ...], _CallFacts]
    """Calls met lately, by their nodes (filled by :meth:`call`; at most ``_CALLS_REMEMBERED``)."""

    @classmethod
    def of(cls, profile: GraphProfile) -> _StepFacts:
        """The facts of ``profile``'s step."""
        nodes = {rec["name"]: rec for rec in profile.nodes}
        readers: dict[str, list[str]] = {}
        for rec in profile.nodes:
            for u in rec["reads"]:
                readers.setdefault(u, []).append(rec["name"])
        # Counted, as the engine's ``compute_dependencies`` does, over the nodes the loss reaches only. A node
        # that reaches none (a model output the loss does not read: CLIP's ``logits_per_image``, a transpose
        # of the logits the loss transposes again on its own) sends nothing, and counted it left the logits'
        # node waiting for ever: the replay of a two-block CLIP's step stopped after 7 of its 281 nodes.
        deps = [0] * len(profile.autograd)
        reached = {profile.root}
        stack = [profile.root]
        while stack:
            for t, _ in profile.autograd[stack.pop()].get("next", ()):
                if t >= 0:
                    deps[t] += 1
                    if t not in reached:
                        reached.add(t)
                        stack.append(t)
        consumed: dict[int, list[int]] = {}
        for p, pk in enumerate(profile.packs):
            if pk["consumer"] is not None:
                consumed.setdefault(pk["consumer"], []).append(p)
        return cls(nodes=nodes, readers=readers, labels=backward_labels(profile), deps=deps, consumed=consumed,
                   param_grads=set(profile.param_grad_sids), calls={},
                   accumulate_grads=[a["index"] for a in profile.autograd if a["type"] == "AccumulateGrad"])

    def call(self, profile: GraphProfile, names: Sequence[str]) -> _CallFacts:
        """The facts of a call running ``names`` (run order), made at its first use."""
        key = tuple(names)
        found = self.calls.get(key)
        if found is None:
            if len(self.calls) >= _CALLS_REMEMBERED:
                self.calls.clear()
            nodes, packs = self.nodes, profile.packs
            call_packs = [p for name in names for p in nodes[name]["packs"]]
            last = max((i for i, name in enumerate(names) if nodes[name]["packs"]), default=-1)
            snap: dict[str, int] = {}
            for name in names:
                for slot, nbytes in nodes[name]["slots"]:
                    snap[slot] = nbytes
            found = self.calls[key] = _CallFacts(
                packs=call_packs,
                owners={packs[p]["consumer"] for p in call_packs if packs[p]["consumer"] is not None},
                inputs=_call_inputs(nodes, names), last=last, snapshot_bytes=sum(snap.values()), names=key)
        return found


@dataclass(slots=True)
class _Schedule:
    """What a plan changes about the step, derived once from the units before anything is replayed: the run
    order, which call each node belongs to, when each value's holders let go of it, and what each call's
    packs and frame keep. Forward, backward and recompute all read it; none of it depends on the ledger."""

    nodes: dict[str, NodeRecord]
    """The profile's node records by name."""
    flat: list[tuple[str, int | None]]
    """Every node in run order with its call (None for a kept node), ``LOSS`` last."""
    call_of: dict[str, int]
    """The call of each checkpointed node."""
    call_nodes: list[list[str]]
    """Per call, its nodes in run order."""
    readers: dict[str, list[str]]
    """Per node, the nodes that read its value (``_StepFacts.readers``)."""
    env_release: dict[int, list[str]]
    """Per forward step, the nodes whose values lose their ``env`` holder after that step."""
    calls: list[_CallFacts]
    """Per call, what it packs, keeps and re-runs."""
    owner_calls: dict[int, list[int]]
    """Per autograd node, the calls it owns a pack of."""

    @classmethod
    def of(cls, profile: GraphProfile, units: Sequence[dict[str, Any]]) -> _Schedule:
        """The schedule of ``units`` on ``profile``'s step."""
        facts = profile.facts()
        nodes, readers = facts.nodes, facts.readers
        flat = _flatten(units)
        step_of = {name: i for i, (name, _) in enumerate(flat)}
        call_of = {name: g for name, g in flat if g is not None}
        n_calls = 1 + max((g for _, g in flat if g is not None), default=-1)
        call_nodes: list[list[str]] = [[] for _ in range(n_calls)]
        for name, g in flat:
            if g is not None:
                call_nodes[g].append(name)
        env_release = _env_releases(flat, step_of, call_of, call_nodes, readers)
        calls = [facts.call(profile, names) for names in call_nodes]
        owner_calls: dict[int, list[int]] = {}
        for g, call in enumerate(calls):
            for a in call.owners:
                owner_calls.setdefault(a, []).append(g)
        return cls(nodes=nodes, flat=flat, call_of=call_of, call_nodes=call_nodes, readers=readers,
                   env_release=env_release, calls=calls, owner_calls=owner_calls)


def _env_releases(flat: Sequence[tuple[str, int | None]], step_of: Mapping[str, int], call_of: Mapping[str, int],
                  call_nodes: Sequence[Sequence[str]], readers: Mapping[str, Sequence[str]]) -> dict[int, list[str]]:
    """Per forward step, the values whose ``env`` holder lets go after it: after the value's last reader, where
    a reader inside another checkpointed call holds it until that call's end (the call reads its inputs for
    its whole duration)."""
    call_end = {g: step_of[names[-1]] for g, names in enumerate(call_nodes)}

    def release_step(name: str) -> int:
        g = call_of.get(name)
        last = step_of[name]
        for r in readers.get(name, ()):
            rg = call_of.get(r)
            last = max(last, call_end[rg] if rg is not None and rg != g else step_of[r])
        return last

    env_release: dict[int, list[str]] = {}
    for name, _ in flat:
        if name != LOSS:
            env_release.setdefault(release_step(name), []).append(name)
    return env_release


def _call_inputs(nodes: Mapping[str, NodeRecord], names: Sequence[str]) -> list[int]:
    """The storages of the values a call's nodes read from outside it, first read first: what its frame
    keeps (``saved_args``) while one of its packs is alive."""
    inside = set(names)
    ins: list[int] = []
    for name in names:
        for u in nodes[name]["reads"]:
            if u not in inside:
                ins += [s for s in nodes[u]["value"] if s not in ins]
    return ins


def _replay_forward(profile: GraphProfile, schedule: _Schedule, led: _Ledger) -> int:
    """Forward, node by node in the plan's order: each node's transient is a peak candidate, then its surviving
    storages are held by ``env``, by autograd (``saved``, kept nodes only) and by its call's frame (module
    docstring); a checkpointed node's storages nobody holds die with it. Returns the bytes a kept node left
    alive that no holder explains (kept alive, as the profiled step did)."""
    nodes, sizes, packs = schedule.nodes, profile.storage_bytes, profile.packs
    unexplained = 0
    for step, (name, g) in enumerate(schedule.flat):
        rec = nodes[name]
        if g is not None and name == schedule.call_nodes[g][0] and schedule.calls[g].packs:
            for s in schedule.calls[g].inputs:
                led.hold(s, ("frame", g))
        led.observe(rec["peak"], f"forward of {name}" + (f" (call {g})" if g is not None else ""))
        for s in rec["births"]:
            led.alloc(s, sizes[s])
        for s in rec["value"]:
            led.hold(s, ("env", name))
        if g is None:
            for p in rec["packs"]:
                if packs[p]["sid"] is not None:
                    led.hold(packs[p]["sid"], ("saved", p))
        for s in rec["births"]:
            if s in led.holders and not led.holders[s]:
                if g is None:  # alive after a kept node in the profile with no holder we know of: keep it
                    unexplained += sizes[s]
                    led.hold(s, ("other", name))
                else:
                    led.free(s)
        for done in schedule.env_release.get(step, ()):
            for s in nodes[done]["value"]:
                led.release(s, ("env", done))
    return unexplained


def _sequence_numbers(profile: GraphProfile, schedule: _Schedule) -> list[float]:
    """The priority of each autograd node in the plan's backward: the engine runs the ready node of highest
    sequence number first, numbers follow the plan's creation order (a call's autograd nodes are created when
    its unit runs), and ``AccumulateGrad`` runs as soon as it is ready."""
    seq: list[float] = [-1] * len(profile.autograd)
    counter = 0
    nodes = schedule.nodes
    for name, _ in schedule.flat:
        for a in nodes[name]["autograd"]:
            seq[a] = counter
            counter += 1
    for a in profile.facts().accumulate_grads:
        seq[a] = _INF
    if -1 in seq:  # created outside the executor's nodes (never seen so far)
        for a, rec in enumerate(profile.autograd):
            if seq[a] == -1:
                seq[a] = counter + rec["seq"]
    return seq


def _recompute(profile: GraphProfile, schedule: _Schedule, led: _Ledger, g: int, trigger: str) -> None:
    """Call ``g``'s non-reentrant re-run, on top of everything alive when its first owner runs backward: the
    BatchNorm buffer snapshot lives meanwhile, each packed storage is kept (``("rec", pack)``) until its
    consumer runs, other values die after their last reader in the call, and the re-run stops at the call's
    last pack, which may fall inside that node (charged its profiled peak up to the pack only)."""
    nodes, sizes, packs = schedule.nodes, profile.storage_bytes, profile.packs
    names, call = schedule.call_nodes[g], schedule.calls[g]
    snap_key = led.new(call.snapshot_bytes)
    led.hold(snap_key, "snapshot")
    last, free_after = call.last, call.free_after(schedule.readers)
    born_here: set[int] = set()
    for i, name in enumerate(names[:last + 1]):
        rec = nodes[name]
        what = f"recompute of {name} (call {g}, for {trigger})"
        if i == last:
            led.observe(rec["pack_peaks"][-1], what + ", stopped at its last pack")
            births = rec["pack_alive"][-1]
        else:
            led.observe(rec["peak"], what)
            births = rec["births"]
        for s in births:
            led.alloc(("r", g, s), sizes[s])
            born_here.add(s)
        for p in rec["packs"]:
            s = packs[p]["sid"]
            if s is not None and s in born_here:
                led.hold(("r", g, s), ("rec", p))
        for s in rec["value"]:
            if s in born_here:
                led.hold(("r", g, s), ("renv", name))
        for s in births:
            led.free_if_unheld(("r", g, s))
        for done in free_after.get(i, ()):
            for s in nodes[done]["value"]:
                if s in born_here:
                    led.release(("r", g, s), ("renv", done))
    for name in names[:last + 1]:  # the stop: the re-run's frames die
        for s in nodes[name]["value"]:
            if s in born_here:
                led.release(("r", g, s), ("renv", name))
    led.release(snap_key, "snapshot")


def _recompute_frees(names: Sequence[str], last: int, readers: Mapping[str, Sequence[str]]) -> dict[int, list[str]]:
    """Per position in a call's re-run (up to its stop at ``last``), the values that die after it.

    A value dies after its last reader in the call, or at the stop when a reader comes later or lies outside
    the call (the body returns its outputs only at its end, which the stop never reaches): those are not
    listed here but released at the stop.
    """
    index = {name: i for i, name in enumerate(names)}
    free_after: dict[int, list[str]] = {}
    for i, name in enumerate(names[:last + 1]):
        rs = readers.get(name, ())
        at = max((index[r] for r in rs if r in index), default=i)
        if at < last and all(r in index for r in rs):
            free_after.setdefault(at, []).append(name)
    return free_after


class _Backward:
    """Backward as the CPU engine runs it, on the ledger forward left: a ready queue by sequence number, each
    node's input buffer, and the gradient tensors' owners (module docstring).

    A class because every step of a node's apply (re-run its calls, make its gradients, release what it
    saved, send its gradients on) reads and updates the same engine state.
    """

    __slots__ = ("buffers", "consumed", "deps", "heap", "labels", "led", "owners_left", "pgrads", "profile",
                 "recomputed", "schedule", "seq")

    def __init__(self, profile: GraphProfile, schedule: _Schedule, led: _Ledger) -> None:
        facts = profile.facts()
        self.profile = profile
        self.labels = facts.labels
        self.schedule = schedule
        self.led = led
        self.seq = _sequence_numbers(profile, schedule)
        self.deps = list(facts.deps)
        """Per autograd node, the gradients it still waits for (ready at 0; ``_StepFacts.deps``)."""
        self.buffers: dict[int, list[_Grad | None]] = {}
        self.consumed = facts.consumed
        self.pgrads = facts.param_grads
        self.recomputed = [False] * len(schedule.call_nodes)
        self.owners_left = [len(call.owners) for call in schedule.calls]
        self.heap: list[tuple[float, int]] = []

    def drop(self, t: _Grad) -> None:
        """One owner of ``t`` lets go; its storage loses ``t`` as a holder with the last."""
        t.refs -= 1
        if t.refs == 0:
            self.led.release(t.storage, ("grad", id(t)))

    def own(self, t: _Grad) -> _Grad:
        """One more owner of ``t``; with the first, ``t`` holds its storage."""
        if t.refs == 0:
            self.led.hold(t.storage, ("grad", id(t)))
        t.refs += 1
        return t

    def run(self) -> None:
        """From the loss's seed gradient until no node is ready."""
        profile = self.profile
        root = profile.root
        self.buffers[root] = [None] * max(1, profile.autograd[root].get("inputs", 1))
        root_grad = _Grad(self.led.new(sum(profile.root_grad_bytes)), sum(profile.root_grad_bytes), True)
        self.buffers[root][0] = self.own(root_grad)
        self.heap = [(-self.seq[root], root)]
        while self.heap:
            _, a = heapq.heappop(self.heap)
            self.apply(a)

    # NOTE [ accumulation under the meter ] The engine adds a second gradient into a node's input buffer in place
    # when it holds the only reference to a dense tensor (``InputBuffer::accumulate``, ``can_accumulate_inplace``),
    # unless a Python dispatch mode is active: then every tensor counts as a subclass and the sum is out of place
    # (``aten.add``, not ``aten.add_``; seen with torch.profiler, no mode, against a mode, torch 2.15). The CPU
    # meter that measures every step and the graph profiler's recorder are such modes, so the measured step sums
    # out of place, and this replay does too. Before (in place where the engine would be), a GPT-2's graph plan
    # was predicted 3.4 MiB (4.5%) under its measured peak: its tied embedding's two gradients were summed in a
    # new 11.7 MiB buffer where the plan left little else alive. A CPU run without the meter needs up to that
    # buffer less at such an event: the prediction errs high there, never low.
    def apply(self, a: int) -> None:
        """Autograd node ``a`` runs: its calls are re-run first, then its apply's transient is a peak candidate,
        its gradients are made, its inputs and saved tensors freed, and its gradients sent on.

        The hot path of every prediction (once per autograd node of every plan the search tries): its steps are
        written out here, on local names, rather than as one method each.
        """
        led, profile, schedule, own = self.led, self.profile, self.schedule, self.own
        node = profile.autograd[a]
        inputs = self.buffers.pop(a, [])
        label = self.labels[a]
        owner_calls = schedule.owner_calls.get(a, ())
        for g in owner_calls:
            if not self.recomputed[g]:
                self.recomputed[g] = True
                _recompute(profile, schedule, led, g, label)
        led.observe(node.get("extra", 0), label)
        # The gradients it sends, each owned once: new storages (shared where the apply made one for several),
        # the very tensor it received, a view of a received storage, or no new memory. A new storage no
        # gradient holds is freed at once.
        new_storages: dict[int, Any] = {}
        outs: list[_Grad | None] = []
        for out in node.get("outs", []):
            if out is None:
                outs.append(None)
                continue
            if "new" in out:
                if out["new"] not in new_storages:
                    new_storages[out["new"]] = led.new(out["storage"])
                g_out = _Grad(new_storages[out["new"]], out["bytes"], out["dense"])
            elif "same" in out and out["same"] < len(inputs) and inputs[out["same"]] is not None:
                g_out = inputs[out["same"]]
            elif "view" in out and out["view"] < len(inputs) and inputs[out["view"]] is not None:
                g_out = _Grad(inputs[out["view"]].storage, out["bytes"], out["dense"])
            else:
                g_out = _Grad(led.new(0), out["bytes"], out["dense"])
            outs.append(own(g_out))
        for key in new_storages.values():
            led.free_if_unheld(key)
        if node.get("leftover"):
            led.hold(led.new(node["leftover"]), "leftover")
        if node["type"] == "AccumulateGrad" and self.pgrads and inputs and inputs[0] is not None:
            if node.get("incoming_sids", [None])[0] in self.pgrads:
                led.hold(inputs[0].storage, "param grad")
        for t in inputs:
            if t is not None:
                self.drop(t)
        # The engine frees the saved tensors ``a`` unpacked (``release_variables``), and a call whose last pack
        # owner this was lets go of its frame's inputs.
        packs = profile.packs
        for p in self.consumed.get(a, ()):
            s = packs[p]["sid"]
            if s is None:
                continue
            g = schedule.call_of.get(packs[p]["node"])
            if g is None:
                led.release(s, ("saved", p))
            else:
                led.release(("r", g, s), ("rec", p))
        for g in owner_calls:
            self.owners_left[g] -= 1
            if self.owners_left[g] == 0:
                for s in schedule.calls[g].inputs:
                    led.release(s, ("frame", g))
        deps, heap, seq, buffers, autograd = self.deps, self.heap, self.seq, self.buffers, profile.autograd
        for (t_index, nr), t in zip(node.get("next", []), outs, strict=False):
            if t_index < 0:
                continue
            if t is not None:
                # Into input ``nr`` of node ``t_index``'s buffer (``InputBuffer::accumulate``): the first is kept
                # as it is, a later one is added into a new buffer tensor (a peak candidate): NOTE [ accumulation
                # under the meter ].
                buf = buffers.get(t_index)
                if buf is None:
                    buf = buffers[t_index] = [None] * max(autograd[t_index].get("inputs", 1), nr + 1)
                if len(buf) <= nr:
                    buf += [None] * (nr + 1 - len(buf))
                old = buf[nr]
                if old is None:
                    buf[nr] = own(t)
                else:
                    key = led.new(old.nbytes)
                    led.observe(0, f"gradient accumulation into #{t_index} after {label}")
                    buf[nr] = own(_Grad(key, old.nbytes, True))
                    self.drop(old)
            deps[t_index] -= 1
            if deps[t_index] == 0:
                heapq.heappush(heap, (-seq[t_index], t_index))
        for t in outs:
            if t is not None:
                self.drop(t)


# --- a lower bound on every plan's peak ----------------------------------------------------------------


def forced_peak(profile: GraphProfile) -> Prediction:
    """A peak no plan of this step can go below under the predictor: memory every plan must hold at some
    event, whatever it keeps or re-runs.

    NOTE [forced memory] Checkpointing chooses what stays alive between the events of a step, never what an
    event itself needs. Whatever the plan:
    - a node's first forward runs to the end (only a re-run stops early), on its inputs: the storages of the
      values it reads, plus its profiled transient;
    - an autograd node's backward runs with its saved tensors present (kept, or re-run just before), its
      input gradients, its apply's transient, and, with gradients kept, every parameter gradient sent by a
      node it depends on (that node ran before it, and ``AccumulateGrad`` runs as soon as it is ready).
    The largest of these is the bound. It leaves out what depends on the order or on the plan: gradients
    waiting for other nodes, kept checkpoints, a re-run's other tensors. So it is weak where a step's peak
    is a trade between what forward keeps and what backward re-runs (a gap of tens of percent is usual), and
    tight where one event's own needs decide the peak (a large classifier's weight gradient at a small
    batch). It is what :func:`search_plan`'s answer is reported against (the plan's ``lower_bound_bytes``).
    O(nodes + autograd nodes · parameters) with integer bitsets for the dependencies.
    """
    sizes = profile.storage_bytes
    values = {rec["name"]: rec["value"] for rec in profile.nodes}
    best = Prediction(peak=0, where="nothing")
    for rec in profile.nodes:
        inputs = {sid for name in rec["reads"] for sid in values.get(name, ())}
        need = sum(sizes[sid] for sid in inputs) + rec["peak"]
        if need > best.peak:
            best = Prediction(peak=need, where=f"forward of {rec['name']}")
    for need in backward_needs(profile):
        if need.bytes > best.peak:
            best = Prediction(peak=need.bytes, where=need.where)
    return best


@dataclass(frozen=True, slots=True)
class BackwardNeed:
    """What one autograd node's backward holds whatever the plan (NOTE [forced memory])."""

    index: int
    """The autograd node."""
    bytes: int
    """Its saved tensors, input gradients, apply transient and the parameter gradients already sent."""
    sids: frozenset[int]
    """The profile storages among them (saved tensors, parameter gradients, received gradients that have a
    sid): a bound adding other storages alive at this event must not count these twice."""
    where: str


def backward_needs(profile: GraphProfile) -> list[BackwardNeed]:
    """Per autograd node with a recorded apply (``AccumulateGrad`` left out), its :class:`BackwardNeed`:
    :func:`forced_peak`'s backward events, and the floor of every event of the relaxed step
    (remat.client.planning.relaxed_step)."""
    sizes = profile.storage_bytes
    autograd = profile.autograd
    senders = autograd_senders(autograd)
    ancestors = autograd_ancestors(autograd, senders)
    saved: dict[int, set[int]] = {}
    for pk in profile.packs:
        if pk["consumer"] is not None and pk["sid"] is not None:
            saved.setdefault(pk["consumer"], set()).add(pk["sid"])
    kept_grads = set(profile.param_grad_sids)
    param_grads: list[tuple[int, int]] = []  # (sender, sid) of each parameter gradient kept after the step
    for a in autograd:
        sid = (a.get("incoming_sids") or [None])[0]
        if a["type"] == "AccumulateGrad" and sid in kept_grads:
            param_grads += [(s, sid) for s in senders[a["index"]]]
    out = []
    for a in autograd:
        if a["type"] == "AccumulateGrad" or "extra" not in a:
            continue
        i = a["index"]
        incoming: dict[Any, int] = {}  # one storage counted once, at its largest view
        for k, (sid, nbytes) in enumerate(zip(a.get("incoming_sids", ()), a.get("incoming_bytes", ()),
                                              strict=False)):
            key = ("slot", k) if sid is None else sid
            incoming[key] = max(incoming.get(key, 0), nbytes)
        params = {sid for s, sid in param_grads if ancestors[i] >> s & 1}
        own = saved.get(i, set())
        need = (sum(sizes[sid] for sid in own) + sum(incoming.values()) + a["extra"]
                + sum(sizes[sid] for sid in params))
        sids = frozenset(own | params | {k for k in incoming if isinstance(k, int)})
        out.append(BackwardNeed(index=i, bytes=need, sids=sids, where=f"backward of {a['type']} #{i} ({a['fx']})"))
    return out


def autograd_senders(autograd: Sequence[AutogradRecord]) -> list[list[int]]:
    """Per autograd node, the nodes that send it a gradient."""
    senders: list[list[int]] = [[] for _ in autograd]
    for a in autograd:
        for t, _ in a.get("next", ()):
            if t >= 0:
                senders[t].append(a["index"])
    return senders


def autograd_ancestors(autograd: Sequence[AutogradRecord], senders: Sequence[Sequence[int]]) -> list[int]:
    """Per autograd node, the nodes that must run before it (those whose gradients reach it), as a bitset."""
    waiting = [len(s) for s in senders]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    out = [0] * len(autograd)
    while ready:
        i = ready.pop()
        for s in senders[i]:
            out[i] |= out[s] | (1 << s)
        for t, _ in autograd[i].get("next", ()):
            if t >= 0:
                waiting[t] -= 1
                if waiting[t] == 0:
                    ready.append(t)
    return out


# --- plan search under the predictor ---------------------------------------------------------------------


@dataclass(slots=True)
class SearchResult:
    """The best dropped set found, its prediction, and how it was found."""

    dropped: list[int]
    prediction: Prediction
    evaluated: int
    source: str
    trail: list[tuple[str, int]] = field(default_factory=list)
    """(step, predicted peak) of every improvement, in order."""


def saved_weights(profile: GraphProfile, vertex_nodes: Sequence[Sequence[str]]) -> list[int]:
    """Per vertex, the bytes of its storages that autograd saves for some node's backward.

    What keeping a vertex really costs in a step: a storage nobody packs is freed in forward whether its
    vertex is kept or not (a BatchNorm output read by an in-place ReLU is packed, a convolution output read by
    BatchNorm is packed as BN's input, an addition's output read by a convolution is packed by the conv).
    """
    packed = {p["sid"] for p in profile.packs if p["sid"] is not None}
    nodes = {rec["name"]: rec for rec in profile.nodes}
    sizes = profile.storage_bytes
    out = []
    for names in vertex_nodes:
        out.append(sum(sizes[s] for name in names if name in nodes for s in nodes[name]["births"] if s in packed))
    return out


def _rank(p: Prediction) -> tuple[int, int]:
    """What the search minimises: the peak, then how many events reach it (ties between identical blocks)."""
    return p.peak, p.peaks


def call_groups(dropped: Sequence[int], succ: Sequence[set[int]]) -> list[list[int]]:
    """The connected groups of ``dropped`` over the graph's edges, each sorted (each one checkpointed call).
    ``succ`` lists each vertex's successors, or its predecessors (``OpGraph.groups``): the groups are the same."""
    drop = set(dropped)
    parent = {v: v for v in drop}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for u in drop:
        for w in succ[u]:
            if w in drop:
                parent[find(u)] = find(w)
    out: dict[int, list[int]] = {}
    for v in sorted(drop):
        out.setdefault(find(v), []).append(v)
    return sorted(out.values())


def group_cuts(group: Sequence[int], succ: Sequence[set[int]]) -> list[frozenset[int]]:
    """The vertex sets whose keeping splits ``group`` at each position of its topological order: the group's
    vertices up to that position read by one after it (a DenseNet block's features up to a layer, a ResNet
    block's input). One call becomes two, each re-run on its own."""
    members = set(group)
    out: list[frozenset[int]] = []
    for t in group[:-1]:
        cut = frozenset(u for u in group if u <= t and any(w in members and w > t for w in succ[u]))
        if cut and len(cut) < len(group) and cut not in out:
            out.append(cut)
    return out


def search_plan(profile: GraphProfile, weights: Sequence[int], edges: Sequence[tuple[int, int]],
                units_of: Any, *, vertex_nodes: Sequence[Sequence[str]] | None = None, bounds_per_variant: int = 48,
                seeds: Sequence[tuple[str, Sequence[int]]] = (), starts: int = 3,
                kicks: int = 3, max_evaluations: int = 2000) -> SearchResult:
    """A dropped set of least predicted peak: acg's plans over its bounds M and the ``seeds``, judged by the
    predictor, then a local search from the best few while the predicted peak falls.

    Why not acg's own answer: its classic objective charges every kept vertex's output bytes for the whole
    step, while autograd keeps only what it saves and backward frees it as it passes; the plan of least classic
    cost is rarely the plan of least real peak. acg's Solve(·, M) is still a good family of valid plans (every
    component re-run from one entry to one exit), one per bound M, for both the output-size weights and the
    saved-bytes weights (:func:`saved_weights`); the predictor picks among them and the ``seeds`` (the chain
    planners' plans as dropped sets: the result is never predicted above the best of them). The local
    search moves from each of the ``starts`` best distinct plans by the steepest of: toggling one vertex that
    owns a storage alive at the peak, or keeping the cut that splits the call owning one (:func:`group_cuts`:
    the single-vertex moves cannot split a dense block's call, whose every feature is read further on); with no
    such move left, one sweep toggling every vertex, then a few uphill moves each followed by a
    descent. Plans rank by peak, then by how many events reach it (:func:`_rank`), so lowering one of several
    identical blocks counts. Every candidate the executor refuses
    (``PlanError``) is skipped. Several starts, because the best start is often a chain plan whose
    neighbourhood holds nothing better while an acg plan a little above it descends far below.

    Deterministic: bounded by the number of plans predicted (``max_evaluations``, shared evenly by the
    starts), never by a clock, so a cached plan does not depend on how busy the machine was.

    Args:
        profile: ``profile_graph``'s record.
        weights, edges: the op graph (``graph.weights``, ``graph.edges``).
        units_of: ``dropped -> units`` (``functools.partial(executor_units, graph)``); raises ``PlanError``
            for a dropped set the executor refuses.
        vertex_nodes: ``graph.vertex_nodes``, for the saved-bytes weights and the local search.
        bounds_per_variant: bounds M tried per weight variant (spread evenly over acg's candidate bounds).
        seeds: (label, dropped set) pairs judged beside acg's plans, before the local search.
        starts: how many of the best plans found so far the local search starts from.
        kicks: at a local minimum, how many of the least-bad moves are descended from (see
            ``_LocalSearch.descend``).
        max_evaluations: plans predicted in all, acg's family and the seeds included.
    """
    judge = _Judge(profile, units_of, max_evaluations)
    judge.cache[()] = predict_graph_peak(profile, units_of([]))
    candidates: dict[tuple[int, ...], str] = {(): "no checkpointing"}
    variants = [("output bytes", list(weights))]
    if vertex_nodes is not None:
        variants.append(("saved bytes", saved_weights(profile, vertex_nodes)))
    succ: list[set[int]] = []
    for label, w in variants:
        succ, family = _acg_family(w, edges, len(weights), bounds_per_variant)
        for bound, key in family:
            if judge(key) is not None:
                candidates.setdefault(key, f"acg on {label}, M={bound}")
    for label, dropped in seeds:
        key = tuple(sorted(dropped))
        if judge(key) is not None:
            candidates.setdefault(key, label)
    local = _LocalSearch(profile, units_of, judge, succ, len(weights), _born_vertex(profile, vertex_nodes))
    return _descend_from_starts(local, candidates, starts, kicks, max_evaluations)


class _Judge:
    """The search's predictions, one per distinct dropped set, and its budget.

    Every plan the search predicts goes through here, so :attr:`count` is the count ``max_evaluations``
    bounds (a refused plan counts too: it was tried) and no plan is predicted twice. Past ``limit`` a plan not
    yet known is not predicted (None, like a refused one): the search ends by count, never by a clock.

    A plan asked for with ``above`` may be replayed only until its peak passes that: then only that bound is
    kept (``bounds``), and it is replayed again, uncounted, if a later question needs more of it (NOTE [ replays
    stopped above the running ]).
    """

    __slots__ = ("bounds", "cache", "limit", "profile", "units_of")

    def __init__(self, profile: GraphProfile, units_of: Any, limit: int) -> None:
        self.profile = profile
        self.units_of = units_of
        self.limit = limit
        self.cache: dict[tuple[int, ...], Prediction | None] = {}
        """Plans predicted to the end (None: the executor refused it)."""
        self.bounds: dict[tuple[int, ...], int] = {}
        """Plans whose replay stopped: bytes their peak is known to reach."""

    @property
    def count(self) -> int:
        """Distinct plans judged so far, whole or stopped."""
        return len(self.cache) + len(self.bounds)

    def __call__(self, dropped: Sequence[int], above: float = _INF) -> Prediction | None:
        """The prediction of ``dropped``; None when the executor refuses it, the budget is spent, or (with
        ``above``) its peak is above ``above`` bytes."""
        key = tuple(sorted(dropped))
        if key in self.cache:
            return self.cache[key]
        bound = self.bounds.get(key)
        if bound is None and self.count >= self.limit:
            return None
        if bound is not None and bound > above:
            return None
        try:
            units = self.units_of(list(key))
        except PlanError:
            self.cache[key] = None
            return None
        try:
            prediction = _simulate(self.profile, units, -1, above)
        except _AbovePeak as stopped:
            self.bounds[key] = stopped.level
            return None
        self.bounds.pop(key, None)
        self.cache[key] = prediction
        return prediction

    def known(self, key: tuple[int, ...]) -> Prediction:
        """The prediction of a plan already judged valid (a candidate, or a move the search took)."""
        p = self.cache[key]
        assert p is not None
        return p


# NOTE [ replays stopped above the running ] A descent step looks at every move's rank for three things only:
# the best move, whether any move beats the plan it stands on, and the ``kicks`` least-bad moves (the uphill
# tries at a minimum). So of a neighbourhood's moves only the ``keep = max(1, kicks)`` best need their exact
# rank. While moves are judged in order, a move whose replay passes the peak of the ``keep``-th best rank found so
# far cannot be among the ``keep`` best at the end (its peak is higher, so its rank is worse, and that rank only
# falls as more moves are judged); if ``keep`` moves already rank below it, some move beats the plan whenever
# it would. Its replay stops there (``_Ledger.stop_above``) and the move is left out of the judged list: the
# descent takes the same steps as with every move replayed to the end, and the count of plans judged (the
# budget) is the same. A stopped plan asked about again with a higher bar is replayed again, uncounted. On
# ResNet-152 at 2×32², about half of the moves' replay events were never needed.


def _acg_family(weights: Sequence[int], edges: Sequence[tuple[int, int]], n: int,
                bounds_per_variant: int) -> tuple[list[set[int]], list[tuple[int, tuple[int, ...]]]]:
    """The graph's successor sets, and acg's plans for ``weights``: (bound M, dropped set over vertices
    ``0..n-1``) for up to ``bounds_per_variant`` bounds spread evenly over acg's candidate bounds, then acg's
    own classic optimum. The source and the sink are always kept. Why a spread: neighbouring bounds mostly give
    the same plan, and the predictor, not the classic cost, judges them."""
    from remat.client.planning.planners.acg import Search, build_tree, check_graph

    succ, pred = check_graph(weights, edges)
    tree = build_tree(weights, succ, pred, 14)
    search = Search(tree)
    total = tree.totals[0] if tree.nodes else 0
    found: set[int] = {0, total}
    for node in tree.nodes:
        node.candidates(0, total + 1, found)
    found.update(tree.totals)
    bounds = sorted(found)
    if len(bounds) > bounds_per_variant:
        step = (len(bounds) - 1) / (bounds_per_variant - 1)
        bounds = sorted({bounds[round(i * step)] for i in range(bounds_per_variant)})
    bounds.append(search.run())  # acg's own (classic) optimum
    family = []
    for bound in bounds:
        kept = set(search.kept(bound)) | {0, n - 1}
        family.append((bound, tuple(v for v in range(n) if v not in kept)))
    return succ, family


def _born_vertex(profile: GraphProfile, vertex_nodes: Sequence[Sequence[str]] | None) -> dict[int, int]:
    """The vertex whose nodes created each storage (sid): the local search moves the vertices that own what is
    alive at the peak. Empty without ``vertex_nodes``."""
    born_vertex: dict[int, int] = {}
    if vertex_nodes is not None:
        births = {rec["name"]: rec["births"] for rec in profile.nodes}
        for v, names in enumerate(vertex_nodes):
            for name in names:
                for sid in births.get(name, ()):
                    born_vertex[sid] = v
    return born_vertex


_Judged = tuple[tuple[int, int], tuple[int, ...], str]
"""A judged move: (its plan's rank, its plan, a label for the trail)."""


class _LocalSearch:
    """The descent from one plan under the judge's budget: its neighbourhood (moves that touch what is alive at
    the peak, else a sweep of every vertex), the steepest improving move, and uphill kicks at a minimum."""

    __slots__ = ("born_vertex", "judge", "n", "profile", "succ", "units_of")

    def __init__(self, profile: GraphProfile, units_of: Any, judge: _Judge, succ: Sequence[set[int]], n: int,
                 born_vertex: Mapping[int, int]) -> None:
        self.profile = profile
        self.units_of = units_of
        self.judge = judge
        self.succ = succ
        self.n = n
        self.born_vertex = born_vertex

    def descend(self, key: tuple[int, ...], kicks: int) -> tuple[tuple[int, ...], list[tuple[str, int]]]:
        """Steepest descent from ``key``; at a local minimum, each of the ``kicks`` least-bad moves is taken
        anyway and descended from (without kicks of its own), and the first that ends lower is continued.
        Why: two near-equal peaks (a dense block's re-run and the next transition's backward) make every
        single move that lowers one raise the other a little; the way down passes over that ridge."""
        judge = self.judge
        best = judge.known(key)
        trail: list[tuple[str, int]] = []
        swept = False
        keep = max(1, kicks)
        while judge.count < judge.limit:
            ranks: list[tuple[int, int]] = []
            judged = self.judge_moves(key, self.moves(key), keep, ranks)
            if not swept and not any(r < _rank(best) for r, _, _ in judged):
                swept = True  # nothing at the peak helps: one sweep of every vertex
                judged += self.sweep(key, keep, ranks)
            judged.sort()
            if judged and judged[0][0] < _rank(best):
                key = judged[0][1]
                trail.append((f"local: {judged[0][2]}", judge.known(key).peak))
            else:
                uphill = self.over_the_ridge(judged[:kicks], best)
                if uphill is None:
                    break
                key, steps = uphill
                trail += steps
            best = judge.known(key)
        return key, trail

    def at_peak(self, key: tuple[int, ...]) -> set[int]:
        """The vertices (source and sink left out) that own a storage alive at ``key``'s peak, a re-run's copy
        included: only moving one of them can lower that peak. Predicted afresh with capture, outside the
        judge's count."""
        live = predict_graph_peak(self.profile, self.units_of(list(key)), capture=True).live or {}
        relevant: set[int] = set()
        for held in live:
            sid = held[2] if isinstance(held, tuple) and held[0] == "r" else held
            if isinstance(sid, int) and sid in self.born_vertex:
                relevant.add(self.born_vertex[sid])
        return relevant - {0, self.n - 1}

    def moves(self, key: tuple[int, ...]) -> list[tuple[str, frozenset[int]]]:
        """The neighbourhood of ``key``: toggle one vertex at the peak, or keep a cut of a call holding one."""
        relevant = self.at_peak(key)
        moves: list[tuple[str, frozenset[int]]] = [(f"toggle {v}", frozenset({v})) for v in sorted(relevant)]
        for group in call_groups(key, self.succ):
            if relevant.intersection(group):
                moves += [(f"keep cut {sorted(cut)}", cut) for cut in group_cuts(group, self.succ)]
        return moves

    def judge_moves(self, key: tuple[int, ...], moves: Sequence[tuple[str, frozenset[int]]], keep: int,
                    ranks: list[tuple[int, int]]) -> list[_Judged]:
        """The moves from ``key`` that may be among the ``keep`` best of those judged with ``ranks`` (the
        ranks found so far, kept sorted), judged in the moves' order; the executor and the budget allow."""
        return self._judge_all(((label, tuple(sorted(set(key) ^ move))) for label, move in moves), keep, ranks)

    def sweep(self, key: tuple[int, ...], keep: int, ranks: list[tuple[int, int]]) -> list[_Judged]:
        """Toggling each vertex but the source and sink, judged as :meth:`judge_moves`: the wider
        neighbourhood, once per descent, when nothing at the peak helps."""
        return self._judge_all(((f"sweep: toggle {v}", tuple(sorted(set(key) ^ {v}))) for v in range(1, self.n - 1)),
                               keep, ranks)

    def _judge_all(self, cands: Iterable[tuple[str, tuple[int, ...]]], keep: int,
                   ranks: list[tuple[int, int]]) -> list[_Judged]:
        """Each candidate judged with its replay stopped above the ``keep``-th best peak so far: those left out
        cannot be among the ``keep`` best (NOTE [ replays stopped above the running ])."""
        judged: list[_Judged] = []
        for label, cand in cands:
            p = self.judge(cand, ranks[keep - 1][0] if len(ranks) >= keep else _INF)
            if p is not None:
                rank = _rank(p)
                bisect.insort(ranks, rank)
                judged.append((rank, cand, label))
        return judged

    def over_the_ridge(self, kicks: Sequence[_Judged],
                       best: Prediction) -> tuple[tuple[int, ...], list[tuple[str, int]]] | None:
        """At a local minimum ranked ``best``: the first of the least-bad moves ``kicks`` whose own descent
        ends below it, as (where it ends, the trail there), or None (the descent stops)."""
        judge = self.judge
        for _, cand, label in kicks:
            end, steps = self.descend(cand, 0)
            if _rank(judge.known(end)) < _rank(best):
                return end, [(f"local: {label} (uphill)", judge.known(cand).peak), *steps]
        return None


def _descend_from_starts(local: _LocalSearch, candidates: Mapping[tuple[int, ...], str], starts: int, kicks: int,
                         max_evaluations: int) -> SearchResult:
    """The local search from each of the ``starts`` best candidates in turn, each given an even share of the
    evaluations left (its own plus what earlier ones left over), keeping the best end. Why several: the best
    start's neighbourhood often holds nothing better while a start a little above it descends far below."""
    judge = local.judge
    ranked = sorted(candidates, key=lambda k: (_rank(judge.known(k)), k))
    chosen = ranked[0]
    trail = [(candidates[chosen], judge.known(chosen).peak)]
    source = candidates[chosen]
    spent = judge.count
    chosen_starts = ranked[:max(1, starts)]
    for i, start in enumerate(chosen_starts):
        judge.limit = spent + (max_evaluations - spent) * (i + 1) // len(chosen_starts)
        end, steps = local.descend(start, kicks)
        if _rank(judge.known(end)) < _rank(judge.known(chosen)):
            chosen, source = end, candidates[start] + (" + local search" if steps else "")
            trail = [(candidates[start], judge.known(start).peak), *steps]
    return SearchResult(dropped=list(chosen), prediction=judge.known(chosen), evaluated=judge.count,
                        source=source, trail=trail)
