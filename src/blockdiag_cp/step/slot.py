"""The step slot: the one piece of mutable process state, holding the active step.

Note [Why a process-wide slot, not a ContextVar]
------------------------------------------------
`cp_blockdiag_sdpa` is a drop-in for SDPA, so it finds the step through a lookup,
not an argument. The lookup must work from any thread: activation checkpointing
re-runs a layer's forward inside backward, and the autograd engine may run that on
its own worker thread, where a `ContextVar` set by the training thread is invisible.
So the active step lives in one `StepSlot` per process (`STEP_SLOT`), guarded by a
lock. It is the only module-level object that changes, and it holds:

- the active `StepState` while ``train_ctx()`` is entered (dropped when it exits);
- `EndedStep`: a tensor-free note of the last step, kept only while a checkpointed
  layer of that step may still be recomputed late (Note [Late recompute]);
- one cached `StepState` for a packed row attended outside a step (the transformers
  integration plans once per forward, not once per layer); it is dropped as soon as
  the tensor it was derived from is freed;
- the autograd graphs of compiled attention calls until their backward runs
  (`KeptGraphs`, Note [One opaque op] in step/opaque.py).

`in_step` is a plain bool, read without the lock: it is what ``torch.compile`` guards on
(a compiled function has one graph for inside steps and one for outside), where a lock
or the state object itself (new every step) would break the graph or recompile it.

Note [A step the model never reached]
-------------------------------------
A model whose token mixing never reaches blockdiag-cp (another ``attn_implementation``, its
own attention path, no attention layer at all) runs inside ``train_ctx()`` without an error:
each rank computes on its shard alone, a silently wrong result. So the slot counts the calls
the model's token mixers make in the step (attention calls, through `StepSlot.reach`; routed mixer
calls; a refusal the library raised in the step counts too: the user saw it; `gather_sequence` and
the losses do not: they are not the model's), and a step that exits cleanly without any raises
`ModelRefusal` on leaving ``train_ctx()``: after the user's backward,
before their optimizer step (which the README's loop and the Trainer run after the block).
Every rank runs the same model, so every rank makes no call alike and raises alike; a step
left by an exception is left as it is (that error is the one to see).

Note [Late recompute]
---------------------
Activation checkpointing re-runs a layer's forward during ``loss.backward()``. If
that happens after ``train_ctx()`` exited, the recompute would find no step and
silently compute unsharded attention: wrong gradients. Every attention call inside a
step passes its output through a marker whose backward tells the slot "backward
reached this step". A step that ends before any backward reached it leaves an
`EndedStep` (the shapes and dtypes of its calls, no tensors); an attention call
*during backward*, outside any step, that matches one of them is that step's late
recompute and raises. Once backward reaches the step's markers, or the next
step starts, the note is dropped, so later ordinary checkpointed calls are untouched.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, Iterator, NamedTuple, Optional, Sequence

import torch

from .kept import KeptGraphs

if TYPE_CHECKING:
    from .state import StepState

#: planned rows kept for attention outside a step (one per layer kind of the forward in flight)
IMPLICIT_ENTRIES = 4


class CallSignature(NamedTuple):
    """What every rank's attention call of a step must share (built by `step.attend.call_signature`)."""

    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    query_dtype: torch.dtype
    key_dtype: torch.dtype
    value_dtype: torch.dtype
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    sinks_shape: Optional[tuple[int, ...]] = None

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.query_shape, self.key_shape, self.value_shape)

    @property
    def tensors(self) -> tuple:
        """The shapes and dtypes of q, k and v, without the layer's features."""
        return (*self.shapes, self.query_dtype, self.key_dtype, self.value_dtype)

    @property
    def features(self) -> tuple:
        """The layer's window, softcap and sinks shape."""
        return (self.sliding_window, self.softcap, self.sinks_shape)


