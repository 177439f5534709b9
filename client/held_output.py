"""Tell a training loop that keeps the model's output alive through ``backward()`` what that costs.

NOTE [ an output alive through backward ] A plan's peak is predicted for a step that lets go of the
model's output before ``backward()``: ``model(**batch).loss.backward()``, ``criterion(model(x), y).backward()``,
transformers' ``Trainer``. A loop that holds it (``outputs = model(**batch); outputs.loss.backward()``, as
transformers' ``no_trainer`` examples do; nanoGPT's ``logits, loss = model(X, Y)``), or a view of it, keeps
its tensors alive until backward ends, and a loss that saves it keeps it until its own backward: a language
model's logits, 98 MiB for GPT-2 at 2 × 256 (+12.8% over its ``linear`` plan), gigabytes at a 128k
vocabulary and a few thousand tokens. Nothing in the plan or its key says which loop will train it, so the
applied model watches its first training step instead:

- the output tensors (the model's own loss, scalars and the call's inputs left out) are remembered by weak
  reference to their storages (a storage's Python object lives exactly as long as the storage), and a hook
  on the model's own loss — or, for a model without one, on its outputs — fires when backward reaches the
  model;
- that hook queues a callback for the end of the backward (``queue_callback``): by then the model has let
  go of everything it kept (saved tensors, a checkpoint frame's inputs: T5's encoder output is read by
  every decoder segment), so an output whose storage is still alive is kept by the loop, as ``outputs`` or
  through a view, and costs from the moment the model would have freed it to the end — all of backward for
  an output nothing saves (the logits), from its saver's backward on for one the model saves (a 128 KiB
  hidden state that a head saves as its input adds all of its 128 KiB held, measured in
  tests/client/test_held_output.py);
- a loss computed outside the model that saves the output (``mse_loss``, ``l1_loss``,
  ``binary_cross_entropy_with_logits``; not ``cross_entropy``, whose ``log_softmax`` keeps its own result)
  keeps it alive as backward starts and frees it in its own backward, before the hook fires: a
  ``weakref.finalize`` on each output's storage notes a death inside a backward
  (``torch._C._current_graph_task_id``) before the hook, and such an output is reported as the loss's (tiny
  GPT-2 without labels, ``mse_loss`` on its logits: the plan's peak plus exactly the logits, measured);
- when what the step keeps is at least ``MIN_SHARE`` of the plan's predicted peak and ``MIN_BYTES``, one
  ``RuntimeWarning`` names it, its bytes, the peak the step can reach (the plan's peak plus those bytes:
  they add to backward's peaks; exact on GPT-2) and the fix.

The watch lasts until one backward has been seen (a forward without backward watches again next time, up to
``MAX_WATCHED`` forwards) and costs a weak reference and a finalizer per output tensor, a hook and a callback
in that one step, within a step's noise (GPT-2, 12 layers, 2 × 256, 8 interleaved steps: least 3.31 s watched
and 3.24 s not, medians 3.35 and 3.54 s); later steps run nothing of it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from remat.client.graph.model_call import path_text, tensor_text
from remat.client.model_output import own_loss
from remat.client.user_frame import user_stacklevel

__all__ = ["MAX_WATCHED", "MIN_BYTES", "MIN_SHARE", "OutputWatch"]

MIN_SHARE = 0.01
"""Kept output bytes below this share of the plan's predicted peak are not reported: within the product's
1% prediction tolerance (a classifier's logits: kilobytes)."""
MAX_WATCHED = 3
"""Training forwards watched without a backward reaching the model before the watch gives up."""
MIN_BYTES = 64 << 10
"""Nor are fewer bytes than this, whatever the peak (a toy model's outputs)."""


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """A tensor's storage as (address, bytes), None without a plain one (a tensor subclass)."""
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


@dataclass(frozen=True, slots=True)
class _Kept:
    name: str
    """Where it is in the output, as the loop indexes it: ``output['logits']``, ``output[0]``, ``output``."""
    what: str
    """``float32[2, 256, 50257]``."""
    storage: weakref.ref
    """Its storage, alive as long as its memory is: whoever keeps it, the tensor or a view."""
    key: tuple[int, int]
    """The storage's (address, bytes) when the output was made."""

    @property
    def nbytes(self) -> int:
        return self.key[1]


@dataclass(eq=False)
class OutputWatch:
    """The watch of one applied model (NOTE [ an output alive through backward ])."""

    predicted_peak_bytes: int | None
    done: bool = False
    watched: int = 0
    kept: tuple[_Kept, ...] = ()
    _reached_model: bool = False
    """Backward reached the model: deaths after that are the model's own releases."""
    _died_in_backward: set[tuple[int, int]] = field(default_factory=set)

    def output(self, output: Any, inputs: Any) -> Any:
        """After a training forward: remember the output tensors other than the step's loss (not the call's
        ``inputs``: the loop holds those anyway), and hook the moment backward reaches the model. Returns
        ``output``."""
        if self.done:
            return output
        if self.watched >= MAX_WATCHED:
            self.done = True
            return output
        self.watched += 1
        inputs = {_storage(t) for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        loss = own_loss(output)
        leaves, _ = pytree.tree_flatten_with_path(output)
        kept: dict[tuple[int, int], _Kept] = {}
        grads: list[torch.Tensor] = []
        for path, t in leaves:
            if not isinstance(t, torch.Tensor) or t is loss or t.dim() == 0:  # a loss in a tuple: bytes
                continue
            if t.requires_grad:
                grads.append(t)
            storage = _storage(t)
            if storage is None or storage in kept or storage in inputs:
                continue
            kept[storage] = _Kept(f"output{path_text(path)}", tensor_text(t), weakref.ref(t.untyped_storage()),
                                  storage)
        self.kept, self._reached_model = tuple(kept.values()), False
        if sum(k.nbytes for k in self.kept) < self._threshold():
            self.done = True  # even held, within the prediction's tolerance: nothing to watch
            return output
        self._died_in_backward = set()
        me = weakref.ref(self)
        for k in self.kept:
            weakref.finalize(k.storage(), _storage_died, me, k.key).atexit = False
        hooked = [loss] if loss is not None and loss.requires_grad else grads
        fire = self._reached()
        for t in hooked:
            t.register_hook(fire)
        return output

    def _threshold(self) -> float:
        peak = self.predicted_peak_bytes
        return max(MIN_SHARE * peak if peak else 0.0, MIN_BYTES)

    def _reached(self) -> Callable[[torch.Tensor], None]:
        kept, watch = self.kept, weakref.ref(self)

        def fire(grad: torch.Tensor) -> None:
            me = watch()
            if me is None or me.done or me.kept is not kept or me._reached_model:
                return  # a later forward watches its own output; one firing per backward
            me._reached_model = True
            saved_by_loss = tuple(k for k in kept if k.storage() is None and k.key in me._died_in_backward)

            def backward_ended() -> None:
                me.done = True
                me._report(tuple(k for k in kept if k.storage() is not None), saved_by_loss)

            torch.autograd.Variable._execution_engine.queue_callback(backward_ended)

        return fire

    def _died(self, key: tuple[int, int]) -> None:
        """An output's storage died: during a backward (``_current_graph_task_id``) and before backward reached
        the model, the loss computed from it had saved it (NOTE [ an output alive through backward ])."""
        if not self._reached_model and not self.done and torch._C._current_graph_task_id() != -1:
            self._died_in_backward.add(key)

    def _report(self, held: tuple[_Kept, ...], saved_by_loss: tuple[_Kept, ...]) -> None:
        extra = sum(k.nbytes for k in held + saved_by_loss)
        if extra < self._threshold():
            return
        from remat.client.cli_common import format_bytes  # click and all: only on the one step that warns
        what = []
        if held:
            how = "holds them, or views of them" if len(held) > 1 else "holds it, or a view of it"
            what.append(f"{_listed(held, format_bytes)} still alive when backward() ends (the training loop {how})")
        if saved_by_loss:
            it = "them" if len(saved_by_loss) > 1 else "it"
            what.append(f"{_listed(saved_by_loss, format_bytes)} saved by the loss computed from {it}, alive as "
                        f"backward() starts (mse_loss, l1_loss, binary_cross_entropy_with_logits save their input; "
                        f"cross_entropy does not)")
        peak = self.predicted_peak_bytes
        them = "them" if len(held + saved_by_loss) > 1 else "it"
        where = (f"the plan's predicted peak, {format_bytes(peak)}, is for a step that keeps none of {them}, and this "
                 f"step can reach {format_bytes(peak + extra)}" if peak else
                 f"the plan's prediction does not count {them}")
        fix = "Keep only the loss before backward() (loss = outputs.loss; del outputs), or leave" if held else \
            "Leave"
        warnings.warn(f"remat: the model's {'; and '.join(what)}: {where}. {fix} that room in a budget "
                      f"(docs/apply.md, Limits)", RuntimeWarning, stacklevel=user_stacklevel())


def _storage_died(watch: weakref.ref[OutputWatch], key: tuple[int, int]) -> None:
    me = watch()
    if me is not None:
        me._died(key)


def _listed(kept: tuple[_Kept, ...], format_bytes: Callable[[int], str]) -> str:
    """``output['logits'] (float32[2, 256, 50257], 98.2 MiB) is``; ``output[0] (…), output[1] (…), 9.1 MiB in
    all, are``."""
    if len(kept) == 1:
        return f"{kept[0].name} ({kept[0].what}, {format_bytes(kept[0].nbytes)}) is"
    names = ", ".join(f"{k.name} ({k.what})" for k in kept)
    return f"{names}, {format_bytes(sum(k.nbytes for k in kept))} in all, are"

