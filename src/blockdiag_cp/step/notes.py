"""`CallNotes`: what a step's attention calls decided, recorded for the user."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionWork:
    """The vision-tower work of a VLM step per CP rank (Note [One vision tower pass per CP group]).

    Attributes:
        patches_per_rank: ``[W]`` pixel patches each rank encoded.
        flops_per_rank: ``[W]`` their estimated forward FLOPs.
    """

    patches_per_rank: tuple[int, ...] = ()
    flops_per_rank: tuple[float, ...] = ()


class CallNotes:
    """Decisions made per attention call, recorded for the user (append-only).

    ``kernel_fallbacks``: ``{reason: kernel used instead}`` for calls where the
    step's kernel refused (a dtype it lacks, attention dropout) under ``kernel="auto"``.
    """

    def __init__(self) -> None:
        self._fallbacks: dict[str, str] = {}
        self._kinds: dict[int, tuple[str, str]] = {}
        self._vision = VisionWork()
        self._routed_mixers: frozenset[str] = frozenset()

    def record_fallback(self, kernel: str, reason: str) -> None:
        self._fallbacks.setdefault(reason, kernel)

    def record_kind(self, window: int, exchange: str, reason: str) -> None:
        self._kinds[window] = (exchange, reason)

    def record_vision(self, patches: list[int], flops: list[float]) -> None:
        self._vision = VisionWork(tuple(int(p) for p in patches), tuple(float(f) for f in flops))

    def record_routed_mixers(self, kinds: frozenset[str]) -> None:
        self._routed_mixers = self._routed_mixers | kinds

    @property
    def routed_mixers(self) -> frozenset[str]:
        """Layer kinds (``"conv"``, ...) whose mixers the running model routes per document (`mixers.prepare_model`)."""
        return self._routed_mixers

    @property
    def vision(self) -> VisionWork:
        """The vision work of the step per CP rank (empty unless a VLM row was split)."""
        return self._vision

    @property
    def window_exchanges(self) -> dict[int, tuple[str, str]]:
        """``{window: (exchange, reason)}`` for the sliding-window layer kinds of the step."""
        return dict(self._kinds)

    @property
    def kernel_fallbacks(self) -> dict[str, str]:
        return dict(self._fallbacks)
