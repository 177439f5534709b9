"""The profiling algorithm shared by the CPU and CUDA profilers: one chained pass, one isolated pass per stage.

What is measured, and why this way, is fixed by the ``remat-trace/1`` field docstrings in
``remat.client.trace.Stage`` and by docs/cost-model.md; the device-specific parts (how live bytes are read,
how time is taken, how a storage's size is booked) come in through a :class:`Backend`.

NOTE [ profiling protocol ] (docs/cost-model.md, "How traces and measurements are made", says it in prose)

1. *Chained forward* (grad enabled, a pack hook on every saved tensor): stages run one after the other on
   the real input, so the tensor that stage i saves as its output and stage i+1 saves as its input have the
   same storage and are recognised as one. From it: d_i, the saved storages of each stage (keyed by storage;
   parameters, buffers and anything not born in the pass excluded), saves_input/saves_output, and e_i (the
   stage's distinct saved bytes without its input and output storages).
2. *Isolated pass per stage* on a detached copy of its chained input (``requires_grad`` as in the chain):
   F_i = forward peak above the state before the stage; F'_i = the peak up to the stage's last pack event
   (parameters included, because the non-reentrant checkpoint counts them when it decides to stop its
   recompute); B_i = peak of the stage's backward above the state before its forward, so the stage's
   saved tensors, its output gradient, its input gradient, parameter gradients born in it and temporaries
   are in and its input is out. The backward is started as ``(y * ones).sum().backward()`` so that the
   engine alone owns the output-gradient buffer and frees it when the stage's first node has consumed it,
   as it does in a real step; ``y.backward(g)`` would keep ``g`` alive throughout (one output's bytes too
   many: about +3.6% on ResNet-50, measured). A stage that hands side values to later stages starts its
   backward from their gradients too (NOTE [ seeding a stage's exports ] in export_seeds.py).
3. G_i (``grads="none"``): bytes of the parameter gradients whose parameter got its first gradient in stage
   i, walking stages in backward order so that a parameter shared by two stages is booked once, in the
   later stage (its gradient is born there). Under ``grads="kept"`` every gradient exists before the step,
   G_i = 0, and the accumulation transient ends up in B_i.
4. Times come from a separate unmetered run of the same isolated pass (the meter slows every op).

The model's parameters, buffers, gradients, train/eval flag and the global RNG are restored afterwards.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from remat.client.devices import unavailable_reason
from remat.client.errors import ModelError
from remat.client.graph.write_probe import preserved_state
from remat.client.model_output import output_tensors, training_outputs
from remat.client.precision import autocast_context, autocast_dtype, normalize_precision, precision_of_call
from remat.client.trace import GRAD_CONVENTIONS, TRACE_FORMAT, Trace, parse_trace
from remat.worker.memory_meter import storage_key
from remat.worker.profilers.export_seeds import ExportGradients, StagePass, add_side_gradients
from remat.worker.profilers.run_queue import Timed

__all__ = ["Backend", "StageChainLike", "build_chain", "preserved_state", "profile_chain"]


AmpContext = Callable[[], contextlib.AbstractContextManager[Any]]
"""Makes the context a forward runs in: ``torch.autocast`` for an autocast precision, else a no-op."""


class StageChainLike(Protocol):
    """What the profiler needs of ``remat.client.graph.stage_graph.StageChain``."""

    @property
    def num_stages(self) -> int: ...

    @property
    def names(self) -> Sequence[str]: ...

    def stage(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def run(self, x: torch.Tensor, checkpoints: Sequence[int] = ()) -> torch.Tensor: ...


class Meter(Protocol):
    """Live-bytes readings a backend provides (``MemoryMeter`` on CPU, the caching allocator on CUDA)."""

    current_bytes: int
    peak_bytes: int

    def reset_peak(self) -> None: ...

    def mark_baseline(self) -> int: ...

    timeline_sample: str
    """What one timeline sample is: ``aten op`` (CPU meter) or ``allocator event`` (CUDA allocator history)."""

    def start_timeline(self) -> None: ...

    def timeline_position(self) -> int: ...

    def stop_timeline(self, *marks: int) -> tuple[list[int] | None, list[int]]: ...

    def __enter__(self) -> Meter: ...

    def __exit__(self, *exc: object) -> Any: ...


class Backend(abc.ABC):
    """The device-specific half of profiling and measuring: one subclass per device class.

    Everything remat does differently on one device than on another is a member here, so that the profiler
    (this module), the measured step (``remat.worker.measure``), the pipeline and the worker's process policy
    ask the backend instead of branching on a device name. A subclass registers in
    ``remat.worker.profilers.BACKENDS`` under :attr:`name`, one of ``remat.client.devices.DEVICES`` (a test
    holds the two lists equal). A reading a device does not have (a caching allocator's reserved or
    requested bytes) is None, and the measurement then leaves its field out.
    """

    name: ClassVar[str]
    """The device class served: ``torch.device(...).type`` and the request's ``device``."""
    warm_up_first: ClassVar[bool] = False
    """Profile only after one full training step (:func:`_warm_up`), so that what libraries allocate once and
    keep (cuBLAS workspaces, cuDNN handles) is in the baseline rather than in the first stage's peaks. Not
    needed where the meter counts tensor storages only (CPU), which such memory never is."""
    meter_counts_resident: ClassVar[bool] = False
    """The meter's readings include what existed before it started (the caching allocator counts the whole
    device), so its peak is already the absolute one. False for the CPU meter, which follows only storages
    born while it runs: the resident tensors are then added from their own storages."""
    fixed_memory: ClassVar[bool] = False
    """The device's memory is a fixed pool the step must fit in, so ``--budget fit`` has a meaning
    (:meth:`capacity_bytes` less :meth:`allocated_bytes`). False on CPU, whose memory is the host's, shared."""

    def __init__(self, device: torch.device, device_name: str) -> None:
        self.device = device
        """The device itself, with its index where the device class has several."""
        self.device_name = device_name
        """A readable name of the hardware for trace metadata (a CPU model, a GPU model)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this machine cannot run this device class (``torch sees no CUDA device``); None when it can.

        Asked before anything is built on the device, so that the user gets one line instead of torch's error.
        The client's model building asks the same question (``remat.client.devices.unavailable_reason``).
        """
        return unavailable_reason(cls.name)

    @abc.abstractmethod
    def make_meter(self) -> Meter:
        """A fresh live-bytes meter over this device."""

    @abc.abstractmethod
    def storage_bytes(self, t: torch.Tensor) -> int:
        """Bytes a storage is booked at (``nbytes``; the allocator's rounded block size on CUDA)."""

    @abc.abstractmethod
    def born_in_pass(self, meter: Meter, t: torch.Tensor) -> bool:
        """True when a saved tensor's storage was born while the meter ran (CPU: exact; CUDA: always True,
        parameters and buffers being excluded by storage instead)."""

    @abc.abstractmethod
    def timed(self, fn: Callable[[], Any]) -> Timed:
        """Run a callable once and time it, synchronised with the device's queue (on CPU, with the time the
        process's threads waited for a core: NOTE [ time beside a neighbour ])."""

    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Run a callable once, return the ms it took with the cores it asked for (:attr:`Timed.ms`; the wall
        time on an idle machine and on a device)."""
        return max(0.0, self.timed(fn).ms)

    @property
    def rng_devices(self) -> tuple[torch.device, ...]:
        """Devices whose RNG a profile or a measured step forks and restores besides the CPU's (always forked)."""
        return (self.device,)

    def device_rng_state(self) -> object:
        """The RNG state of this device class's generators, for :meth:`set_device_rng_state`; the CPU's is
        the caller's (``torch.random``). None where the device has no generator of its own."""
        return None

    def set_device_rng_state(self, state: object) -> None:
        """Restore what :meth:`device_rng_state` returned."""
        return None

    def synchronize(self) -> None:
        """Wait for the work queued on the device, so that readings and times cover it (no-op on CPU)."""
        return None

    def empty_cache(self) -> None:
        """Give the device's cached-but-free memory back, so that earlier work does not count in the next
        step's reserved peak (no-op where nothing is cached)."""
        return None

    def reserved_bytes(self) -> int | None:
        """Memory the device's allocator holds now, used or cached; None where there is no cache."""
        return None

    def peak_reserved_bytes(self) -> int | None:
        """Highest :meth:`reserved_bytes` since the meter's last peak reset; None where there is no cache."""
        return None

    def requested_bytes(self, which: Literal["current", "peak"]) -> int | None:
        """Bytes the program asked the allocator for (now, or at the peak), before the allocator rounds them
        to its blocks; None where the meter is exact and there is no such gap."""
        return None

    def allocated_bytes(self) -> int:
        """Bytes allocated on the device now (:attr:`fixed_memory` devices only)."""
        raise NotImplementedError(f"{self.name}: the device's memory is not a fixed pool")

    def capacity_bytes(self) -> int:
        """The device's whole memory (:attr:`fixed_memory` devices only)."""
        raise NotImplementedError(f"{self.name}: the device's memory is not a fixed pool")


