"""The step slot: the one piece of mutable process state, holding the step whose work runs now.

Note [Why a process-wide slot, not a ContextVar]
------------------------------------------------
`cp_blockdiag_sdpa` is a drop-in for SDPA, so it finds the step through a lookup,
not an argument. The lookup must work from any thread: activation checkpointing
re-runs a layer's forward inside backward, and the autograd engine may run that on
its own worker thread, where a `ContextVar` set by the training thread is invisible.
So the step lives in one `StepSlot` per process (`STEP_SLOT`), guarded by a lock. It is
the only module-level object that changes, and it holds:

- the steps *in flight* (begun, not yet ended: one for the seed's ``with train_ctx():``,
  one per micro-batch under a pipeline schedule) with what each recorded, and which
  one's *turn* it is now (Note [Steps in flight, one turn at a time]);
- `EndedStep`: a tensor-free note of each step that ended before backward reached it,
  kept only while a checkpointed layer of that step may still be recomputed late
  (Note [Late recompute]);
- one cached `StepState` for a packed row attended outside a step (the transformers
  integration plans once per forward, not once per layer); it is dropped as soon as
  the tensor it was derived from is freed;
- the autograd graphs of compiled attention calls until their backward runs
  (`KeptGraphs`, Note [One opaque op] in step/opaque.py).

`in_step` is a plain bool (a turn is running), read without the lock: it is what
``torch.compile`` guards on (a compiled function has one graph for inside steps and one for
outside), where a lock or the state object itself (new every step) would break the graph or
recompile it.

Note [Steps in flight, one turn at a time]
------------------------------------------
A *step* is one packed row's work on this rank: its forward, its backward, and the
recompute of its checkpointed layers. The seed's loop runs a step in one *turn*:
``with train_ctx(): forward; backward`` begins the step, makes it the running one, and
ends it on exit (`StepSlot.activate`).

A pipeline schedule keeps several micro-batches in flight on a stage: micro-batch k+1's
forward runs before k's backward; zero-bubble schedules split k's backward into an input
part and a weight part that run apart, in any order with other micro-batches' work; a
checkpointed layer of k is recomputed inside whichever of those parts first needs it. Two
facts make one slot enough. Every action a schedule runs names its micro-batch (the stage's
``forward_one_chunk(k)``, ``backward_one_chunk(k)``, ``backward_weight_one_chunk(k)``), and a
process runs one action at a time (autograd's worker threads work for the action that waits
on them). So each micro-batch's step is begun once (`StepSlot.begin`), every action of
micro-batch k is a turn of step k (`StepSlot.turn`: the slot holds step k for the action's
duration, and every lookup in it finds step k, on any thread), and the steps end together
when the schedule's step is over (`StepSlot.end`). What a step records (its attention calls,
the signatures its ranks agreed on, whether backward reached it, whether the model reached
the library) lives with that step, not with the slot, so turns of different steps never mix.
step/micro_batches.py binds a schedule's stages to their micro-batches' steps.

A state passed with the micro-batch as the stage's keyword arguments (as torchtitan passes its
per-micro-batch masks) reaches the forward only: a backward action gets no arguments, and a
recompute gets its layer's inputs. The micro-batch index reaches every action.

Note [Attention outside every turn]
-----------------------------------
While steps are in flight, an attention call or a routed token mixer outside every turn is
refused: it runs on this rank's shard alone, without its micro-batch's documents (a stage
whose actions were not bound to their steps, a forward called around the schedule), and it
would be silently wrong. Outside steps in flight nothing changes: a call is stock SDPA, or a
packed row's per-document attention (transformers' interface), as before.

Note [A step the model never reached]
-------------------------------------
A model whose token mixing never reaches blockdiag-cp (another ``attn_implementation``, its
own attention path, no attention layer at all) runs inside ``train_ctx()`` without an error:
each rank computes on its shard alone, a silently wrong result. So each step counts the calls
the model's token mixers make in its turns (attention calls, through `StepSlot.reach`; routed
mixer calls; a refusal the library raised in the step counts too: the user saw it;
`gather_sequence` and the losses do not: they are not the model's), and a step that ends
cleanly without any raises `ModelRefusal` when it ends: on leaving ``train_ctx()``, after the
user's backward, before their optimizer step (which the README's loop and the Trainer run
after the block); under a pipeline, when the schedule's step is over, if no rank of the pipeline
reached it (a stage of embeddings or the head alone reaches nothing by itself). Every rank runs
the same model, so every rank makes no call alike and raises alike; a step left by an exception
is left as it is (that error is the one to see).

Note [Late recompute]
---------------------
Activation checkpointing re-runs a layer's forward during ``loss.backward()``. If
that happens after ``train_ctx()`` exited, the recompute would find no step and
silently compute unsharded attention: wrong gradients. Every attention call inside a
step passes its output through a marker whose backward tells the slot "backward
reached this step". A step that ends before any backward reached it leaves an
`EndedStep` (the shapes and dtypes of its calls, no tensors); an attention call
*during backward*, outside any turn, that matches one of them is that step's late
recompute and raises. Once backward reaches the step's markers, or the next
step begins, the note is dropped, so later ordinary checkpointed calls are untouched.
(While steps are in flight, every call outside a turn is refused anyway: Note [Attention
outside every turn].)
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
class _Step:
    """Book-keeping of one step in flight (mutated only under the slot's lock): Note [Steps in flight, ...]."""

    state: "StepState"
    step_id: int
    backward_seen: bool = False
    reached: int = 0
    calls: set[CallSignature] = field(default_factory=set)
    agreed: set[CallSignature] = field(default_factory=set)


@dataclass(frozen=True)
class StepTicket:
    """A step in flight (`StepSlot.begin`): what its turns and its end name."""

    step_id: int
    state: "StepState"


class StepSlot:
    """The steps in flight and the one whose turn it is, for the whole process (Note [Why a process-wide slot])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flight: dict[int, _Step] = {}
        self._running: Optional[_Step] = None
        self._depth = 0  # nested turns of the running step
        self._ended: tuple[EndedStep, ...] = ()
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
        """The state of the step whose turn it is (None outside every turn)."""
        with self._lock:
            return None if self._running is None else self._running.state

    def reach(self) -> Optional["StepState"]:
        """`current`, for a token mixer of the model that reaches the library (an attention call: it counts
        for Note [A step the model never reached], whether it then succeeds or is refused)."""
        with self._lock:
            if self._running is None:
                return None
            self._running.reached += 1
            return self._running.state

    @contextlib.contextmanager
    def activate(self, state: "StepState") -> Iterator["StepState"]:
        """The seed's step: begin `state`'s step, run the block as its one turn, end it (re-entrant for the
        same state: an inner block is part of the outer one's turn)."""
        with self._lock:
            running = self._running
            if running is not None and running.state is state:
                self._depth += 1
                inner = True
            else:
                self._refuse_another(running)
                step = self._begin_locked(state)
                self._enter_locked(step)
                inner = False
        try:
            yield state
        except BaseException:
            self._leave(None if inner else StepTicket(step.step_id, state), check_reached=False)
            raise
        self._leave(None if inner else StepTicket(step.step_id, state), check_reached=True)

    def _leave(self, ending: Optional[StepTicket], check_reached: bool) -> None:
        """Leave one level of the running turn, and end the step `ending` (if not None)."""
        with self._lock:
            self._leave_locked()
        if ending is not None:
            self.end([ending], check_reached)

    def begin(self, state: "StepState") -> StepTicket:
        """Put a step of `state` in flight (a pipeline's micro-batch): its work runs in `turn` blocks, and it
        ends with `end`. The notes of steps that ended earlier are dropped (Note [Late recompute])."""
        with self._lock:
            step = self._begin_locked(state)
            return StepTicket(step.step_id, state)

    @contextlib.contextmanager
    def turn(self, ticket: StepTicket) -> Iterator["StepState"]:
        """Make the in-flight step `ticket` the running one for the block (Note [Steps in flight, ...])."""
        with self._lock:
            step = self._flight.get(ticket.step_id)
            if step is None:
                raise RuntimeError(f"blockdiag-cp: step {ticket.step_id} is not in flight (it ended, or never began)")
            if self._running is step:
                self._depth += 1
            else:
                self._refuse_another(self._running)
                self._enter_locked(step)
        try:
            yield step.state
        finally:
            with self._lock:
                self._leave_locked()

    def end(self, tickets: Sequence[StepTicket], check_reached: bool = True) -> tuple[bool, ...]:
        """End the steps `tickets`: each that backward did not reach leaves an `EndedStep` note (Note [Late
        recompute]). Returns whether the model reached each (Note [A step the model never reached]); with
        `check_reached`, `ModelRefusal` if any was not."""
        with self._lock:
            steps = {t.step_id: self._flight.pop(t.step_id) for t in tickets if t.step_id in self._flight}
            self._ended += tuple(EndedStep(s.step_id, frozenset(s.calls)) for s in steps.values()
                                 if s.calls and not s.backward_seen)
        reached = tuple(t.step_id in steps and bool(steps[t.step_id].calls or steps[t.step_id].reached)
                        for t in tickets)
        if check_reached and not all(reached):
            raise never_reached_refusal()
        return reached

    def _begin_locked(self, state: "StepState") -> _Step:
        self._next_id += 1
        step = self._flight[self._next_id] = _Step(state, self._next_id)
        self._ended = ()
        return step

    def _enter_locked(self, step: _Step) -> None:
        self._running, self._depth = step, 1
        self.in_step = True

    def _leave_locked(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._running = None  # the step's tensors stay with its state, in flight until it ends
            self.in_step = False

    def _refuse_another(self, running: Optional[_Step]) -> None:
        if running is not None:
            running.reached += 1  # the library refused in the step: Note [A step the model never reached]
            raise RuntimeError(
                "another block-diagonal CP step is already active; exit its train_ctx() "
                "before entering the next one"
            )

    def note_reached(self) -> None:
        """The model reached the library in the running step: a routed token mixer, transformers' attention
        interface, or a refusal of the library (Note [A step the model never reached]). Nothing while
        torch.compile traces: the compiled attention (the opaque op) reaches the step when it runs."""
        if torch.compiler.is_compiling():
            return
        with self._lock:
            if self._running is not None:
                self._running.reached += 1

    def note_call(self, call: CallSignature) -> int:
        """Record an attention call of the running step; return the step's id for its marker."""
        with self._lock:
            self._running.calls.add(call)
            return self._running.step_id

    def needs_agreement(self, call: CallSignature) -> bool:
        """True for the first call of this signature in the running step (Note [Ranks agree] in agree.py)."""
        with self._lock:
            return call not in self._running.agreed

    def mark_agreed(self, call: CallSignature) -> None:
        with self._lock:
            self._running.agreed.add(call)

    def note_backward(self, step_id: int) -> None:
        """Backward reached an attention call of step `step_id` (Note [Late recompute])."""
        with self._lock:
            step = self._flight.get(step_id)
            if step is not None:
                step.backward_seen = True
            self._ended = tuple(e for e in self._ended if e.step_id != step_id)

    def outside_turns(self, call: Optional[CallSignature], in_backward: bool) -> Optional[str]:
        """Why a call outside every turn must be refused, else None: steps are in flight (Note [Attention outside
        every turn]), or `in_backward` an attention `call` matches a step that ended before backward reached it
        (Note [Late recompute]; None: a routed token mixer, checked for the first only)."""
        with self._lock:
            if self._running is not None:
                return None
            if self._flight:
                return ("attention (or a routed token mixer) ran outside the turns of the steps in flight: under a "
                        "pipeline schedule every stage action must run its micro-batch's step (bind the schedule "
                        "with PipelineSteps(...)(schedule) on every rank), or this rank would mix its shard alone")
            if in_backward and call is not None and any(ended.matches(call) for ended in self._ended):
                return ("attention was recomputed in backward (activation checkpointing) after the block-diagonal "
                        "CP step ended; call loss.backward() inside `with train_ctx():`")
        return None

    def in_flight(self) -> bool:
        """Whether any step is in flight (begun, not ended)."""
        with self._lock:
            return bool(self._flight)

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


def never_reached_refusal() -> Exception:
    """The `ModelRefusal` of a step the model never reached (Note [A step the model never reached])."""
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
    """The state of the step whose turn it is (inside ``train_ctx()``, or a pipeline stage action bound by
    `PipelineSteps`), else None."""
    return STEP_SLOT.current()
