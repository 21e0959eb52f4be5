"""torchtitan's mixture-of-experts layers under block-diagonal CP: experts in the parameters' dtype, padding not
counted in the load balancing (issue #52).

Note [torchtitan's experts under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A MoE layer is per token, so sharding a row over CP ranks changes nothing it computes per token. Two things it
computes over the row's tokens do change, and each is made the unsharded run's here:

* the experts' weight gradients. torchtitan 0.3.0's `GroupedExperts` casts its tokens and weights to bfloat16
  whatever the training dtype, so each expert's weight gradient is a bfloat16-rounded sum over the tokens this
  rank routed to it. Split over CP ranks, the sum is rounded per rank and then summed (by FSDP, in float32): the
  gradients move by bfloat16's rounding (4e-3 relative, measured on deepseek_v3's debugmodel), Adam makes that
  ~lr in the elements whose gradient is small, and after 3 steps the experts' weights were 7e-4 apart while the
  losses agreed to 6e-8. No reduction order makes two bfloat16 roundings one. `route_experts` gives every layer
  `ParamDtypeGroupedExperts`, which computes in its (unsharded) weights' dtype: under torchtitan's bfloat16
  mixed precision that is bfloat16, as torchtitan's; in a float32 run, float32, and the CP run's gradients are
  the unsharded run's to float32 rounding. It is routed at every ``cp_degree`` (1 included), so the runs with
  and without CP compute the same model. An experts module of another type (torchtitan's float8 / MXFP8
  converters, gpt-oss' experts) is refused at ``cp_degree > 1``: it rounds per rank's tokens in its own way.
* the load balancing statistics. torchtitan's router counts the tokens it sends to each expert
  (``tokens_per_expert_E``), sums the counts over the data ranks and moves each expert's bias by the sign of its
  count against the mean. The padding the trainer adds to a row (so every shard splits where torchtitan splits
  it) is routed too, and the run without CP has none (or another amount): the counts, and so the biases, would
  differ. `UncountPadding` takes this rank's padding tokens' routes back out of the count in the same forward
  (a recomputed forward counts and takes back again), so every count is the real tokens' alone, whatever the
  padding.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle
from torchtitan.models.common.moe import GroupedExperts, MoE

from ..step.slot import current_step

__all__ = (
    "ParamDtypeGroupedExperts",
    "UncountPadding",
    "balances_expert_load",
    "route_experts",
    "uncount_padding",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ParamDtypeGroupedExperts(GroupedExperts):
    """torchtitan's `GroupedExperts` computing in its weights' dtype instead of always bfloat16 (Note
    [torchtitan's experts under CP]). Same parameters, same grouped GEMMs (``_grouped_mm``), same SwiGLU.

    ``x_RD`` ``[R, D]``: the routed tokens grouped by expert; ``num_tokens_per_expert_E`` ``[E]``; returns
    ``[R, D]`` in ``x_RD``'s dtype.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1_EFD, w2_EDF, w3_EFD = _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        a_RD = x_RD.to(w1_EFD.dtype)
        h_RF = F.silu(self._grouped_mm(A=a_RD, B_t=w1_EFD.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=a_RD, B_t=w3_EFD.transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=w2_EDF.transpose(-2, -1), offs=offsets_E).type_as(x_RD)


def route_experts(model_config: Any, cp_degree: int) -> Any:
    """A copy of `model_config` whose every `GroupedExperts` config is `ParamDtypeGroupedExperts` (Note
    [torchtitan's experts under CP]); a model without experts comes back as an equal copy.

    Raises:
        ValueError: at ``cp_degree > 1``, an experts config of another type (a subclass of torchtitan's).
    """
    routed = copy.deepcopy(model_config)
    for fqn, cfg, parent, attr in list(routed.traverse(GroupedExperts.Config)):
        if isinstance(cfg, ParamDtypeGroupedExperts.Config):
            continue
        if type(cfg) is not GroupedExperts.Config:
            if cp_degree > 1:
                raise ValueError(
                    f"{type(cfg).__qualname__} (at {fqn}) computes its experts its own way (quantized or in "
                    "bfloat16), rounding each rank's sum over its tokens; under blockdiag_cp.cp_degree > 1 the "
                    "experts' gradients could not equal the run without CP. Use torchtitan's GroupedExperts "
                    "(no float8/MXFP8 converter on the experts), or cp_degree 1")
            continue
        new = ParamDtypeGroupedExperts.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return routed


def balances_expert_load(model_config: Any) -> bool:
    """Whether some `MoE` layer of `model_config` balances its experts' load (``load_balance_coeff`` set: torchtitan
    then counts the tokens routed to each expert)."""
    return any(cfg.load_balance_coeff is not None for _, cfg, _, _ in model_config.traverse(MoE.Config))


class UncountPadding:
    """A forward hook on a `MoE` layer's router: takes this rank's padding tokens' routes back out of the layer's
    ``tokens_per_expert_E`` (Note [torchtitan's experts under CP]). Outside a blockdiag-cp step, or in eval
    (torchtitan counts only in training), it does nothing."""

    def __init__(self, moe: MoE) -> None:
        self.moe = moe

    def __call__(self, router: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.moe.training:
            return
        padding_L = _step_padding()
        if padding_L is None:
            return
        topk_expert_ids_BLK = _local(output[1])  # EP 1: every TP rank holds this CP rank's whole shard
        if topk_expert_ids_BLK.shape[:2] != (1, padding_L.numel()):
            raise RuntimeError(f"the router's {tuple(topk_expert_ids_BLK.shape)} routes are not this rank's shard "
                               f"of {padding_L.numel()} tokens")
        routes = topk_expert_ids_BLK[0][padding_L.to(topk_expert_ids_BLK.device)].flatten()
        counts_E = _local(self.moe.tokens_per_expert_E)
        with torch.no_grad():
            counts_E.sub_(torch.bincount(routes, minlength=counts_E.numel()).to(counts_E.dtype))


def _step_padding() -> Optional[torch.Tensor]:
    """``[L]`` bool: which of this rank's positions in the active step are padding (None: none, or no step)."""
    state = current_step()
    if state is None:
        return None

    def build() -> Optional[torch.Tensor]:
        padding_L = state.geometry.doc_ids.index_select(0, state.positions) == 0  # CPU: no device sync
        return padding_L if bool(padding_L.any()) else None

    return state.derived(("torchtitan_moe_padding",), build)


def uncount_padding(model_parts: list[torch.nn.Module]) -> list[RemovableHandle]:
    """Hook `UncountPadding` on the router of every `MoE` layer that balances its load (``load_balance_coeff``
    set); returns the hooks' handles (none for a model without such layers)."""
    return [moe.router.register_forward_hook(UncountPadding(moe))
            for part in model_parts for moe in part.modules()
            if isinstance(moe, MoE) and moe.load_balance_coeff is not None]
