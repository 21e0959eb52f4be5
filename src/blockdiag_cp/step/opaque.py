"""The attention as one opaque op, for ``torch.compile`` (Note [One opaque op]).

Note [One opaque op]
--------------------
A CP attention call does host work that a compiler must not trace: it finds the active
step (under the slot's lock), runs the ranks-agree all-gather on a step's first call,
builds point-to-point ops, and reads routing and call tables that change with every row.
So while dynamo traces, the attention is one custom op, ``blockdiag_cp::attention``
(`torch.library`). The graph holds one opaque call per layer; its fake implementation
gives the output's shape (the queries'), and at run time the op runs the eager attention,
finding the active step *then*. Nothing it receives depends on the row (tensors, the
layer's scale, window, softcap and dropout), so a new row never recompiles it. The only
Python state the traced code reads is `StepSlot.in_step`, a plain bool: a function
compiled inside and outside steps has one graph for each.

Three kinds of settled `AttentionCall` share the op (its ``kind`` argument), chosen by
`dispatch.attend` (Note [One way down] in dispatch.py), each run by `attend.attend_eagerly`:

    step   inside a step: the active step's CP attention
    row    outside a step, one packed row through transformers
    stock  outside a step, a cp_blockdiag_sdpa call that could be a CP layer's late
           recompute (one row, keys = queries, no mask): checked, then stock SDPA

Backward. The op's real forward builds the eager attention's own autograd graph on
detached inputs (the exchange's collectives and the kernel, exactly as without
compile: the same saved tensors, no recompute) and keeps it in `KeptGraphs` under a
small integer handle, its second output. Its backward, ``blockdiag_cp::attention_backward``,
runs that graph once with the upstream gradient. A kept graph goes when its backward
ran or when its handle tensor dies (a forward whose backward never runs; the first
forward of a checkpointed layer, whose recompute keeps its own). Under a non-reentrant
checkpoint around a compiled layer the graph saves through the checkpoint's hooks like any
other op of the layer (the same saves in its forward and its recompute).

Inside the op, autograd's dispatch keys are excluded (it runs below autograd); the
forward and backward re-enable them the way torch's own ``leaf_function`` does
(`_autograd_on`). The outputs are fresh tensors (copies where they would alias the kept
graph), so the compiler may reuse their buffers. Attention dropout draws its mask from a
seed drawn in the graph (a random op the compiler saves rather than recomputes), so a
checkpointed layer's recompute draws the same mask as its forward.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..errors import ensure
from .attend import attend_eagerly, autocast_inputs
from .call import AttentionCall, LayerFeatures
from .kept import KeptGraph
from .slot import STEP_SLOT

OP = "blockdiag_cp::attention"
#: the settled kinds of call the op runs (a call `refused_if_packed` runs eagerly: Note [One way down])
OP_KINDS = ("step", "row", "stock")
#: dispatch keys the op's real implementation runs without (it is called below autograd)
_AUTOGRAD_KEYS = tuple(
    getattr(torch._C.DispatchKey, name)
    for name in ("ADInplaceOrView", "AutogradFunctionality", "AutogradOther", "AutogradNestedTensor")
    if hasattr(torch._C.DispatchKey, name)
)
_TRACING_KEYS = tuple(
    getattr(torch._C.DispatchKey, name) for name in ("Python", "PythonDispatcher") if hasattr(torch._C.DispatchKey, name)
)


def opaque_attention(call: AttentionCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The settled `call` (kind ``"step"``, ``"row"`` or ``"stock"``) as one traceable op: ``query [B, H, S, D]``,
    ``key``/``value [B, Hk, S, D]`` -> ``[B, H, S, Dv]`` (contiguous). The inputs enter in the autocast dtype (as
    SDPA takes them): the fake output takes the queries' dtype."""
    ensure(call.kind in OP_KINDS and call.refused_if_packed is None, f"no opaque attention for a {call.kind!r} call")
    query, key, value = autocast_inputs(query, key, value)
    features = call.features
    sinks, scale, softcap = features.sinks, call.scale, features.softcap
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, sinks))
    # dropout draws from a seed drawn here, in the graph: a recompute (checkpointing) reuses it
    seed = torch.randint(0, 2**62, (), dtype=torch.int64) if call.dropout_p > 0 else None
    out, _ = torch.ops.blockdiag_cp.attention(
        query, key, value, sinks, call.position_ids, call.cu_seq_lens, call.attn_mask, seed, call.kind,
        None if scale is None else float(scale), float(call.dropout_p), features.sliding_window,
        None if softcap is None else float(softcap), bool(call.enable_gqa), bool(call.is_causal), needs_grad)
    return out


