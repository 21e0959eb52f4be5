"""NEFTune under CP: each token gets the noise the run without CP gives it.

Note [NEFTune under CP]
-----------------------
NEFTune (transformers' ``neftune_post_forward_hook``) adds to the input embeddings
``[B, S, E]`` of a training forward uniform noise in ``[-m, m]``, ``m = alpha / sqrt(S * E)``,
drawn with ``torch.zeros_like(embeddings).uniform_(...)``. Under the mixin the model sees
one packed row ``[1, L, E]`` per CP rank (`flatten_rows`, then this rank's shard), so the
hook as it is would size the noise by the shard (``sqrt(cp)`` times too large at cp > 1,
by ``B * S`` at cp 1 with ``B > 1`` rows) and draw a different number of values.

`NeftuneUnderCP` replaces it: it draws the noise of the collator's batch, ``[B, S, E]`` in
the embeddings' dtype and device, exactly as the hook without CP draws it (same shape, same
generator, so the same values wherever the ranks' generators are where the run without CP
is: every rank is seeded alike and draws the whole batch's noise, so they stay in step),
flattens it into the packed row as `flatten_rows` flattens the tokens, and adds this rank's
positions of it. Every token's noise is then the run without CP's; the cost is drawing the
whole batch's noise on each CP rank (``B x S x E`` numbers, as one process without CP draws).
Where other code draws from the generator differently per rank (dropout, which is not exact
under CP anyway), the noise keeps its distribution but not its values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class NoiseRows:
    """The forward in flight: the collator's rows and this rank's positions of the packed row.

    Attributes:
        rows: ``(B, S)`` of the batch before it was flattened.
        positions_L: this rank's ``[L]`` positions in the packed, padded row ``[1, S_pad]``.
        padded_len: ``S_pad`` (``B * S`` rounded up to the CP group's multiple).
    """

    rows: tuple[int, int]
    positions_L: torch.Tensor
    padded_len: int


class NeftuneUnderCP:
    """Forward hook for the input embeddings: NEFTune's noise as the run without CP draws it (Note).

    Args:
        alpha: ``neftune_noise_alpha``.
        rows_of: returns the `NoiseRows` of the forward in flight, or None outside a CP step
            (then the hook is transformers' own: noise sized by the tensor it sees).
    """

    def __init__(self, alpha: float, rows_of: Callable[[], Optional[NoiseRows]]) -> None:
        self.alpha, self.rows_of = float(alpha), rows_of

    def __call__(self, module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        where = self.rows_of()
        if where is None:
            return output + self._noise(tuple(output.shape), output)
        B, S = where.rows
        E = output.shape[-1]
        noise_BSE = self._noise((B, S, E), output)
        noise_TE = noise_BSE.reshape(B * S, E)
        if where.padded_len > B * S:
            noise_TE = torch.cat([noise_TE, noise_TE.new_zeros(where.padded_len - B * S, E)])
        return output + noise_TE.index_select(0, where.positions_L.to(output.device)).reshape(output.shape)

    def _noise(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Uniform noise of `shape` drawn as transformers' hook draws it for embeddings of that shape."""
        magnitude = self.alpha / torch.sqrt(torch.tensor(shape[1] * shape[2]))
        return torch.zeros(shape, dtype=like.dtype, device=like.device).uniform_(-magnitude, magnitude)
