"""How blockdiag-cp reports problems.

Note [Error policy]
-------------------
- A bad *value* from the user (a shape, a length, a knob outside its choices, document
  ids that are not one run per document) is a `ValueError`, raised where the value
  enters the library (batch construction, `CPConfig`, `plan_shards`, the attention
  call), on every rank of the CP group (the ranks-agree check makes a rank whose batch
  was rejected fail every rank instead of leaving them hanging).
- A value of the wrong *type* is a `CPTypeError`: a `TypeError` that is also a
  `ValueError`, so code written against 0.1 (where these were `ValueError`) still
  catches them.
- A requested strategy that cannot serve a step or a call (``halo`` where a rank needs
  keys beyond its left neighbour, a kernel that lacks a dtype or dropout under
  ``kernel="auto"``) falls back to an exact one, *warns once* with the reason, and
  records the reason on the step state (``exchange_reason`` / ``kernel_reason``). An
  explicitly requested kernel does not fall back: it raises.
- A broken internal invariant is an `InvariantError`, raised explicitly (never a bare
  ``assert``, which ``python -O`` strips): it means a bug in blockdiag-cp, not bad input.
- Misuse of the step protocol (two steps active at once, a checkpointed layer
  recomputed after its step ended) is a `RuntimeError` that says what to do instead.
- A *model* blockdiag-cp cannot compute exactly (a token mixer that does not go through the
  library, an argument of its attention the library would drop) is a `ModelRefusal`, a
  `ValueError` naming the model or the layer and saying what to do instead (Note [Every token
  mixer verified] in mixers/verify.py). It is raised before any work: when the model is loaded
  or prepared, before its first layer runs, at its first affected attention call, or when a
  step ends without the model having called the library at all. Each of these depends only on
  the model, its config and the replicated document ids, so inside a step every rank raises the
  same refusal at the same point, before the collective of that call: none is left waiting.
- A *collective* that fails inside the Trainer mixin's step (a peer rank died or did not answer within the
  process group's timeout) is a `CollectiveFailure`, a `RuntimeError` naming the collective, the library code
  that called it, the step and the rank's place, the backend's error chained (Note [A peer that dies mid-step]
  in parallel/failures.py).
"""

from __future__ import annotations


class CPTypeError(TypeError, ValueError):
    """A value of the wrong type (also a `ValueError`, see Note [Error policy])."""


class ModelRefusal(ValueError):
    """A model (or one of its layers) blockdiag-cp cannot compute exactly: refused by name (Note [Error policy]).

    Attributes:
        reason: the refusal in a few words, without the advice (what ``docs/models.md``'s table shows).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class CollectiveFailure(RuntimeError):
    """A collective of a step failed on this rank: a peer died or did not answer in time (Note [Error policy]).
    The backend's exception is its ``__cause__``."""


class InvariantError(AssertionError):
    """An internal invariant of blockdiag-cp failed: a bug, please report it.

    Raised explicitly (``python -O`` does not strip it), unlike a bare ``assert``.
    """


def ensure(condition: bool, message: str) -> None:
    """Raise `InvariantError(message)` unless `condition` holds (host-side checks only)."""
    if not condition:
        raise InvariantError(message)


def check_choice(knob: str, value: object, choices: tuple[str, ...]) -> str:
    """Return `value` if it is one of `choices`, else raise an error listing them
    (`CPTypeError` for a non-string, `ValueError` for an unknown string)."""
    if not isinstance(value, str):
        raise CPTypeError(f"{knob} must be a string, one of {', '.join(choices)}; got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{knob}={value!r} is not supported; choose one of {', '.join(choices)}")
    return value


def warn_moved(old: str, new: str, depth: int = 1) -> None:
    """A `DeprecationWarning` for a knob spelled the old way (it keeps working until 0.14); `new` is its spelling.
    `depth`: the frames between the library's entry and this call (the warning names the user's line)."""
    import warnings

    warnings.warn(f"{old} is deprecated and keeps working until blockdiag-cp 0.14: write {new}",
                  DeprecationWarning, stacklevel=2 + depth)
