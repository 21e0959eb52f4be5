"""Varlen call tables for packed-sequence kernels (flash-attn, TransformerEngine THD).

Note [Varlen calls from items]
------------------------------
Varlen kernels take queries and keys packed sequence after sequence (one sequence per
item), described by cumulative lengths. From an `ItemTable` (built once per step) we
derive one call per group of items with the same alignment (causal or full):

    q_rows        [Tq]  local query rows, item after item (padding rows skipped)
    k_rows        [Tk]  key-buffer rows, item after item (a key may repeat when two
                        pieces of one document on this rank see the same prefix)
    cu_seqlens_q  [n+1] int32, cumulative query lengths
    cu_seqlens_k  [n+1] int32, cumulative key lengths
    max_seqlen_q/k      Python ints (host values computed once: no per-layer sync)

Causal items are bottom-right aligned (query i of a sequence sees keys
``j <= i + k_len - q_len``), which is flash-attn's ``causal=True`` and
TransformerEngine's ``padding_causal_bottom_right``.
"""

from __future__ import annotations

import importlib
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ..errors import ensure
from ..plan.ranges import concat_ranges
from .base import AttentionKernel, CallOptions, ItemTable, pad_last, padded_width


@dataclass(frozen=True)
class VarlenCall:
    """One packed kernel call's metadata (Note [Varlen calls from items]); tensors on the device."""

    causal: bool
    window: Optional[int]  # sliding window of the causal sequences (None: full causal)
    q_rows: torch.Tensor
    k_rows: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, dim=0)]).to(torch.int32)


def validate_varlen_call(call: "VarlenCall", num_q_rows: int, num_k_rows: int) -> None:
    """Host checks, once per step: monotone, in bounds, ``q_len <= k_len`` for causal calls.

    The call derives from a validated `ItemTable`, so a failure is a bug here.
    """
    cu_q, cu_k = call.cu_seqlens_q.cpu().long(), call.cu_seqlens_k.cpu().long()
    q_len, k_len = torch.diff(cu_q), torch.diff(cu_k)
    ensure(bool((q_len > 0).all()) and bool((k_len > 0).all()), "empty varlen sequence")
    ensure(not call.causal or bool((q_len <= k_len).all()), "causal varlen sequence with more queries than keys")
    ensure(int(cu_q[-1]) == call.q_rows.numel() and int(cu_k[-1]) == call.k_rows.numel(), "cu_seqlens != rows")
    q_rows, k_rows = call.q_rows.cpu(), call.k_rows.cpu()
    ensure(0 <= int(q_rows.min()) and int(q_rows.max()) < num_q_rows, "query row out of bounds")
    ensure(0 <= int(k_rows.min()) and int(k_rows.max()) < num_k_rows, "key row out of bounds")
    ensure(call.max_seqlen_q == int(q_len.max()) and call.max_seqlen_k == int(k_len.max()), "max lengths")


def varlen_calls(items: ItemTable, device: torch.device) -> tuple[VarlenCall, ...]:
    """One `VarlenCall` per alignment present in `items` (causal first), validated."""
    out = []
    for causal in (True, False):
        keep = items.causal == causal
        if not bool(keep.any()):
            continue
        q_len, k_len = items.q_len[keep], items.k_len[keep]
        call = VarlenCall(
            causal,
            items.window if causal else None,
            concat_ranges(items.q_start[keep], q_len).to(device),
            concat_ranges(items.k_start[keep], k_len).to(device),
            _cumulative(q_len).to(device),
            _cumulative(k_len).to(device),
            int(q_len.max()),
            int(k_len.max()),
        )
        validate_varlen_call(call, items.num_q_rows, items.num_k_rows)
        out.append(call)
    return tuple(out)


def packed_attention(calls: tuple[VarlenCall, ...], q_HLD, k_HND, v_HND, run) -> torch.Tensor:
    """Run ``run(call, q [Tq, H, D], k [Tk, Hk, D], v [Tk, Hk, D]) -> [Tq, H, D]`` per call; scatter to
    ``[H, L, Dv]``. Values of another width than the queries (``Dv != Dk``) reach `run` zero-padded to
    one head dim, and its output is cut back to ``Dv`` (Note [Unequal head dims] in base.py).

    Differentiable (gather/scatter by index); rows in no call are zero.
    """
    (H, L, Dk), Dv = q_HLD.shape, v_HND.shape[-1]
    width = padded_width(Dk, Dv)
    out_LHD = q_HLD.new_zeros(L, H, Dv)
    for call in calls:
        q = pad_last(q_HLD.transpose(0, 1).index_select(0, call.q_rows), width)
        k = pad_last(k_HND.transpose(0, 1).index_select(0, call.k_rows), width)
        v = pad_last(v_HND.transpose(0, 1).index_select(0, call.k_rows), width)
        out_LHD = out_LHD.index_copy(0, call.q_rows, run(call, q, k, v)[..., :Dv].to(q_HLD.dtype))
    return out_LHD.transpose(0, 1)


class VarlenKernel(AttentionKernel):
    """A packed-sequence GPU kernel: varlen call tables once per step, fp16/bf16 calls.

    Its package is imported lazily (a CPU install never needs it); subclasses run
    one `VarlenCall` in `attend_packed`.
    """

    supports_lse = False
    #: the module to import, and the name to tell users to install
    package: ClassVar[str]
    install_name: ClassVar[str]

    def __init__(self) -> None:
        try:
            self.module = importlib.import_module(self.package)
        except ImportError as exc:
            raise ValueError(
                f"kernel={self.name!r} needs {self.install_name}: pip install 'blockdiag-cp[gpu]'"
            ) from exc

    def prepare(self, items: ItemTable, device: torch.device) -> tuple[VarlenCall, ...]:
        return varlen_calls(items, device)

    def check(self, q_HLD: torch.Tensor, dropout_p: float) -> None:
        if q_HLD.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"kernel={self.name!r} runs in float16/bfloat16, got {q_HLD.dtype}; use kernel='sdpa' or autocast"
            )

    def attend(self, calls, q_HLD, k_HND, v_HND, options: CallOptions):
        return packed_attention(
            calls, q_HLD, k_HND, v_HND, lambda call, q, k, v: self.attend_packed(call, q, k, v, options),
        )

    @abstractmethod
    def attend_packed(self, call: VarlenCall, q_THD, k_THD, v_THD, options: CallOptions) -> torch.Tensor:
        """``q [Tq, H, D]``, ``k``/``v`` ``[Tk, Hk, D]`` packed as `call` says -> ``[Tq, H, D]``."""
