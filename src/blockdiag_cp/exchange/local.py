"""`local`: one rank owns the whole row; nothing to exchange (world == 1)."""

from __future__ import annotations

import torch

from ..errors import ensure
from .base import BufferExchange, ExchangeSetup, Traffic


class LocalExchange(BufferExchange):
    """The key buffer is the local rows themselves (used whenever world == 1)."""

    name = "local"

    def __init__(self, setup: ExchangeSetup) -> None:
        ensure(setup.world == 1, "the local exchange serves world == 1 only")
        super().__init__(setup, setup.geometry.plan.rank_positions(0))

    @property
    def traffic(self) -> Traffic:
        return Traffic(0, 0, 0, 0)

    def gather_rows(self, k_LHD: torch.Tensor, v_LHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k_LHD, v_LHD

    def scatter_grads(self, dk_NHD: torch.Tensor, dv_NHD: torch.Tensor, in_grad_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ensure(not in_grad_rows, "this exchange keeps no key gradient rows of its own")
        return dk_NHD, dv_NHD