def build_chain(model: nn.Module, example_input: torch.Tensor, *, train: bool = True) -> StageChainLike:
    """The model's stage chain from ``remat.client.graph.stage_graph`` (imported lazily: it is client code)."""
    from remat.client.graph.stage_graph import build_stage_chain

    return build_stage_chain(model, example_input, train=train)


def cpu_name() -> str:
    """A readable CPU name for trace metadata (``/proc/cpuinfo`` model name where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def param_keys(model: nn.Module) -> set[int]:
    """Storage keys of every parameter and buffer: never activation memory."""
    keys = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    keys.discard(None)
    return keys  # type: ignore[return-value]


def set_grad_convention(model: nn.Module, grads: str) -> None:
    """``none``: every parameter gradient absent (``zero_grad(set_to_none=True)``); ``kept``: allocated, zero."""
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if grads == "none":
            p.grad = None
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.detach_().zero_()


@dataclass(slots=True)
class _ChainRecord:
    outputs: list[Any]
    """x_0..x_n, detached: the inputs of the isolated passes (x_n: the model's output, a tuple of tensors
    where the model has auxiliary outputs)."""
    requires_grad: list[bool]
    output_keys: list[int | None]
    saved: list[dict[int, int]]
    """Per stage 1..n (index 0 unused): saved storage key -> booked bytes."""
    packed: list[int]
    """Per stage 1..n: how many tensors autograd saved, parameters and buffers included."""
    casts: list[dict[int, int]]
    """Per stage 1..n: autocast's parameter copies made in it, storage key -> booked bytes."""
    side_storages: dict[int, tuple[int, int, set[int]]] = dataclasses.field(default_factory=dict)
    """Per side value storage key (NOTE [side values] in stage_graph.py): (the stage that made it, its bytes, the
    stages that saved it)."""

    def side_by_stage(self, *, unsaved: bool = False) -> list[int]:
        """Per stage 1..n: bytes of the side values it makes, each storage once; with ``unsaved``, only those no
        stage saves for backward (alive in backward only while a checkpointed segment holds them)."""
        by_stage = [0] * (len(self.saved) - 1)
        for stage, nbytes, savers in self.side_storages.values():
            if not (unsaved and savers):
                by_stage[stage - 1] += nbytes
        return by_stage

    def cast_bytes(self, i: int) -> tuple[int, int]:
        """(W_i, the part of it that no stage saves) for stage i."""
        saved_anywhere = set().union(*self.saved)
        made = self.casts[i]
        return sum(made.values()), sum(b for k, b in made.items() if k not in saved_anywhere)


