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
"""

from __future__ import annotations


class CPTypeError(TypeError, ValueError):
    """A value of the wrong type (also a `ValueError`, see Note [Error policy])."""


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
