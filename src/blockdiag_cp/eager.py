"""`eager_under_compile`: host work that torch.compile must run eagerly, not trace.

The routed token mixers and their hooks plan on the host (Note [Routed token mixers] in
mixers/routing.py), as do a few refusals; under torch.compile they run as plain Python, a
graph break around each. ``torch.compiler.disable`` would say so at import, but applying it
imports torch._dynamo (1.5 s per process, paid by every gloo rank and torchrun worker that
never compiles); this decorator applies it only when a compile is tracing the call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager_under_compile(fn: F) -> F:
    """`fn`, run eagerly (``torch.compiler.disable``) when torch.compile traces a call to it."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
