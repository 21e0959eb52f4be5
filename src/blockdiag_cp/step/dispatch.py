"""`attend`: for every attention call, the one place that picks the compiled op or the eager path.

Note [One way down]
-------------------
An entry only names its call (an `AttentionCall`, call.py) and hands it, with q, k and v, to
`attend`. From there a query goes one way down, and nothing calls back into an entry:

    cp_blockdiag_sdpa (attention.py)       blockdiag_cp_attention (hf/interface.py)
      AttentionCall("sdpa")                  AttentionCall("step") in a step, ("row") on a packed row
                         \\                  /
           step/dispatch.py   attend: "sdpa" settled ("step" inside a step, "stock" outside);
                              traced or eager, decided here and nowhere else
               |  eager                         \\  traced (torch.compile)
               |                         step/opaque.py  the custom op blockdiag_cp::attention
               |                                /  (run time: its real forward, the eager path)
           step/attend.py     attend_eagerly, by kind:
                                step   the active step, found now -> attend_active_step
                                row    the row's one-rank step, planned once per forward
                                stock  the late-recompute check -> F.scaled_dot_product_attention
                              -> attend_in_step: the layer's exchange and kernel
           exchange/          the K/V rows the local queries see -> kernels/  the fused attention

Traced, two calls do not become the op. A row whose model needs its documents counted on the
host (`AttentionCall.refused_if_packed`) runs the eager path under a graph break. A stock call
that cannot be a CP layer's late recompute (a mask, several rows, keys that are not the
queries) is stock SDPA, traced as it is. Every other call is the op (Note [One opaque op] in
opaque.py). Each branch is one call down: nothing returns to `attend` to go down again.
"""

from __future__ import annotations

import torch

from .attend import attend_eagerly, stock_sdpa
from .call import AttentionCall
from .opaque import opaque_attention
from .slot import STEP_SLOT


def attend(call: AttentionCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`call` on ``query [B, H, S, Dk]``, ``key [B, Hk, S, Dk]`` and ``value [B, Hk, S, Dv]`` -> ``[B, H, S, Dv]``
    (inside a step ``B = 1`` and ``S`` is this rank's shard length): the compiled op while torch.compile
    traces, else the eager path (Note [One way down])."""
    call = call.settled(STEP_SLOT.in_step)  # a plain bool: what a compiled graph guards on
    if not torch.compiler.is_compiling():
        return attend_eagerly(call, query, key, value)
    if call.refused_if_packed is not None:  # host work on the planned row: eagerly, a graph break
        return torch.compiler.disable(attend_eagerly)(call, query, key, value)
    if call.kind == "stock" and not may_be_a_late_recompute(call, query, key):
        return stock_sdpa(call, query, key, value)
    return opaque_attention(call, query, key, value)


def may_be_a_late_recompute(call: AttentionCall, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether a stock call could be a CP layer recomputed after its step (one row, keys = queries, no
    mask): traced, such a call is the op, whose run time checks (Note [Late recompute] in slot.py)."""
    return call.attn_mask is None and query.shape[0] == 1 and key.shape[-2] == query.shape[-2]
