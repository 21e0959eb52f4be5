"""Parity cases: one packed row and one configuration, run under CP and compared with the oracle."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .oracle import doc_ids_from_lengths, oracle_attention


@dataclass(frozen=True)
class ParityCase:
    """One packed row and configuration to compare against the oracle."""

    segments: tuple[int, ...]
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 8
    kv_exchange: str = "auto"
    kernel: str = "auto"
    layout: str = "contiguous"
    checkpoint: Optional[str] = None  # None, "reentrant" or "non_reentrant"
    dtype: str = "float64"
    seed: int = 0
    device: str = "cpu"
    window: Optional[int] = None  # sliding window (keys (q - w, q])
    softcap: Optional[float] = None
    sinks: bool = False  # one learned logit per head (its gradient is checked too)
    ulysses_degree: Any = 1  # head-parallel degree (int or "auto")
    v_head_dim: Optional[int] = None  # the values' head dim (None: head_dim; MLA models differ)

    @property
    def doc_ids(self) -> torch.Tensor:
        return doc_ids_from_lengths(self.segments)

    @property
    def value_dim(self) -> int:
        """``Dv``: the values' (and the output's) head dim."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


@dataclass
class ParityResult:
    """One rank's comparison with the oracle, and what it computed (float64, CPU).

    ``output`` is this rank's ``[H, L, Dv]`` rows; ``input_grad`` the ``[1, S, X]``
    input gradient summed over the CP group.
    """

    case: ParityCase
    out_err: float
    grad_err: float
    exchange: str
    kernel: str
    traffic_rows: tuple[int, int, int, int]
    output: Optional[torch.Tensor] = None
    input_grad: Optional[torch.Tensor] = None


def _case_tensors(case: ParityCase) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Full-row inputs ``[1, S, (H + Hk) D + Hk Dv]``, upstream gradient ``[H, S, Dv]`` and sinks ``[H]`` (or
    None), the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + case.seed)
    S = case.doc_ids.numel()
    width = (case.heads + case.kv_heads) * case.head_dim + case.kv_heads * case.value_dim
    dtype = getattr(torch, case.dtype)
    x = torch.randn(1, S, width, generator=gen, dtype=torch.float64).to(device=case.device, dtype=dtype)
    grad = torch.randn(case.heads, S, case.value_dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(case.heads, generator=gen, dtype=torch.float64).to(case.device, dtype) if case.sinks else None
    return x, grad.to(case.device), sinks


def _split_qkv(x_1SX: torch.Tensor, case: ParityCase) -> tuple[torch.Tensor, ...]:
    """``[1, S, (H + Hk) D + Hk Dv]`` -> q ``[1, H, S, D]``, k ``[1, Hk, S, D]``, v ``[1, Hk, S, Dv]``."""
    H, Hk, D, Dv = case.heads, case.kv_heads, case.head_dim, case.value_dim
    q, k, v = torch.split(x_1SX, [H * D, Hk * D, Hk * Dv], dim=-1)
    return tuple(t.reshape(1, t.shape[1], -1, d).transpose(1, 2) for t, d in ((q, D), (k, D), (v, Dv)))


def oracle_case(case: ParityCase, dtype: torch.dtype = torch.float64):
    """Oracle output ``[H, S, Dv]``, input gradient ``[1, S, X]`` and sinks gradient ``[H]`` (or None),
    computed in `dtype`, as float64.

    In float64 this is the ground truth; in the case's low precision it is the dense
    reference's own rounding error, the yardstick for low-precision tolerances.
    """
    x, grad, sinks = _case_tensors(case)
    x = x.to(dtype).requires_grad_(True)
    sinks = None if sinks is None else sinks.to(dtype).requires_grad_(True)
    q, k, v = _split_qkv(x, case)
    out = oracle_attention(q[0], k[0], v[0], case.doc_ids.to(x.device), 1.0 / math.sqrt(case.head_dim),
                           case.window, case.softcap, sinks)
    (out.to(torch.float64) * grad).sum().backward()
    sinks_grad = None if sinks is None else sinks.grad.to(torch.float64)
    return out.detach().to(torch.float64), x.grad.to(torch.float64), sinks_grad


def reference_error(case: ParityCase) -> tuple[float, float]:
    """Max output and gradient error of the dense reference run in the case's dtype."""
    out64, grad64, _ = oracle_case(case)
    out_lo, grad_lo, _ = oracle_case(case, getattr(torch, case.dtype))
    return float((out_lo - out64).abs().max()), float((grad_lo - grad64).abs().max())


def run_parity_case(case: ParityCase, cp_mesh) -> ParityResult:
    """Run `case` on this rank of `cp_mesh` (None: one process) and compare with the oracle."""
    from .. import CPConfig, HeadsConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    x, grad, sinks = _case_tensors(case)
    x.requires_grad_(True)
    sinks = None if sinks is None else sinks.requires_grad_(True)
    config = CPConfig(kv_exchange=case.kv_exchange, kernel=case.kernel, layout=case.layout,
                      heads=HeadsConfig(ulysses_degree=case.ulysses_degree, attention_heads=(case.heads, case.kv_heads)))
    batch = {"inputs_embeds": x, "_packed_seq_ids": case.doc_ids.unsqueeze(0).to(x.device)}
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch, config=config)
    with train_ctx() as state:
        positions = state.positions
        q, k, v = _split_qkv(batch["inputs_embeds"], case)
        attend = lambda q, k, v: cp_blockdiag_sdpa(q, k, v, enable_gqa=True, sliding_window=case.window,
                                                   softcap=case.softcap, sinks=sinks)
        if case.checkpoint is None:
            out = attend(q, k, v)
        else:
            reentrant = case.checkpoint == "reentrant"
            out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=reentrant)
        S = case.doc_ids.numel()
        positions = positions.to(x.device)
        grad_local = torch.zeros(case.heads, positions.numel(), case.value_dim, dtype=torch.float64, device=x.device)
        real = positions < S
        grad_local[:, real] = grad[:, positions[real]]
        (out[0].to(torch.float64) * grad_local).sum().backward()
    x_grad = x.grad.to(torch.float64)
    sinks_grad = None if sinks is None else sinks.grad.to(torch.float64)
    if cp_mesh is not None and cp_mesh.size() > 1:
        dist.all_reduce(x_grad, group=cp_mesh.get_group())
        if sinks_grad is not None:
            dist.all_reduce(sinks_grad, group=cp_mesh.get_group())
    ref_out, ref_grad, ref_sinks_grad = oracle_case(case)
    grad_err = float((x_grad - ref_grad).abs().max())
    if sinks_grad is not None:
        grad_err = max(grad_err, float((sinks_grad - ref_sinks_grad).abs().max()))
    expected = torch.zeros(case.heads, positions.numel(), case.value_dim, dtype=torch.float64, device=x.device)
    expected[:, real] = ref_out[:, positions[real]]
    t = state.traffic
    return ParityResult(
        case,
        out_err=float((out[0].detach().to(torch.float64) - expected).abs().max()),
        grad_err=grad_err,
        exchange=state.exchange_for(case.window).name,
        kernel=state.kernel.name,
        traffic_rows=(t.sent_fwd, t.recv_fwd, t.sent_bwd, t.recv_bwd),
        output=out[0].detach().to(torch.float64).cpu(),
        input_grad=x_grad.cpu(),
    )


# ---------------------------------------------------------------------------
# Spawning gloo process groups on 127.0.0.1


def parity_worker(rank: int, world: int, cases: Sequence[ParityCase]) -> list[ParityResult]:
    """Spawned entry: run every case on a 1-D CP mesh of the whole world."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return [run_parity_case(case, mesh["cp"]) for case in cases]


# ---------------------------------------------------------------------------
# A pool of gloo ranks that serves many small tasks (property-based tests)