@dataclass(frozen=True)
class EndedStep:
    """A step that ended before backward reached its attention (Note [Late recompute]). No tensors."""

    step_id: int
    calls: frozenset[CallSignature]

    def matches(self, call: CallSignature) -> bool:
        """Same shapes and dtypes as one of the step's calls (whatever their window, softcap, sinks)."""
        return any(call.tensors == seen.tensors for seen in self.calls)


@dataclass
class _ActiveStep:
    """Book-keeping of the active step (mutated only under the slot's lock)."""

    state: "StepState"
    step_id: int
    depth: int = 1
    backward_seen: bool = False
    reached: int = 0
    calls: set[CallSignature] = field(default_factory=set)
    agreed: set[CallSignature] = field(default_factory=set)


class StepSlot:
    """Holds the active `StepState` for the whole process (Note [Why a process-wide slot])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: Optional[_ActiveStep] = None
        self._ended: Optional[EndedStep] = None
        self._next_id = 0
        self._implicit: dict[tuple, Optional["StepState"]] = {}
        self._row_marks: dict[int, tuple[int, torch.Tensor]] = {}
        self._row_owners: set[int] = set()
        # keys whose source was freed: finalizers only append here (a finalizer may run inside a locked block,
        # when freeing one cached tensor frees another: taking the lock there would deadlock)
        self._freed: collections.deque = collections.deque()
        self.in_step = False  # written under the lock, read without it (see the module docstring)
        self.kept = KeptGraphs()

    def current(self) -> Optional["StepState"]:
        with self._lock:
            return None if self._active is None else self._active.state

    def reach(self) -> Optional["StepState"]:
        """`current`, for a token mixer of the model that reaches the library (an attention call: it counts
        for Note [A step the model never reached], whether it then succeeds or is refused)."""
        with self._lock:
            if self._active is None:
                return None
            self._active.reached += 1
            return self._active.state

    @contextlib.contextmanager
    def activate(self, state: "StepState") -> Iterator["StepState"]:
        """Make `state` the active step for the duration of the block (re-entrant for the same state)."""
        with self._lock:
            if self._active is not None and self._active.state is not state:
                self._active.reached += 1  # the library refused in the step: Note [A step the model never reached]
                raise RuntimeError(
                    "another block-diagonal CP step is already active; exit its train_ctx() "
                    "before entering the next one"
                )
            if self._active is None:
                self._next_id += 1
                self._active, self._ended = _ActiveStep(state, self._next_id), None
                self.in_step = True
            else:
                self._active.depth += 1
        try:
            yield state
        except BaseException:
            with self._lock:
                self._release()
            raise
        with self._lock:
            ended = self._release()
        if ended is not None and not ended.calls and not ended.reached:
            raise _never_reached()

    def _release(self) -> Optional[_ActiveStep]:
        """Leave one level of the active step; return its book-keeping when the step ended."""
        active = self._active
        active.depth -= 1
        if active.depth:
            return None
        self._active = None  # the step's tensors go with the state
        self.in_step = False
        if active.calls and not active.backward_seen:
            self._ended = EndedStep(active.step_id, frozenset(active.calls))
        return active

    def note_reached(self) -> None:
        """The model reached the library in the active step: a routed token mixer, transformers' attention
        interface, or a refusal of the library (Note [A step the model never reached]). Nothing while
        torch.compile traces: the compiled attention (the opaque op) reaches the step when it runs."""
        if torch.compiler.is_compiling():
            return
        with self._lock:
            if self._active is not None:
                self._active.reached += 1

    def note_call(self, call: CallSignature) -> int:
        """Record an attention call of the active step; return the step's id for its marker."""
        with self._lock:
            self._active.calls.add(call)
            return self._active.step_id

    def needs_agreement(self, call: CallSignature) -> bool:
        """True for the first call of this signature in the active step (Note [Ranks agree] in agree.py)."""
        with self._lock:
            return call not in self._active.agreed

    def mark_agreed(self, call: CallSignature) -> None:
        with self._lock:
            self._active.agreed.add(call)

    def note_backward(self, step_id: int) -> None:
        """Backward reached an attention call of step `step_id` (Note [Late recompute])."""
        with self._lock:
            if self._active is not None and self._active.step_id == step_id:
                self._active.backward_seen = True
            if self._ended is not None and self._ended.step_id == step_id:
                self._ended = None

    def ended_step(self) -> Optional[EndedStep]:
        """The last step, if it ended before backward reached it (else None)."""
        with self._lock:
            return self._ended

    def implicit_state(
        self, sources: Sequence[Optional[torch.Tensor]], tag: Hashable, build: Callable[[], Optional["StepState"]]
    ) -> Optional["StepState"]:
        """The state cached for `sources` (the same tensor objects, unmodified) and `tag`, else `build()`.

        Used outside a step, where every layer of one forward passes the same
        ``position_ids`` / ``cu_seq_lens_q`` / mask tensors: the first layer of each kind
        plans (host work), the others reuse its result with none. A few entries are
        kept (a model alternating local and global layers uses two); an entry is
        dropped when one of its source tensors is freed, so a new tensor never hits it.
        """
        key = (tag, *((id(t), t._version) if t is not None else None for t in sources))
        with self._lock:
            self._forget_freed()
            if key in self._implicit:
                return self._implicit[key]
        state = build()
        with self._lock:
            while len(self._implicit) >= IMPLICIT_ENTRIES:
                self._implicit.pop(next(iter(self._implicit)))
            self._implicit[key] = state
        for t in sources:
            if t is not None:
                weakref.finalize(t, self._freed.append, ("implicit", key))
        return state

    def _forget_freed(self) -> None:
        """Drop the entries whose source was freed (called with the lock held)."""
        while self._freed:
            kind, key = self._freed.popleft()
            if kind == "implicit":
                self._implicit.pop(key, None)
            else:
                self._row_marks.pop(key, None)
                self._row_owners.discard(key)

    def note_row_marks(self, owner: object, length: int, cu_seqlens: Optional[torch.Tensor]) -> None:
        """The documents transformers' mask function marked on the row of `length` tokens that `owner`'s
        (a config's) attention layers are about to attend outside a step (None: none marked, one document).
        Replaced by the next note for `owner`, dropped with it (hf/interface.py, Note [Rows whose layers
        are not handed positions])."""
        key = id(owner)
        with self._lock:
            self._forget_freed()
            known = key in self._row_owners
            self._row_owners.add(key)
            if cu_seqlens is None:
                self._row_marks.pop(key, None)
            else:
                self._row_marks[key] = (length, cu_seqlens)
        if not known:
            weakref.finalize(owner, self._freed.append, ("row marks", key))

    def row_marks(self, owner: object, length: int) -> Optional[torch.Tensor]:
        """The ``cu_seqlens`` last noted for `owner`'s row of `length` tokens, else None."""
        with self._lock:
            self._forget_freed()
            noted = self._row_marks.get(id(owner))
        return noted[1] if noted is not None and noted[0] == length else None


def _never_reached() -> Exception:
    from ..errors import ModelRefusal

    return ModelRefusal(
        "blockdiag-cp: train_ctx() ended without the model calling blockdiag-cp's attention or a routed token mixer: "
        "its tokens were mixed elsewhere (an attn_implementation other than 'blockdiag_cp', an attention of its own "
        "that does not go through transformers' attention interface, or no attention layer at all), each rank on "
        "its shard alone: this step's outputs and gradients are not per document, and are refused (do not apply "
        "them). Load the model with blockdiag_cp.hf.from_pretrained / from_config (they check it) or call "
        "blockdiag_cp.hf.prepare_model(model); a model they refuse trains without CP.",
        "no call reached blockdiag-cp inside the step",
    )


STEP_SLOT = StepSlot()


def current_step() -> Optional["StepState"]:
    """The active step's state, or None outside ``train_ctx()``."""
    return STEP_SLOT.current()
