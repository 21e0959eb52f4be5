"""The library's own chunked recurrences (torch, any device): the gated delta rule and Mamba2's scan.

Both run ``[B, T]`` rows from a given initial state and return the final state, which is
what the per-document pieces across ranks need (recurrence.py). Both equal their token
loop (`blockdiag_cp.testing`) exactly in exact arithmetic; the tests compare them in
float64. They compute in the input dtype, float32 for half precision.

Note [The chunked gated delta rule]).

Note [The chunked gated delta rule]
-----------------------------------
Token by token (Qwen3-Next's convention, keys and queries L2-normalised, queries scaled by
``dk ** -0.5``): ``S <- exp(g) S``; ``S <- S + k (beta (v - S^T k))^T``; ``o = S^T q``.
Within a chunk of ``C`` tokens with cumulative log-decay ``c``, the updates form a
unit-lower-triangular system (the UT transform): with ``A = strict_lower((beta k) k^T *
exp(c_i - c_j))``, ``u = (I + A)^-1 (beta v)`` and ``w = (I + A)^-1 (beta k exp(c))``; then
per chunk, from the incoming state ``S``:

    v_new = u - w S
    o     = (q exp(c)) S + lower((q k^T) * exp(c_i - c_j)) v_new
    S    <- exp(c_last) S + (k exp(c_last - c))^T v_new

which equals the token loop exactly in exact arithmetic (the tests compare it with the
token loop in float64). It computes in the input dtype (float32 for half precision).

Note [Decays between tokens, summed between them]
-------------------------------------------------
Both kernels weigh token ``j``'s contribution to token ``i`` of a chunk by ``exp(c_i - c_j)``.
Formed as a difference of the cumulative sums, it carries their rounding: ``|c| eps`` absolute, and
``|c|`` grows along the chunk (a log-decay of -20 per token is common: 64 tokens make -1280, so
``c_i - c_j`` is off by about 1e-4 in float32). Autograd then forms each ``g_m``'s gradient as ``+``
the terms with ``m <= i`` minus those with ``m <= j``: two sums that cancel to the terms where
``j < m <= i``, so that rounding comes back amplified: in float32 the gradients of the decay parameters
(``A_log``, ``dt_bias``, Gated DeltaNet's ``a`` projection) were off by about 1e-4 relative from
float64, on one rank and per document alike, and two runs that cut chunks at different places (CP
pieces) differed by as much. So the exponent is summed over the tokens between (`_segment_sums`:
``sum g[j+1 .. i]``, one masked cumulative sum per chunk, ``C^2`` adds as the ``C^2`` exps already
are), and ``c_last - c_j`` its last row, summed on its own (`_sums_to_end`, so no ``C x C`` buffer
outlives the exps): rounding stays relative to the exponent itself, and each ``g_m``'s gradient is
one sum of the terms that contain it. Those gradients are then within the token loop's own float32
error (`tests/distributed/test_mixer_recurrence.py`; a tiny Qwen3.5 in float32: about 5e-7 relative
from float64 on one rank, at cp 2 and cp 3 alike; transformers' torch path, which forms the
difference, stays about 1e-4 off).

Note [The chunked state-space scan (Mamba2)]
--------------------------------------------
Token by token, per head with a scalar decay ``a_t = exp(dt_t A)`` and a state
``S [P, N]``: ``S <- a_t S + dt_t x_t B_t^T``; ``y_t = S C_t`` (the ``D x`` skip is the
caller's). With ``c`` the cumulative log-decay ``dt A`` inside a chunk:

    y     = lower((C B^T) * exp(c_i - c_j)) (dt x) + exp(c) (C S)
    S    <- exp(c_last) S + (dt x exp(c_last - c))^T B

A run's transition is the scalar ``exp(sum dt A)`` per head, so a state entering a
run changes its outputs by ``exp(c_t) (C_t S)``: nothing to rerun (recurrence.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.base import accumulate_dtype

#: tokens per chunk of the chunked kernels (a shorter row uses the power of two that holds it)
CHUNK = 64


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``[B, T]`` rows (Note [The chunked gated delta rule]).

    Args:
        q, k: ``[B, T, Hk, dk]`` (each K head serves ``Hv / Hk`` value heads); v: ``[B, T, Hv, dv]``.
        g: ``[B, T, Hv]`` log-decays (<= 0); beta: ``[B, T, Hv]`` update strengths.
        initial_state: ``[B, Hv, dk, dv]`` (None: zeros).

    Returns:
        ``(o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv])``.
    """
    dtype, out_dtype = accumulate_dtype(v.dtype), v.dtype
    B, T, Hv, dv = v.shape
    q, k = (x.repeat_interleave(Hv // x.shape[2], dim=2) if x.shape[2] != Hv else x for x in (q, k))
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    chunk = _chunk_for(T, chunk)
    pad = (-T) % chunk
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, Hv, n, chunk, -1) for x in (q, k, v))
    g = g.reshape(B, Hv, n, chunk)
    c, to_end = g.cumsum(-1), _sums_to_end(g)  # to_end: c_last - c_j
    beta = beta.reshape(B, Hv, n, chunk, 1)
    decay = _segment_sums(g).exp()  # exp(c_i - c_j), i >= j (Note [Decays between tokens, summed between them])
    system = ((beta * k) @ k.transpose(-1, -2) * decay).tril(-1)  # A, strictly lower
    eye = torch.eye(chunk, dtype=dtype, device=q.device)
    u = torch.linalg.solve_triangular(eye + system, beta * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + system, beta * k * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    state = q.new_zeros((B, Hv, k.shape[-1], dv)) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for qi, ki, ci, ui, wi, di, ei in zip(*(t.unbind(2) for t in (q, k, c, u, w, decay, to_end))):  # unbind: a linear backward
        v_new = ui - wi @ state
        attn = (qi @ ki.transpose(-1, -2)) * di
        outputs.append((qi * ci.exp().unsqueeze(-1)) @ state + attn @ v_new)
        last = ci[..., -1:]
        state = state * last.exp().unsqueeze(-1) + (ki * ei.exp().unsqueeze(-1)).transpose(-1, -2) @ v_new
    o = torch.stack(outputs, dim=2).reshape(B, Hv, n * chunk, dv)[:, :, :T]
    return o.transpose(1, 2).to(out_dtype), state


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dimension (flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_ssd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan over ``[Bt, T]`` rows (Note [The chunked state-space scan (Mamba2)]).

    Args:
        x: ``[Bt, T, H, P]`` inputs; dt: ``[Bt, T, H]`` steps (after softplus and clamping).
        A: ``[H]`` (negative) decay rates; B, C: ``[Bt, T, G, N]`` (each group serves ``H / G`` heads).
        initial_state: ``[Bt, H, P, N]`` (None: zeros).

    Returns:
        ``(y [Bt, T, H, P] in x's dtype, without the D skip; final state [Bt, H, P, N])``.
    """
    dtype, out_dtype = accumulate_dtype(x.dtype), x.dtype
    Bt, T, H, P = x.shape
    B, C = (m.repeat_interleave(H // m.shape[2], dim=2) for m in (B, C))
    x, dt, B, C = (t.transpose(1, 2).to(dtype) for t in (x, dt, B, C))  # [Bt, H, T, ...]
    a = dt * A.to(dtype)[:, None]
    xdt = x * dt.unsqueeze(-1)
    chunk = _chunk_for(T, chunk)
    pad = (-T) % chunk
    xdt, B, C = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (xdt, B, C))
    a = torch.nn.functional.pad(a, (0, pad))
    n = (T + pad) // chunk
    xdt, B, C = (t.reshape(Bt, H, n, chunk, -1) for t in (xdt, B, C))
    a = a.reshape(Bt, H, n, chunk)
    c, to_end = a.cumsum(-1), _sums_to_end(a)  # to_end: c_last - c_j
    decay = _segment_sums(a).exp()  # exp(c_i - c_j), i >= j (Note [Decays between tokens, summed between them])
    inside = ((C @ B.transpose(-1, -2)) * decay) @ xdt  # [Bt, H, n, chunk, P]
    state = x.new_zeros((Bt, H, P, B.shape[-1])) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for ci, inside_i, Ci, xdt_i, Bi, ei in zip(*(t.unbind(2) for t in (c, inside, C, xdt, B, to_end))):  # unbind: a linear backward
        outputs.append(inside_i + ci.exp().unsqueeze(-1) * (Ci @ state.transpose(-1, -2)))
        last = ci[..., -1:]
        carried = (xdt_i * ei.exp().unsqueeze(-1)).transpose(-1, -2) @ Bi
        state = state * last.exp().unsqueeze(-1) + carried
    y = torch.stack(outputs, dim=2).reshape(Bt, H, n * chunk, P)[:, :, :T]
    return y.transpose(1, 2).to(out_dtype), state


def _segment_sums(g: torch.Tensor) -> torch.Tensor:
    """``[..., C, C]``: ``sum g[j+1 .. i]`` at ``(i, j)`` for ``i >= j``, ``-inf`` above the diagonal
    (``g [..., C]``; Note [Decays between tokens, summed between them])."""
    C = g.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    # [..., m, j] = g_m where m > j, else 0; summed over m up to i
    sums = g.unsqueeze(-1).expand(*g.shape, C).masked_fill(lower.T, 0).cumsum(-2)
    return sums.masked_fill(~lower, float("-inf"))


def _sums_to_end(g: torch.Tensor) -> torch.Tensor:
    """``[..., C]``: ``sum g[j+1 .. C-1]`` at ``j`` (``g [..., C]``), the last row of `_segment_sums` without
    its ``[..., C, C]`` buffer."""
    return torch.nn.functional.pad(g[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))


def _chunk_for(T: int, chunk: int) -> int:
    """`chunk`, or the smallest power of two holding a shorter row (a short piece is not padded to 64)."""
    return min(chunk, 1 << max(T - 1, 0).bit_length())