@torch.library.custom_op(OP, mutates_args=())
def _attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor], cu_seq_lens: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
    seed: Optional[torch.Tensor], kind: str, scale: Optional[float], dropout_p: float, sliding_window: Optional[int],
    softcap: Optional[float], enable_gqa: bool, is_causal: bool, needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = (query, key, value) if sinks is None else (query, key, value, sinks)
    marks = (position_ids, cu_seq_lens, attn_mask)
    options = (kind, scale, dropout_p, sliding_window, softcap, enable_gqa, is_causal)
    with _seeded(seed, query.device):
        if not needs_grad:
            with torch.no_grad():
                out = _run(tuple(t.detach() for t in tensors), marks, *options)
            return _fresh(out, tensors), torch.tensor(0, dtype=torch.int64)
        leaves = tuple(t.detach().requires_grad_(True) for t in tensors)
        with _autograd_on():
            out = _run(leaves, marks, *options)
    handle = STEP_SLOT.kept.keep(KeptGraph(out, leaves))
    return _fresh(out, tensors, copy=True), handle


@_attention.register_fake
def _attention_fake(query, key, value, sinks, position_ids, cu_seq_lens, attn_mask, seed, kind, scale, dropout_p,
                    sliding_window, softcap, enable_gqa, is_causal, needs_grad):
    return query.new_empty((*query.shape[:-1], value.shape[-1])), torch.empty((), dtype=torch.int64)


@torch.library.custom_op("blockdiag_cp::attention_backward", mutates_args=())
def _attention_backward(
    handle: torch.Tensor, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    sinks: Optional[torch.Tensor],
) -> list[torch.Tensor]:
    graph = STEP_SLOT.kept.take(int(handle))
    with _autograd_on():
        grads = torch.autograd.grad(graph.output, graph.inputs, grad_out.to(graph.output.dtype), allow_unused=True)
    return [torch.zeros_like(t) if g is None else g.to(t.dtype).contiguous() for g, t in zip(grads, graph.inputs)]


@_attention_backward.register_fake
def _attention_backward_fake(handle, grad_out, query, key, value, sinks):
    inputs = (query, key, value) if sinks is None else (query, key, value, sinks)
    return [t.new_empty(t.shape) for t in inputs]


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, sinks = inputs[:4]
    ctx.save_for_backward(output[1], query, key, value, sinks)


def _backward(ctx, grad_out: torch.Tensor, _grad_handle):
    handle, query, key, value, sinks = ctx.saved_tensors
    grads = torch.ops.blockdiag_cp.attention_backward(handle, grad_out, query, key, value, sinks)
    return (*grads[:3], grads[3] if sinks is not None else None, *(None,) * 12)


_attention.register_autograd(_backward, setup_context=_setup_context)


def _run(tensors, marks, kind, scale, dropout_p, window, softcap, enable_gqa, is_causal) -> torch.Tensor:
    """The eager attention of the call the op's arguments spell (Note [One opaque op])."""
    query, key, value = tensors[:3]
    sinks = tensors[3] if len(tensors) > 3 else None
    position_ids, cu_seq_lens, attn_mask = marks
    call = AttentionCall(kind, LayerFeatures(window, softcap, sinks), scale, dropout_p, enable_gqa, is_causal,
                         attn_mask, position_ids, cu_seq_lens)
    return attend_eagerly(call, query, key, value)


def _fresh(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], copy: bool = False) -> torch.Tensor:
    """`out` as the op returns it: detached, contiguous, the queries' dtype, sharing storage with
    no input and (`copy`) not with the kept graph's output (its saved tensors may include it)."""
    out = out.detach().to(inputs[0].dtype)
    shared = any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in inputs)
    if copy or shared or not out.is_contiguous():
        return out.clone(memory_format=torch.contiguous_format)
    return out


@contextlib.contextmanager
def _seeded(seed: Optional[torch.Tensor], device: torch.device) -> Iterator[None]:
    """With a `seed` (attention dropout), the generators of the CPU and `device` seeded from it, then
    restored: the forward and its recompute under checkpointing draw the same dropout mask."""
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else [], device_type="cuda"):
        torch.random.default_generator.manual_seed(int(seed))
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(int(seed))  # this device only
        yield


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Grad mode and autograd's dispatch keys back on, inside the op (which runs below autograd)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in _TRACING_KEYS:
        if include.has(name):
            include = include.remove(name)
    for name in _AUTOGRAD_KEYS:
        if exclude.has(name):
            exclude = exclude.remove(name)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield
