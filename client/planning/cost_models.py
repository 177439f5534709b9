"""Cost models: the peak activation memory a checkpoint plan is predicted to reach.

Two models, each a pure function ``peak(trace, checkpoints) -> bytes``:

- ``classic`` — Chen et al. / Feng & Huang / Hong et al.'s first formulation (docs/cost-model.md §1): all
  checkpoints alive at once plus the largest re-forwarded segment interior.
- ``pytorch`` — what the PyTorch caching allocator really holds when every segment but the last runs under
  ``torch.utils.checkpoint(use_reentrant=False)``. Every term and the reasoning for it is in
  docs/cost-model.md; the NOTE blocks below name the term each line implements.

Both have the shape ``max over segments k of (Pre_k + local(start_k, end_k))`` where Pre_k only sums the
outputs of earlier checkpoints. The planners rely on that shape, and use :class:`PytorchTables` so that the
model is defined in exactly one place.

This module imports neither torch nor anything heavy: planning from a trace file must start fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from remat.client.plan import COST_MODELS, validate_checkpoints
from remat.client.trace import Trace

CostFn = Callable[[Trace, Sequence[int]], int]


def _bounds(trace: Trace, checkpoints: Sequence[int]) -> tuple[int, ...]:
    n = trace.num_stages
    return (0, *validate_checkpoints(checkpoints, n), n)


def classic_peak(trace: Trace, checkpoints: Sequence[int]) -> int:
    """classic(C) = Σ_{c∈C} d_c + max_k Σ_{c_{k-1} < l < c_k} d_l  (input and final output left out)."""
    d = trace.column("output_bytes")
    prefix = [0, *accumulate(d)]
    bounds = _bounds(trace, checkpoints)
    kept = sum(d[c - 1] for c in bounds[1:-1])
    interior = max(prefix[b - 1] - prefix[a] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    return trace.side_bytes + kept + max(interior, 0)


class SideLifetimes:
    """How long each side value lives in backward under a plan (trace metadata ``side_values``; NOTE [side value
    lifetimes]); empty for a trace that gives only the per-stage sums.

    NOTE [side value lifetimes] The executor (``StageChain.run``) hands every checkpointed segment the side
    values made before it (``dict(env)``), and non-reentrant checkpoint keeps its arguments in the segment's
    frame until the last of the segment's saved tensors is released in backward. So a side value v made by
    stage m lives, in backward,
    - in the last segment (a, n], at stage s: while a frame holds it (a segment with a frame started at or
      after m: the latest such start p ≥ m) or a stage of the last segment that saves it has not run its
      backward yet (a saver r with a < r ≤ s);
    - in a checkpointed segment (a, b], at stage s: its original when m ≤ a (this segment's own frame);
      otherwise the recompute's copy, which a saver r in [m, s] keeps until its backward;
    - during a re-run and in forward: every side value made before the stage (the originals, and the re-run's
      copies, which its stages' environment keeps until the re-run stops).
    Its gradient, when a later stage's backward sends one (``grad_from``), lives from the last such stage's
    backward to its maker's, whatever the plan: ``gradients[s]`` sums those alive while stage s runs its
    backward (for s = the last sender it is inside that stage's own measured peak).
    Measured on a two-block T5 (benchmarks/side_values.py; tests/worker/test_several_inputs.py): of 54 plans,
    every one whose peak the side values decide is priced to the byte (docs/cost-model.md, "Side values").
    """

    __slots__ = ("values", "gradients", "before", "unsaved_before")

    def __init__(self, trace: Trace) -> None:
        n = trace.num_stages
        self.values = trace.side_values
        # before[s]: side values made by stages 1..s (what the tables price as resident); unsaved_before[s]: the
        # part of it no stage saves.
        self.before = list(accumulate(trace.side_by_stage, initial=0))
        self.unsaved_before = list(accumulate(trace.side_unsaved_by_stage, initial=0))
        self.gradients = [0] * (n + 1)
        for v in self.values:
            if v.grad_bytes:
                for s in range(v.stage, max(v.grad_from)):
                    self.gradients[s] += v.grad_bytes

    def last_segment(self, a: int, s: int, p: int) -> int:
        """Side bytes alive at stage s's backward in the last segment (a, n]; p: the latest start of a
        checkpointed segment with a frame (-1 when none)."""
        return sum(v.bytes for v in self.values
                   if v.stage < s and (p >= v.stage or any(a < r <= s for r in v.saved_by)))

    def checkpointed(self, a: int, s: int) -> int:
        """Side bytes alive at stage s's backward in a checkpointed segment that starts at a."""
        return sum(v.bytes for v in self.values
                   if v.stage < s and (v.stage <= a or any(v.stage <= r <= s for r in v.saved_by)))


class PytorchTables:
    """Per-stage arrays of the ``pytorch`` cost model, 1-indexed (index 0 is the network input).

    NOTE [pytorch cost model terms] — see docs/cost-model.md §2 for the derivation. With x_t the output of
    stage t, d_t its bytes, and a segment (a, b] = stages a+1..b:

    - ``u[t]`` — bytes stage t leaves alive for backward: its interior saved tensors e_t plus x_t when any
      stage saves it (stage t as output, or stage t+1 as input). Counting x_t here, once, is the
      storage-level de-duplication between neighbouring stages.
    - ``U[t]`` — prefix sums of u; the bytes saved by stages a+1..s-1 are U[s-1] - U[a].
    - ``back[s]``/``back_ck[s]`` — backward candidate of stage s (``back_ck`` in a checkpointed segment, from
      the recomputed backward peak B°_s when profiled), before subtracting U[a]: everything saved by earlier
      stages of its segment, plus the stage's own backward footprint (its backward peak B_s, never below
      its own saved tensors + its output gradient; an unprofiled stage, B_s = 0, is charged those plus all
      its new parameter gradients at once), plus the parameter gradients of all later stages (born
      earlier in backward, still alive). A profiled B_s is not raised by G_s: inside a multi-op stage the
      saved tensors are freed while the gradients are born, so "own + d_s + G_s" is never all alive at
      once (DenseNet-121's dense blocks: +9.4% with that floor, 0.00% without; docs/cost-model.md,
      Calibration).
    - ``rec[s]``/``rec_first[s]`` — recompute candidate of stage s inside a checkpointed segment: saved by
      earlier stages of the segment, the stage's input if nobody saves it (not for the segment's first
      stage, whose input is the checkpoint), and the stage's forward peak F_s (never below its saved
      tensors + output). ``rec_last``/``rec_last_first`` use the peak up to the last saved tensor F'_s:
      the non-reentrant checkpoint stops recomputing there.
    - ``delta[b]`` — what a checkpointed segment ending at b adds to every recompute candidate: the gradient
      of its output x_b (alive through the whole re-run) and the parameter gradients of stages after b.
    - ``drop_input[a]`` — the last segment is not checkpointed, so its input x_a stays alive only if its
      first stage saves it.
    - ``frameless_end[a]`` — the largest b such that stages a+1..b all save nothing (a when stage a+1 saves
      something). A checkpointed segment (a, b] with b ≤ frameless_end[a] is *frameless*: no checkpoint frame
      outlives its forward, so x_a is not kept, nothing is recomputed, and only its backward and forward
      candidates count (``local_frameless``).
    - ``fwd_first[s]``, ``fwd_mid[s]``, ``fwd_last_first[s]``, ``fwd_tail[s]`` — forward candidates
      (docs/cost-model.md §2, "The forward"): stage s running forward as the first stage of a checkpointed
      segment (its input is the kept checkpoint; the stage keeps none of its saved tensors, so F°), as a
      later stage of one (its input alive beside it), as the first stage of the last segment (saved tensors
      kept: F), and as a later stage of the last segment (before ``- U[a] - drop_input[a] +
      cast_saved[a]``). Each carries the autocast cast cache of the stages before s: every copy made by a
      checkpointed stage (its saved tensors are dropped, the cache still holds the copy) and, in the last
      segment, the copies no stage saves. Without autocast they reduce to the stage's forward peak plus
      what is provably alive, and never exceed the recompute candidates of a checkpointed segment.
    - side values (``trace.side_by_stage``: masks, position biases, an encoder's output read by every decoder
      block) are alive from the stage that makes them to the end of backward, held by the stages that save
      them or by the checkpointed segments that take them as an input, and gone before: every candidate of
      stage s includes, once, those made before s (its own are in its measured peaks). Those no stage saves
      (``trace.side_unsaved_by_stage``) are gone in the last segment's backward unless made before it starts
      (then the checkpointed segments before it hold them): ``back`` leaves them out, ``drop_input[a]`` adds
      those made by stage a back (docs/cost-model.md, "Side values").
    - side values' lifetimes in backward depend on the plan (:class:`SideLifetimes`): the tables price them as
      above, which is never below what the plan really holds, so the planners minimise an upper bound there;
      :func:`pytorch_peak` prices each plan exactly. Their gradients (``sg[s]``: alive from the first backward
      that sends one to the maker's) do not depend on the plan and are in ``back``, ``back_ck`` and ``delta``.
    """

    __slots__ = ("n", "d", "U", "back", "back_ck", "rec", "rec_first", "rec_last", "rec_last_first", "delta",
                 "drop_input", "frameless_end", "fwd_first", "fwd_last_first", "fwd_mid", "fwd_tail", "cast_saved",
                 "sides")

    def __init__(self, trace: Trace) -> None:
        stages = trace.stages
        n = len(stages)
        self.n = n
        d = [0, *(s.output_bytes for s in stages)]
        saved_by_next = [stages[t].saves_input for t in range(1, n)] + [False]
        sigma = [False] + [s.saves_output or nxt for s, nxt in zip(stages, saved_by_next, strict=True)]
        u = [0] + [s.saved_bytes + (s.output_bytes if sig else 0) for s, sig in zip(stages, sigma[1:],
                                                                                       strict=True)]
        U = list(accumulate(u))
        grad_suffix = list(accumulate((s.param_grad_bytes for s in reversed(stages)), initial=0))[::-1]
        # grad_suffix[t] = Σ_{j>t} G_j for t = 0..n (stages are 1-indexed, list index t ↔ stages[t:]).
        self.d = d
        self.U = U
        self.back = [0] * (n + 1)
        self.back_ck = [0] * (n + 1)
        self.rec = [0] * (n + 1)
        self.rec_first = [0] * (n + 1)
        self.rec_last = [0] * (n + 1)
        self.rec_last_first = [0] * (n + 1)
        self.delta = [0] * (n + 1)
        self.drop_input = [0] * (n + 1)
        cast = list(accumulate((s.cast_bytes for s in stages), initial=0))  # CW[t] = Σ_{j≤t} W_j
        cast_unsaved = list(accumulate((s.cast_unsaved_bytes for s in stages), initial=0))
        self.cast_saved = [c - cu for c, cu in zip(cast, cast_unsaved, strict=True)]
        self.fwd_first = [0] * (n + 1)
        self.fwd_last_first = [0] * (n + 1)
        self.fwd_mid = [0] * (n + 1)
        self.fwd_tail = [0] * (n + 1)
        # side_before[s]: side values made before stage s, alive in its every candidate (NOTE above).
        self.sides = SideLifetimes(trace)
        side_before, unsaved_before, sg = self.sides.before, self.sides.unsaved_before, self.sides.gradients
        for s in range(1, n + 1):
            st = stages[s - 1]
            side = side_before[s - 1]
            saved_side = side - unsaved_before[s - 1]
            own = st.saved_bytes + (st.output_bytes if st.saves_output else 0)
            unsaved_input = d[s - 1] if not sigma[s - 1] else 0
            fwd = max(st.forward_peak_bytes, own + (0 if st.saves_output else st.output_bytes))
            fwd_last = max(st.recompute_peak_bytes, own)
            if st.backward_peak_bytes:
                bwd = max(st.backward_peak_bytes, own + st.output_bytes)
            else:
                bwd = own + st.output_bytes + st.param_grad_bytes
            # The last segment's backward: its unsaved side values die with the forward (no checkpoint frame
            # holds them); those made before it come back through drop_input[a] below.
            self.back[s] = saved_side + sg[s] + U[s - 1] + bwd + grad_suffix[s]
            # Recomputed stages drop their saved tensors earlier in backward: B° when profiled.
            rb = st.recomputed_backward_peak_bytes
            self.back_ck[s] = (side + sg[s] + U[s - 1] + (max(rb, own + st.output_bytes) if rb else bwd)
                               + grad_suffix[s])
            self.rec_first[s] = side + U[s - 1] + fwd
            self.rec[s] = self.rec_first[s] + unsaved_input
            self.rec_last_first[s] = side + U[s - 1] + fwd_last
            self.rec_last[s] = self.rec_last_first[s] + unsaved_input
            self.delta[s] = st.output_bytes + grad_suffix[s] + sg[s]  # a re-run at s's backward: sg[s] alive
            # A checkpointed stage's first forward keeps none of its saved tensors: F° when profiled.
            fwd_dropped = max(st.forward_peak_dropped_bytes, st.output_bytes) if st.forward_peak_dropped_bytes else fwd
            self.fwd_first[s] = side + cast[s - 1] + fwd_dropped
            self.fwd_mid[s] = side + cast[s - 1] + d[s - 1] + fwd_dropped
            self.fwd_last_first[s] = side + cast[s - 1] + fwd
            self.fwd_tail[s] = side + U[s - 1] + cast_unsaved[s - 1] + unsaved_input + fwd
        for a in range(1, n):
            self.drop_input[a] = 0 if stages[a].saves_input else d[a]
        # Side values no stage saves are held in the last segment's backward by the checkpointed segments before
        # it, when they were made before it starts (a segment's frame keeps what it was handed to the end of
        # backward): back[] leaves them out, drop_input[a] adds those made by stage a back. The forward tail adds
        # cast_saved[a] after subtracting drop_input[a]: the same amount keeps its forward candidates as they were.
        for a in range(n):
            self.drop_input[a] -= unsaved_before[a]
            self.cast_saved[a] -= unsaved_before[a]
        self.frameless_end = list(range(n + 1))
        for a in range(n - 1, -1, -1):
            if stages[a].saves_nothing:
                self.frameless_end[a] = self.frameless_end[a + 1]

    def local(self, a: int, b: int) -> int:
        """local(a, b): the peak of segment (a, b] minus the checkpoints kept before it. O(b - a)."""
        peak = max(self.back[a + 1:b + 1]) - self.U[a]
        if b == self.n:
            peak -= self.drop_input[a]
            forward = self.fwd_last_first[a + 1]
            if b > a + 1:
                forward = max(forward, max(self.fwd_tail[a + 2:b + 1]) - self.U[a] - self.drop_input[a]
                              + self.cast_saved[a])
            return max(peak, forward)
        peak = max(self.back_ck[a + 1:b + 1]) - self.U[a]
        forward = max(self.fwd_first[a + 1], max(self.fwd_mid[a + 2:b + 1], default=0))
        if b == a + 1:
            rec = self.rec_last_first[b]
        else:
            rec = max(self.rec_first[a + 1], self.rec_last[b], max(self.rec[a + 2:b], default=0))
        return max(peak, rec + self.delta[b] - self.U[a], forward)

    def is_frameless(self, a: int, b: int) -> bool:
        """True when (a, b] is a checkpointed segment whose stages save nothing (NOTE above)."""
        return b < self.n and b <= self.frameless_end[a]

    def local_frameless(self, a: int, b: int) -> int:
        """local of a frameless segment, whose input x_a is not among the kept checkpoints.

        Backward candidates, and forward candidates that count x_a only while stage a+1 runs: the frame
        really holds x_a until the segment's forward ends, but charging it for the later stages too would
        tie each frameless segment's value to its own start and rule out the planners' one-step recurrence
        over frameless runs. Frameless stages are views, permutes and concatenations whose forward is
        rarely a step's peak; docs/cost-model.md lists this as a known under-estimate.
        """
        return max(max(self.back_ck[a + 1:b + 1]) - self.U[a], max(self.fwd_mid[a + 1:b + 1]))


def pytorch_peak(trace: Trace, checkpoints: Sequence[int], tables: PytorchTables | None = None) -> int:
    """Peak activation bytes of a training step with the plan applied (docs/cost-model.md).

    Example:
        >>> from remat.client.trace import make_trace
        >>> pytorch_peak(make_trace([4, 4, 4, 4]), [2])
        16
    """
    t = tables if tables is not None else PytorchTables(trace)
    if t.sides.values:  # lifetimes that depend on the plan: priced plan by plan
        return max(b for b, _ in _candidates(trace, t, checkpoints))
    return tables_peak(trace, checkpoints, t)


def tables_peak(trace: Trace, checkpoints: Sequence[int], tables: PytorchTables | None = None) -> int:
    """A plan's peak under the tables the planners minimise (``PytorchTables.local``): :func:`pytorch_peak`
    itself, but for side values whose lifetime depends on the plan, which it prices from above
    (:class:`SideLifetimes`)."""
    t = tables if tables is not None else PytorchTables(trace)
    return segments_peak(trace, checkpoints, t, t.local)


def segments_peak(trace: Trace, checkpoints: Sequence[int], tables: PytorchTables,
                  local: Callable[[int, int], int]) -> int:
    """max over the plan's segments (a, b] of the checkpoints kept before them plus ``local(a, b)`` (above
    them, x_a included when the segment keeps it; a frameless segment keeps nothing and is priced by
    ``local_frameless``): the shape every ``pytorch`` price has, one level (``PytorchTables.local``) or nested
    (remat.client.planning.nested)."""
    bounds = _bounds(trace, checkpoints)
    peak = kept = 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if tables.is_frameless(a, b):
            peak = max(peak, kept + tables.local_frameless(a, b))
            continue
        kept += tables.d[a]
        peak = max(peak, kept + local(a, b))
    return peak


def peak_candidates(trace: Trace, checkpoints: Sequence[int]) -> list[tuple[int, str]]:
    """Every candidate of the ``pytorch`` model for a plan, as (bytes, what it is), largest first.

    For diagnosis: which term decides a predicted peak (its maximum is :func:`pytorch_peak`). O(n) per
    segment, so meant for one plan at a time, not inside a planner.
    """
    out = _candidates(trace, PytorchTables(trace), checkpoints)
    out.sort(key=lambda item: -item[0])
    return out


def _candidates(trace: Trace, t: PytorchTables, checkpoints: Sequence[int]) -> list[tuple[int, str]]:
    """The candidates of one plan, the backward ones with the side values the plan really holds
    (:class:`SideLifetimes`) in place of the tables' bound."""
    bounds = _bounds(trace, checkpoints)
    sides = t.sides
    side_before, unsaved_before = sides.before, sides.unsaved_before
    out: list[tuple[int, str]] = []
    kept = 0
    framed = -1  # the latest start of a checkpointed segment with a frame
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        seg = f"segment ({a}, {b}]"
        frameless = t.is_frameless(a, b)
        pre = kept if frameless else kept + t.d[a]
        drop = t.drop_input[a] if b == t.n else 0
        for s in range(a + 1, b + 1):
            back = t.back[s] if b == t.n else t.back_ck[s]
            if sides.values and b == t.n:  # the tables' bound: saved ones made before s, unsaved ones before a
                saved_before = side_before[s - 1] - unsaved_before[s - 1]
                back += sides.last_segment(a, s, framed) - saved_before - unsaved_before[a]
            elif sides.values and not frameless:  # the tables' bound: every one made before s
                back += sides.checkpointed(a, s) - side_before[s - 1]
            out.append((pre + back - t.U[a] - drop, f"backward of stage {s}, {seg}"))
            if frameless:
                out.append((pre + t.fwd_mid[s], f"forward of stage {s}, frameless {seg}"))
            elif s == a + 1:
                first = t.fwd_last_first[s] if b == t.n else t.fwd_first[s]
                out.append((pre + first, f"forward of stage {s}, first of {seg}"))
            elif b == t.n:
                out.append((pre + t.fwd_tail[s] - t.U[a] - drop + t.cast_saved[a], f"forward of stage {s}, {seg}"))
            else:
                out.append((pre + t.fwd_mid[s], f"forward of stage {s}, {seg}"))
            if b < t.n and not frameless:
                if b == a + 1:
                    rec = t.rec_last_first[s]
                elif s == a + 1:
                    rec = t.rec_first[s]
                elif s == b:
                    rec = t.rec_last[s]
                else:
                    rec = t.rec[s]
                out.append((pre + rec + t.delta[b] - t.U[a], f"recompute of stage {s}, {seg}"))
        if not frameless:
            kept += t.d[a]
            if b < t.n:
                framed = a
    return out


COST_FUNCTIONS: dict[str, CostFn] = {"classic": classic_peak, "pytorch": pytorch_peak}
assert set(COST_FUNCTIONS) == set(COST_MODELS)


def peak(trace: Trace, checkpoints: Sequence[int], cost_model: str) -> int:
    """Evaluate one plan under a named cost model."""
    try:
        fn = COST_FUNCTIONS[cost_model]
    except KeyError:
        raise ValueError(f"cost model {cost_model!r} is unknown; choose one of {', '.join(COST_MODELS)}") from None
    return fn(trace, checkpoints)