class _CastRecorder(TorchDispatchMode):
    """Records the parameter copies autocast makes: ``_to_copy`` of a leaf parameter that requires grad.

    NOTE [ autocast cast cache ] Under ``torch.autocast`` a float32 parameter is cast to the lower precision
    at its first use, and the copy is cached until the autocast region exits (the end of forward + loss),
    checkpointed segment or not: a checkpointed stage drops what it saves, but the cache still holds the
    copies. Only cache misses reach the dispatcher, so what this sees in one chained forward under one
    autocast region is exactly what the cache holds.
    """

    def __init__(self, params: set[int], backend: Backend, current: list[int], casts: list[dict[int, int]]) -> None:
        super().__init__()
        self.params, self.backend, self.current, self.casts = params, backend, current, casts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            src = args[0]
            if (isinstance(src, torch.Tensor) and src.requires_grad and src.is_leaf
                    and storage_key(src) in self.params and out.dtype != src.dtype):
                key = storage_key(out)
                if key is not None:
                    self.casts[self.current[0]][key] = self.backend.storage_bytes(out)
        return out


def _chained_forward(chain: StageChainLike, x0: torch.Tensor, backend: Backend, excluded: set[int],
                     amp: AmpContext, autocast: bool) -> _ChainRecord:
    n = chain.num_stages
    saved: list[dict[int, int]] = [{} for _ in range(n + 1)]
    casts: list[dict[int, int]] = [{} for _ in range(n + 1)]
    packed = [0] * (n + 1)
    current = [0]
    x0_key = storage_key(x0)
    meter = backend.make_meter()
    inputs = {storage_key(t) for t in pytree.tree_leaves((x0, getattr(chain, "_extra_inputs", None)))
              if isinstance(t, torch.Tensor)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed[current[0]] += 1
        key = storage_key(t)
        if key in side:
            side_savers.setdefault(key, set()).add(current[0])  # type: ignore[arg-type]
        # The call's inputs are the caller's, never activation memory: booked only as a stage's own input (its
        # saves_input), not as what a later stage saves of them (CLIP's text embedding saves the token ids).
        if key is not None and key not in excluded and (
                key == keys[current[0] - 1] == x0_key
                or (key not in inputs and backend.born_in_pass(meter, t))):
            saved[current[0]][key] = backend.storage_bytes(t)
        # Detached: the pass never runs backward, and a saved *output* returned as itself would hold its own
        # grad_fn, a reference cycle through C++ that gc cannot break (ResNet's in-place ReLUs: the whole
        # pass's activations leaked per profile). Kept alive all the same, so no storage key is reused.
        return t.detach()

    outputs = [x0.detach()]
    requires_grad = [x0.requires_grad]
    keys = [x0_key]
    side_names = set(getattr(chain, "side_values", ()))
    side: dict[int, int] = {}
    side_savers: dict[int, set[int]] = {}  # storage key -> the stages that saved it
    side_stage: dict[int, int] = {}  # storage key -> the stage that made it
    # One autocast region over the whole pass, as over a real step's forward: its cast cache is shared.
    recorder = _CastRecorder(excluded, backend, current, casts) if autocast else contextlib.nullcontext()
    with (meter, torch.enable_grad(), amp(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          recorder):
        x = x0
        for i in range(1, n + 1):
            current[0] = i
            x = stage_callable(chain, i)(x)
            if side_names:
                known = set(side)
                for key, stages in _note_side_values(chain, side_names, side, excluded, inputs, saved,
                                                     backend).items():
                    side_savers.setdefault(key, set()).update(stages)
                side_stage.update(dict.fromkeys(side.keys() - known, i))
            if i == n:  # the model's output: a tensor, or a main output with auxiliary ones (GoogLeNet)
                out = output_tensors(x, where=f"the last stage ({chain.names[i - 1]})")
                outputs.append(x.detach() if isinstance(x, torch.Tensor) else tuple(t.detach() for t in out))
                requires_grad.append(any(t.requires_grad for t in out))
                keys.append(storage_key(out[0]))
                continue
            if not isinstance(x, torch.Tensor):
                # A model-level limit, not a bug of the run: reported as the job's reason, not "internal error".
                raise ModelError(f"cannot profile this model's stage chain: stage {i} ({chain.names[i - 1]}) "
                                 f"returns a {type(x).__name__}, not one tensor (remat's stages pass one tensor "
                                 f"along)")
            outputs.append(x.detach())
            requires_grad.append(x.requires_grad)
            keys.append(storage_key(x))
        del x  # frees the autograd graph of the whole pass
    _detach_side_values(chain, side_names)
    storages = {key: (side_stage[key], size, side_savers.get(key, set())) for key, size in side.items()}
    return _ChainRecord(outputs, requires_grad, keys, saved, packed, casts, storages)


def _side_values(rec: _ChainRecord, grads: Mapping[int, tuple[int, set[int]]]) -> list[dict[str, Any]]:
    """Trace metadata ``side_values``: each side value's storage with its maker, savers and gradient, in the
    order they were made (docs/cost-model.md, "Side values")."""
    out = []
    for key, (stage, nbytes, savers) in rec.side_storages.items():
        grad_bytes, senders = grads.get(key, (0, set()))
        senders = {s for s in senders if s > stage}  # the maker's own use of it sends it nothing
        out.append({"stage": stage, "bytes": nbytes, "saved_by": sorted(savers),
                    "grad_bytes": grad_bytes if senders else 0, "grad_from": sorted(senders)})
    return out


def stage_callable(chain: StageChainLike, i: int) -> Callable[[Any], Any]:
    """Stage ``i`` as profiled: the last stage's output folded into the model's (an exported model's flat
    leaves become its ``ModelOutput``) and reduced to what the loss is made of (its own loss, when it
    computes one: remat.client.model_output)."""
    stage = chain.stage(i)
    if i < chain.num_stages:
        return stage
    fold = getattr(chain, "fold_output", None)

    def last(x: Any) -> Any:
        y = stage(x)
        return training_outputs(fold(y) if fold is not None else y)

    return last


def _note_side_values(chain: StageChainLike, names: set[str], side: dict[int, int], excluded: set[int],
                      inputs: set[int | None], saved: list[dict[int, int]], backend: Backend) -> dict[int, set[int]]:
    """Book the side values made so far once (NOTE [side values] in stage_graph.py): their storages leave every
    stage's saved set and join ``side`` (storage key -> bytes). Views of a parameter, a buffer or one of the
    call's ``inputs`` (CLIP's reshaped token ids) are not made by the pass and not booked. Returns, for those a
    stage had saved (their maker), the stages that saved them."""
    was_saved: dict[int, set[int]] = {}
    env = getattr(chain, "_probe_env", {})
    for name in names & env.keys():
        for t in pytree.tree_leaves(env[name]):
            key = storage_key(t) if isinstance(t, torch.Tensor) else None
            if key is None or key in side or key in excluded or key in inputs:
                continue
            side[key] = backend.storage_bytes(t)
            excluded.add(key)
            for stage, stage_saved in enumerate(saved):
                if stage_saved.pop(key, None) is not None:
                    was_saved.setdefault(key, set()).add(stage)
    return was_saved


def _detach_side_values(chain: StageChainLike, names: set[str]) -> None:
    """After the chained pass, the side values the isolated passes read are leaves of their own (requiring grad
    as in the pass): a stage's backward then ends at them instead of running into earlier stages' graphs."""
    env = getattr(chain, "_probe_env", None)
    if not env:
        return
    for name in names & env.keys():
        env[name] = pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad and t.is_floating_point()), env[name])


