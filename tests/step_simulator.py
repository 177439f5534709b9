"""An independent oracle for the ``pytorch`` cost model: one checkpointed training step replayed as events.

Written from docs/cost-model.md's account of what PyTorch does, not from ``PytorchTables``: a ledger of named
live tensors (boundary activations, each stage's saved tensors, gradients) is allocated and freed in the order
a step runs — forward segment by segment, then backward from the last segment to the first, each checkpointed
segment re-run before its stages' backward — and every stage's profiled transient (F, F°, F′, B, B°) is
added on top of the ledger while that stage runs. The peak is the highest of those moments: every tensor is
born inside some stage's window, so the stage's transient is where its birth can set a peak. Nothing here shares
code or arrays with client/planning/cost_models.py, so a wrong index or a dropped term there disagrees with this.

Autocast: a stage's lower-precision parameter copies (W) enter autocast's cast cache at their first use and
stay there until the autocast region exits, after forward and loss; a copy the stage saves is one of its saved
tensors (in e, so counted once), and a recompute's own cache dies with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.client.trace import Stage, Trace


class _Ledger:
    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.peak = 0

    @property
    def level(self) -> int:
        return sum(self.live.values())

    def alloc(self, name: str, nbytes: int) -> None:
        """Book a tensor. Not a peak by itself: every tensor is born inside some stage's forward, recompute or
        backward window, whose profiled transient (observed by the caller) already counts it."""
        assert name not in self.live, name
        self.live[name] = nbytes

    def free(self, name: str) -> None:
        self.live.pop(name, None)

    def observe(self, transient: int = 0) -> None:
        self.peak = max(self.peak, self.level + transient)


def _own(st: Stage) -> int:
    """What stage t keeps for its backward beyond its input: its saved tensors and, if saved, its output."""
    return st.saved_bytes + (st.output_bytes if st.saves_output else 0)


def simulate_peak(trace: Trace, checkpoints: Sequence[int]) -> int:
    """Peak activation bytes of one training step with ``checkpoints`` kept (docs/cost-model.md §2)."""
    stages = trace.stages
    n = len(stages)
    d = [0, *(s.output_bytes for s in stages)]
    bounds = (0, *sorted(checkpoints), n)
    segments = list(zip(bounds[:-1], bounds[1:], strict=True))
    led = _Ledger()

    def st(s: int) -> Stage:
        return stages[s - 1]

    def saved_by_someone(t: int) -> bool:
        """x_t is saved by stage t (as its output) or by stage t+1 (as its input): one storage, kept once."""
        return (t >= 1 and st(t).saves_output) or (t < n and st(t + 1).saves_input)

    def frameless(a: int, b: int) -> bool:
        return b < n and all(st(s).saves_nothing for s in range(a + 1, b + 1))

    def fwd_floor(s: int) -> int:
        x = st(s)
        return max(x.forward_peak_bytes, _own(x) + (0 if x.saves_output else x.output_bytes))

    def fwd_dropped(s: int) -> int:
        x = st(s)
        return max(x.forward_peak_dropped_bytes, x.output_bytes) if x.forward_peak_dropped_bytes else fwd_floor(s)

    def bwd(s: int, recomputed: bool) -> int:
        x = st(s)
        if recomputed and x.recomputed_backward_peak_bytes:
            return max(x.recomputed_backward_peak_bytes, _own(x) + x.output_bytes)
        if x.backward_peak_bytes:
            return max(x.backward_peak_bytes, _own(x) + x.output_bytes)
        return _own(x) + x.output_bytes + x.param_grad_bytes

    def keep_saved(s: int, end: int) -> None:
        """Stage s, recording for autograd in a segment ending at ``end``, keeps its saved tensors, and x_s when
        it saves it or the next stage of the same run does (a recomputed x_b that only the already finished
        stage b+1 saved is not kept)."""
        led.alloc(f"saved{s}", st(s).saved_bytes)
        if st(s).saves_output or (s < end and st(s + 1).saves_input):
            led.alloc(f"kept-x{s}", d[s])

    # ---- forward --------------------------------------------------------------------------------------
    # "x{t}" is a boundary activation alive as a plain value (the next stage's input, or a checkpoint the
    # frame holds); "kept-x{t}" is x_t held because autograd saved it. The input batch x_0 is the baseline.
    for a, b in segments:
        checkpointed = b < n
        for s in range(a + 1, b + 1):
            if checkpointed:
                # The stage keeps none of its saved tensors; its input is alive while it runs. Its cast copies
                # stay in the cache although it drops what it saved.
                led.observe(fwd_dropped(s))
                led.alloc(f"x{s}", d[s])
                led.alloc(f"cast{s}", st(s).cast_bytes)
            else:
                # The last segment records the graph: the stage's saved tensors stay; its input is alive.
                # fwd covers everything the stage makes above the state before it, its own saved set
                # included, so the level before it plus fwd is the candidate; then the saved set stays.
                led.observe(fwd_floor(s))
                keep_saved(s, b)
                led.alloc(f"cast{s}", st(s).cast_unsaved_bytes)  # the saved copies are in saved{s}
                if f"kept-x{s}" not in led.live:
                    led.alloc(f"x{s}", d[s])
            # The stage's input dies now unless something holds it: a checkpoint frame holds x_a (not a
            # frameless one's); autograd holds the last segment's x_a when its first stage saves it.
            if s - 1 == a and not checkpointed and a >= 1 and st(s).saves_input:
                led.alloc(f"kept-x{a}", led.live.pop(f"x{a}"))
            elif s - 1 > a or (s - 1 == a and (frameless(a, b) or not checkpointed)):
                led.free(f"x{s - 1}")
        # x_b is the next segment's input (a plain value) — nothing to do; a checkpointed segment's frame
        # keeps its input x_a beyond this point unless frameless (freed above).
    # The network output x_n and the loss: the output's gradient is born now (d_n), the output itself is
    # held only as saved by the last stage (kept-x{n}); a plain x_n dies with the loss.
    led.free(f"x{n}")
    for s in range(1, n + 1):  # autocast exits before backward: its cache goes
        led.free(f"cast{s}")

    # ---- backward ------------------------------------------------------------------------------------
    for a, b in reversed(segments):
        checkpointed = b < n
        if checkpointed and not frameless(a, b):
            # The segment's output gradient has arrived (it is part of stage b's bwd below, and alive from
            # here on): re-run the segment's forward with autograd, keeping saved tensors.
            led.alloc("grad-out", d[b])
            for s in range(a + 1, b + 1):
                x = st(s)
                unsaved_input = d[s - 1] if (s - 1 > a and not saved_by_someone(s - 1)) else 0
                transient = max(x.recompute_peak_bytes, _own(x)) if s == b else fwd_floor(s)
                led.observe(transient + unsaved_input)
                keep_saved(s, b)
            led.free("grad-out")  # counted inside stage b's bwd from here on
        for s in range(b, a, -1):
            recomputed = checkpointed  # docs/cost-model.md §2 item 4: B° in every checkpointed segment
            # Stage s's backward: its own bytes (saved, output gradient, input gradient, temporaries) are in
            # bwd; stages before it in the segment still hold theirs; later stages' parameter gradients live.
            led.free(f"saved{s}")
            led.free(f"kept-x{s}")
            led.observe(bwd(s, recomputed))
            # Its parameter gradients were born inside that window (B counts them) and stay alive.
            led.alloc(f"pgrad{s}", st(s).param_grad_bytes)
        led.free(f"x{a}")  # the checkpoint (or the last segment's input) is released with its segment
        led.free(f"kept-x{a}")  # x_a as saved by stage a+1 dies with that stage's backward
    return led.peak