def _clear_side_grads(chain: StageChainLike) -> None:
    """Drop the gradients an isolated backward left on side values, so the next pass allocates its own."""
    env = getattr(chain, "_probe_env", {})
    for name in getattr(chain, "side_values", ()):
        for t in pytree.tree_leaves(env.get(name)):
            if isinstance(t, torch.Tensor):
                t.grad = None


class _GradientSink(torch.autograd.Function):
    """Identity in forward; in backward, notes the input gradient's layout and lets the gradient die.

    NOTE [ input gradient in the isolated pass ] In a real step the gradient of x_{i-1} is an input buffer
    of stage i-1's backward: it lives until stage i-1's first node has consumed it. Were the isolated
    stage's input a plain leaf, ``AccumulateGrad`` would store it in ``x_in.grad`` (and clone it where the
    buffer is shared, as behind a residual add). The sink ends the graph the way the previous stage would
    and returns no gradient, so nothing is accumulated or cloned. It also records the gradient's strides:
    that is the layout stage i-1's output gradient has in a real step (NOTE [ output gradient layout ]).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layouts: list[tuple[int, ...]]) -> torch.Tensor:
        ctx.layouts = layouts
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        if not ctx.layouts and _is_dense(grad):
            ctx.layouts.append(tuple(grad.stride()))
        return None, None


def _is_dense(t: torch.Tensor) -> bool:
    """True when the tensor's elements fill its storage span exactly once (any dimension order)."""
    expected = 1
    for size, stride in sorted(((sz, st) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1),
                               key=lambda pair: pair[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _stage_input(x_in: torch.Tensor, layouts: list[tuple[int, ...]]) -> torch.Tensor:
    """The tensor a stage runs on in an isolated pass (NOTE [ input gradient in the isolated pass ])."""
    return _GradientSink.apply(x_in, layouts) if x_in.requires_grad else x_in


def _gradient_seed(output: Any, strides: tuple[int, ...] | None) -> Any:
    """Ones shaped like a stage's output, laid out as its gradient is in a real step.

    NOTE [ output gradient layout ] The isolated backward starts from ``(y * seed).sum()``, whose gradient
    for y is a fresh buffer with the seed's strides. In a real step that gradient is made by the next
    stage's backward, whose layout need not be y's: ViT's encoder blocks output a transposed
    (non-contiguous) tensor but receive a contiguous gradient. A gradient laid out like y instead makes
    the stage's first ``reshape`` backward copy it (one more d_i in B_i). So stages are profiled from the
    last to the first and each stage's seed takes the strides that the next stage's input gradient had
    (contiguous for the last stage: the loss's gradient is).
    """
    if not isinstance(output, torch.Tensor):  # the model's main and auxiliary outputs: the loss's, dense
        return tuple(torch.ones(t.shape, dtype=t.dtype, device=t.device) for t in output)
    if strides is None:
        return torch.ones(output.shape, dtype=output.dtype, device=output.device)
    return torch.empty_strided(output.shape, strides, dtype=output.dtype, device=output.device).fill_(1)


def _output_bytes(backend: Backend, y: Any) -> int:
    """Bytes of a stage's output; the model's auxiliary outputs are part of the last stage's."""
    seen: dict[int | None, int] = {}
    for t in output_tensors(y):
        seen.setdefault(storage_key(t) if storage_key(t) is not None else id(t), backend.storage_bytes(t))
    return sum(seen.values())


@dataclass(slots=True)
class _StageMeasure:
    forward_peak: int = 0
    forward_peak_dropped: int = 0
    recompute_peak: int = 0
    recomputed_backward_peak: int = 0
    backward_peak: int = 0
    grads_born: dict[int, int] | None = None
    backward_ms: float | None = None
    levels: dict[str, list[int]] = field(default_factory=dict)
    """NOTE [ peak levels ]: per peak field, the level (bytes above the field's own zero) after every aten op of
    its window, whose maximum is the field. A peak is the maximum of such levels, and each level is a sum of
    storages, affine in the batch size; the maximum is not (which transient decides a stage's backward peak
    changes with the batch). Kept in the trace (stage ``peak_levels``), they let a trace be derived at another
    batch size exactly from two profiles (remat.client.derived_trace). Recorded where the meter samples per
    aten op (CPU); empty on CUDA, whose allocator history is read after the fact."""


def _isolated_pass(stage: StagePass, x_in: torch.Tensor, ones: torch.Tensor,
                   model: nn.Module, backend: Backend, grads: str,
                   input_grad_layout: list[tuple[int, ...]], amp: AmpContext) -> _StageMeasure:
    """F, F', B and the parameter gradients born, for one stage run on its own (NOTE [ profiling protocol ];
    its exports seeded: NOTE [ seeding a stage's exports ])."""
    out = _StageMeasure()
    set_grad_convention(model, grads)
    had_grad = {id(p) for p in model.parameters() if p.grad is not None}
    meter = backend.make_meter()
    levels = _Levels(meter)
    last_pack_peak: list[int | None] = [None]
    last_pack_at = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        last_pack_peak[0] = meter.peak_bytes
        last_pack_at[0] = levels.position()
        return t

    with meter:
        armed = stage.arm()
        base = meter.mark_baseline()
        levels.start()
        with torch.enable_grad(), amp(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, exports = stage(_stage_input(x_in, input_grad_layout))
        out.forward_peak = meter.peak_bytes - base
        forward_end = levels.position()
        out.recompute_peak = 0 if last_pack_peak[0] is None else last_pack_peak[0] - base
        levels.keep(out, "forward_peak_bytes", 0, forward_end, out.forward_peak)
        if last_pack_peak[0] is not None:
            levels.keep(out, "recompute_peak_bytes", 0, last_pack_at[0], out.recompute_peak)
        with torch.enable_grad():
            loss = stage.loss(y, ones, exports, armed)
        del y, exports
        if loss is not None:
            loss_bytes = backend.storage_bytes(loss)
            meter.reset_peak()
            backward_start = levels.restart()
            loss.backward()
            out.backward_peak = meter.peak_bytes - base - loss_bytes
            levels.keep(out, "backward_peak_bytes", backward_start, None, out.backward_peak, minus=loss_bytes)
            del loss
        levels.stop()
    out.forward_peak_dropped = _dropped_forward_peak(stage, x_in, backend, amp, out)
    if x_in.requires_grad or any(p.requires_grad for p in model.parameters()):
        out.recomputed_backward_peak = _recomputed_backward_peak(stage, x_in, ones, model, backend, grads, amp,
                                                                 out)
    out.grads_born = {}
    for p in model.parameters():
        if p.grad is not None and id(p) not in had_grad:
            key = storage_key(p)
            out.grads_born[key] = backend.storage_bytes(p.grad)  # type: ignore[index]
    x_in.grad = None
    return out


def _dropped_forward_peak(stage: StagePass, x_in: torch.Tensor, backend: Backend,
                          amp: AmpContext, out: _StageMeasure) -> int:
    """F°: the stage's forward peak when autograd keeps none of its saved tensors, as in the first forward of
    a checkpointed segment (whose pack hook stores a handle, not the tensor). Its output, temporaries and,
    under autocast, the parameter copies the cast cache holds are in; its saved tensors are not."""
    meter = backend.make_meter()
    levels = _Levels(meter)
    with meter:
        base = meter.mark_baseline()
        levels.start()
        with torch.enable_grad(), amp(), torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda h: h):
            y, exports = stage(x_in)
        peak = meter.peak_bytes - base
        levels.keep(out, "forward_peak_dropped_bytes", 0, None, max(peak, 0))
        levels.stop()
        del y, exports
    return peak


class _ResetPeakOnExit:
    """Recompute context for :func:`torch.utils.checkpoint`: when the recompute ends, a new peak window starts."""

    def __init__(self, meter: Meter, levels: _Levels) -> None:
        self.meter = meter
        self.levels = levels

    def __enter__(self) -> _ResetPeakOnExit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.meter.reset_peak()
        self.levels.window_start = self.levels.restart()


class _Levels:
    """The meter's per-op samples, cut into the windows of the peak fields (NOTE [ peak levels ]).

    The samples of a MemoryMeter are levels above its baseline, the zero of every peak field here (less the
    loss's bytes in backward, as the fields). A field's levels are kept only when their maximum equals the
    field as measured, so that the two can never disagree in a trace.
    """

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.on = getattr(meter, "timeline_sample", None) == "aten op"
        self.window_start = 0

    def start(self) -> None:
        if self.on:
            self.meter.start_timeline()

    def position(self) -> int:
        return self.meter.timeline_position() if self.on else 0

    def restart(self) -> int:
        """A new window from here: the samples' running high starts again at the current level."""
        if self.on:
            self.meter.restart_high()  # type: ignore[attr-defined]  # MemoryMeter's, the only meter with `on`
        return self.position()

    def keep(self, out: _StageMeasure, name: str, begin: int, end: int | None, value: int, *,
             minus: int = 0) -> None:
        if not self.on:
            return
        samples = self.meter.timeline or []  # type: ignore[attr-defined]
        window = samples[begin:end]
        if not window:
            return
        kept = [level - minus for level in window]  # samples count from the meter's baseline, as the fields do
        if max(kept) == value:
            out.levels[name] = kept

    def stop(self) -> None:
        if self.on:
            self.meter.stop_timeline()


def _recomputed_backward_peak(stage: StagePass, x_in: torch.Tensor,
                              ones: torch.Tensor, model: nn.Module, backend: Backend, grads: str,
                              amp: AmpContext, out: _StageMeasure) -> int:
    """B°: the stage's backward peak when it runs under a non-reentrant checkpoint, counted from the end of
    its recompute (the recompute itself is the cost model's recompute candidate).

    NOTE [ backward of a recomputed stage ] The engine checks a node's outputs (``validate_outputs``:
    ``sum_to`` of broadcast gradients, dtype casts) before it releases the node's saved tensors; a node
    whose saved tensors come from a checkpoint's recompute holds them only as locals of its ``apply``, so
    they are gone by then. Measured on an H100 (ViT-B/16 MLP stage, batch 32): the bias gradient's
    ``sum_to`` allocates 37 MiB of reduction scratch after ``apply``, beside the 74 MiB GELU output in a
    plain backward, after it was freed in a recomputed one; B was 305 MiB, the recomputed backward peaks
    37 MiB lower. So stages of checkpointed segments are charged B° and the last segment B.
    """
    set_grad_convention(model, grads)
    meter = backend.make_meter()
    levels = _Levels(meter)
    with meter:
        armed = stage.arm()
        base = meter.mark_baseline()
        levels.start()
        with torch.enable_grad(), amp():
            y, exports = checkpoint(stage, _stage_input(x_in, []), use_reentrant=False,
                                    context_fn=lambda: (contextlib.nullcontext(), _ResetPeakOnExit(meter, levels)))
        with torch.enable_grad():
            loss = stage.loss(y, ones, exports, armed)
        del y, exports
        if loss is None:
            levels.stop()
            return 0
        loss_bytes = backend.storage_bytes(loss)
        meter.reset_peak()  # a stage that saves nothing is never recomputed: its whole backward counts
        levels.window_start = levels.restart()
        loss.backward()
        peak = meter.peak_bytes - base - loss_bytes
        levels.keep(out, "recomputed_backward_peak_bytes", levels.window_start, None, max(peak, 0), minus=loss_bytes)
        levels.stop()
        del loss
    x_in.grad = None
    return max(peak, 0)


def _time_backward(stage: StagePass, x_in: torch.Tensor, ones: torch.Tensor,
                   model: nn.Module, backend: Backend, grads: str, repeats: int, amp: AmpContext) -> float:
    """Fastest backward time of the isolated pass over ``repeats`` runs, without the meter. (Forward times are
    taken inside a whole pass instead: NOTE [ timing a plan ].)"""
    bwd: list[float] = []
    for _ in range(repeats):
        set_grad_convention(model, grads)
        armed = stage.arm()
        with torch.enable_grad(), amp():
            y, exports = stage(_stage_input(x_in, []))
        with torch.enable_grad():
            loss = stage.loss(y, ones, exports, armed)
        del y, exports
        if loss is not None:
            bwd.append(backend.time_ms(loss.backward))
            del loss
        x_in.grad = None
    return min(bwd) if bwd else 0.0


def _add_times(obj: dict[str, Any], chain: StageChainLike, model: nn.Module, x0: Any, backend: Backend,
               grads: str, amp: AmpContext) -> None:
    """Every stage's ``forward_ms`` and ``recompute_ms``, the trace's ``checkpoint_ms`` and ``timing``, from
    whole forward passes and training steps (NOTE [ timing a plan ])."""
    from remat.worker.profilers.step_timing import time_stages

    n = chain.num_stages

    def step(checkpoints: Sequence[int]) -> None:
        set_grad_convention(model, grads)
        _train_step(chain, x0, checkpoints, amp)

    def forward_context() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.enable_grad())
        stack.enter_context(amp())
        return stack

    times = time_stages([stage_callable(chain, i) for i in range(1, n + 1)], x0, step, backend.timed,
                        forward_context)
    for k, stage_obj in enumerate(obj["stages"]):
        stage_obj["forward_ms"] = times.forward_ms[k]
        if times.recompute_ms is not None:
            stage_obj["recompute_ms"] = times.recompute_ms[k]
    if times.checkpoint_ms is not None:
        obj["checkpoint_ms"] = times.checkpoint_ms
    obj["timing"] = times.summary
    for p in model.parameters():
        p.grad = None
    backend.synchronize()


def _shared_users(chain: StageChainLike, n: int, backend: Backend) -> dict[int, tuple[list[int], int]]:
    """Parameters used by more than one stage (tied weights): storage key -> (the stages using it, bytes)."""
    params_of = getattr(chain, "stage_parameters", None)
    users: dict[int, tuple[list[int], int]] = {}
    if params_of is None:
        return users
    for i in range(1, n + 1):
        for p in params_of(i):
            key = storage_key(p)
            if key is not None and p.requires_grad:
                stages = users.setdefault(key, ([], backend.storage_bytes(p)))[0]
                if i not in stages:
                    stages.append(i)
    return {key: value for key, value in users.items() if len(value[0]) > 1}


def _floor_shared_sums(chain: StageChainLike, n: int, backend: Backend, measures: list[_StageMeasure]) -> None:
    """B_s of every stage but the last one using a tied weight: at least twice the weight's bytes.

    NOTE [ summing a tied weight's gradients ] The later user's gradient waits in the engine's input buffer
    (booked as G of that stage, under either convention); when an earlier user's own contribution arrives,
    the two are summed out of place, so the stage's contribution and the sum are alive at once beside the
    waiting buffer (then the sum becomes ``.grad``, or is added into it in place under ``grads="kept"``). The
    isolated pass, which sees one contribution, cannot show it. Measured on GPT-2s with tied embeddings:
    -10.6% (none) and -33% (kept, vocabulary 8,000 by 384) on plans whose peak is the embedding's backward,
    exact with this floor.
    """
    for stages, size in _shared_users(chain, n, backend).values():
        for s in sorted(stages)[:-1]:
            m = measures[s - 1]
            m.backward_peak = max(m.backward_peak, 2 * size)
            if m.recomputed_backward_peak:
                m.recomputed_backward_peak = max(m.recomputed_backward_peak, 2 * size)
            for name in ("backward_peak_bytes", "recomputed_backward_peak_bytes"):
                if name in m.levels:  # the floor is one more level, a constant one (NOTE [ peak levels ])
                    m.levels[name].append(2 * size)


def _shared_parameter_grads(chain: StageChainLike, n: int, backend: Backend) -> list[int]:
    """G_i under ``grads="kept"``: the bytes of the parameters stage i shares with an earlier stage (tied
    weights: a language model's embedding and output head).

    NOTE [ tied weights under kept gradients ] A parameter used by two stages gets two gradient contributions.
    The autograd engine sums them in the input buffer of the parameter's ``AccumulateGrad`` node, which runs
    only when both have arrived: the later stage's contribution (its backward runs first) is a buffer of the
    parameter's size alive until the earlier stage's backward, then added into ``.grad`` in place. Measured on a
    GPT-2 with tied embeddings: plans under-predicted by the head's weight until it was booked here; it is
    then alive in every earlier stage's backward, as a gradient born in stage i is under ``grads="none"``.
    """
    out = [0] * (n + 1)
    for stages, size in _shared_users(chain, n, backend).values():
        out[max(stages)] += size
    return out


def _warm_up(chain: StageChainLike, model: nn.Module, x0: torch.Tensor, backend: Backend, amp: AmpContext) -> None:
    """One full training step before anything is metered, so that what libraries allocate once and keep
    (cuBLAS workspaces of the forward and of the autograd device thread, cuDNN handles) exists before the
    first baseline, as it does before a measured step (which also follows a warm-up step). Without it, the
    first stage to use such a library books the library's memory in its own peaks."""
    _train_step(chain, x0, (), amp)
    for p in model.parameters():
        p.grad = None
    backend.synchronize()


def _train_step(chain: StageChainLike, x0: Any, checkpoints: Sequence[int], amp: AmpContext) -> None:
    """One training step of the chain with ``checkpoints``: forward under ``amp``, the seeded sum of every
    floating output as the loss, backward. A call's other inputs are those bound to the chain."""
    extra = getattr(chain, "_extra_inputs", None) or None
    with torch.enable_grad():
        with amp():
            out = (chain.run(x0, checkpoints, extra=extra)  # type: ignore[call-arg]  # StageChain's
                   if extra else chain.run(x0, checkpoints))
            fold = getattr(chain, "fold_output", None)
            out = training_outputs(fold(out) if fold is not None else out)
            loss = sum(t.float().sum() for t in output_tensors(out))
            del out
        if loss.requires_grad:
            loss.backward()


def _metadata(model: nn.Module, x0: torch.Tensor, backend: Backend, *, precision: str, grads: str, train: bool,
              model_name: str | None, model_hash: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "model": model_name or type(model).__name__,
        "input_shape": list(x0.shape),  # full shape, batch included: the plan key's convention
        "batch_size": int(x0.shape[0]) if x0.dim() else 1,
        "dtype": precision,  # the plan key's spelling (remat.client.precision)
        "device": backend.device.type,
        "device_name": backend.device_name,
        "torch_version": torch.__version__,
        "grads": grads,
        "mode": "train" if train else "eval",
        "profiler": "remat.worker.profilers/1",
    }
    if model_hash:
        meta["model_hash"] = model_hash
    return meta


def profile_chain(chain: StageChainLike, model: nn.Module, example_input: torch.Tensor, *, backend: Backend,
                  grads: str = "none", train: bool = True, model_name: str | None = None,
                  model_hash: str | None = None, timing_repeats: int = 1, precision: str | None = None) -> Trace:
    """Profile a stage chain into a ``remat-trace/1`` trace (NOTE [ profiling protocol ]).

    Args:
        chain: the model's stages; they must use the model's own parameters and buffers.
        model: the module the chain runs (for parameters, buffers and state restoring).
        example_input: one input batch; moved to the backend's device.
        backend: device-specific readings (see :mod:`.cpu`, :mod:`.cuda`).
        grads: gradient convention, ``none`` (set to None between steps) or ``kept`` (allocated).
        train: profile in train mode (BatchNorm batch statistics, dropout) or eval mode.
        model_name, model_hash: copied into the trace metadata.
        timing_repeats: unmetered runs per stage for ``backward_ms`` (the fastest is kept); above 0, also
            ``forward_ms``, ``recompute_ms`` and ``checkpoint_ms`` from timed rounds of whole passes and steps
            (NOTE [ timing a plan ]); 0 leaves times out.
        precision: the step's precision (``remat.client.precision``); an autocast one runs every forward
            under ``torch.autocast`` and every backward outside it. Default: read from the input's dtype
            and the autocast state of the caller.

    Returns:
        The validated trace.
    """
    if grads not in GRAD_CONVENTIONS:
        raise ValueError(f"grads must be one of {', '.join(GRAD_CONVENTIONS)}, got {grads!r}")
    n = chain.num_stages
    if n < 1:
        raise ValueError("remat profiler: the stage chain has no stages")
    call = example_input.to(backend.device)
    precision = normalize_precision(precision) if precision is not None else precision_of_call(model, call)
    # A call of several inputs: stage 1 receives its main tensor, every stage may read the others by name (and
    # the main one too when it holds token ids: NOTE [ token ids are held ] in stage_graph).
    bind = getattr(chain, "bind_inputs", None)
    x0 = bind(call) if bind is not None else call

    def amp() -> contextlib.AbstractContextManager[Any]:
        return autocast_context(precision, backend.device.type)

    with preserved_state(model, devices=backend.rng_devices):
        model.train(train)
        excluded = param_keys(model)
        chain_model = getattr(chain, "model", chain)
        if isinstance(chain_model, nn.Module) and chain_model is not model:
            excluded |= param_keys(chain_model)
        if backend.warm_up_first:
            _warm_up(chain, model, x0, backend, amp)
        set_grad_convention(model, grads)
        rec = _chained_forward(chain, x0, backend, excluded, amp, autocast_dtype(precision) is not None)
        measures: list[_StageMeasure] = [_StageMeasure() for _ in range(n)]
        grad_strides: tuple[int, ...] | None = None  # of x_i's gradient in a real step; the loss's is dense
        side_grads: dict[int, tuple[int, set[int]]] = {}  # side value storage -> (its gradient's bytes, senders)
        export_grads: ExportGradients = {}  # NOTE [ seeding a stage's exports ]
        for i in range(n, 0, -1):  # last to first: NOTE [ output gradient layout ]
            stage = StagePass(chain, i, stage_callable(chain, i), export_grads)
            x_in = rec.outputs[i - 1].detach().requires_grad_(rec.requires_grad[i - 1])
            ones = _gradient_seed(rec.outputs[i], grad_strides)
            layouts: list[tuple[int, ...]] = []
            m = _isolated_pass(stage, x_in, ones, model, backend, grads, layouts, amp)
            for key, nbytes in add_side_gradients(chain, export_grads).items():
                side_grads.setdefault(key, (nbytes, set()))[1].add(i)
            _clear_side_grads(chain)
            grad_strides = layouts[0] if layouts else None
            if timing_repeats > 0:
                m.backward_ms = _time_backward(stage, x_in, ones, model, backend, grads, timing_repeats, amp)
                _clear_side_grads(chain)
            measures[i - 1] = m
            for name in stage.names:  # its maker is done: what a step sends it is seeded no more
                export_grads.pop(name, None)
            del x_in, ones, stage
        # G_i: in backward order, a parameter's gradient is born in the last stage that uses it.
        param_grad = [0] * (n + 1)
        if grads == "none":
            seen: set[int] = set()
            for i in range(n, 0, -1):
                born = measures[i - 1].grads_born or {}
                param_grad[i] = sum(b for k, b in born.items() if k not in seen)
                seen |= born.keys()
        else:
            param_grad = _shared_parameter_grads(chain, n, backend)
        _floor_shared_sums(chain, n, backend, measures)
        stages = []
        for i in range(1, n + 1):
            in_key, out_key = rec.output_keys[i - 1], rec.output_keys[i]
            saved = rec.saved[i]
            m = measures[i - 1]
            stage_obj: dict[str, Any] = {
                "name": chain.names[i - 1],
                "output_bytes": _output_bytes(backend, rec.outputs[i]),
                "saved_bytes": sum(b for k, b in saved.items() if k not in (in_key, out_key)),
                "saves_input": in_key in saved,
                "saves_output": out_key in saved,
                "forward_peak_bytes": max(m.forward_peak, 0),
                "forward_peak_dropped_bytes": max(m.forward_peak_dropped, 0),
                "recompute_peak_bytes": max(m.recompute_peak, 0),
                "backward_peak_bytes": max(m.backward_peak, 0),
                "recomputed_backward_peak_bytes": m.recomputed_backward_peak,
                "param_grad_bytes": param_grad[i],
            }
            if m.levels:
                stage_obj["peak_levels"] = m.levels
            if m.backward_ms is not None:
                stage_obj["backward_ms"] = m.backward_ms
            if not rec.packed[i]:
                stage_obj["saves_nothing"] = True
            cast, cast_unsaved = rec.cast_bytes(i)
            if cast:
                stage_obj["cast_bytes"], stage_obj["cast_unsaved_bytes"] = cast, cast_unsaved
            if in_key is not None and in_key == out_key:
                stage_obj["output_aliases_input"] = True
            stages.append(stage_obj)
        obj = {"format": TRACE_FORMAT,
               **_metadata(model, x0, backend, precision=precision, grads=grads, train=train, model_name=model_name,
                           model_hash=model_hash or getattr(chain, "architecture_hash", None)),
               "input_bytes": backend.storage_bytes(x0), "stages": stages}
        signature = getattr(call, "signature", "")
        if signature:
            obj["inputs"] = signature
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if isinstance(attention, str):  # a transformers model: what a fit in the sequence length needs to know
            obj["attention"] = attention  # (remat.client.derived_trace.sequence_degree)
        side_by_stage, unsaved_by_stage = rec.side_by_stage(), rec.side_by_stage(unsaved=True)
        if any(side_by_stage):
            obj["side_bytes"] = sum(side_by_stage)
            obj["side_by_stage"] = side_by_stage
            obj["side_unsaved_bytes"] = sum(unsaved_by_stage)
            obj["side_unsaved_by_stage"] = unsaved_by_stage
            obj["side_values"] = _side_values(rec, side_grads)
        if timing_repeats > 0:
            del rec, measures  # the pass's activations: the timed steps need the memory a real step has
            _add_times(obj, chain, model, x0, backend, grads, amp)
    return parse_trace(obj)
