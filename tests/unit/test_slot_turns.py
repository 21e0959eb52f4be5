"""Steps in flight, one turn at a time (Note [Steps in flight, one turn at a time] in step/slot.py), in one process:
two micro-batches' steps with different documents, their work interleaved as a pipeline schedule interleaves it
(a checkpointed forward of one, the other's forward, then the first one's backward, which recomputes), each
attending with its own documents; and the slot's rules around turns."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from blockdiag_cp import PipelineSteps, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx, make_cp_pipeline_batch_and_ctx
from blockdiag_cp.errors import CPTypeError, ModelRefusal
from blockdiag_cp.step.slot import STEP_SLOT

S, H, D = 12, 2, 4
LAYOUTS = ([1] * 5 + [2] * 7, [1] * 3 + [2] * 4 + [3] * 5)  # two micro-batches, other documents


def step_of(doc_ids):
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.zeros(1, S, dtype=torch.long),
                                                          "_packed_seq_ids": torch.tensor([doc_ids])})
    return ctx


def per_document(q, k, v, doc_ids):
    """Causal attention inside each document, float64, dense: the oracle."""
    ids = torch.tensor(doc_ids)
    mask = (ids[:, None] == ids[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def qkv(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, S, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def test_interleaved_micro_batches_each_attend_with_their_own_documents_forward_backward_and_recompute():
    ctxs = [step_of(ids) for ids in LAYOUTS]
    tickets = [STEP_SLOT.begin(ctx.state) for ctx in ctxs]
    inputs = [qkv(i) for i in range(2)]
    outs = []
    for ticket, (q, k, v) in zip(tickets, inputs):  # the forwards of both (checkpointed: recomputed in backward)
        with STEP_SLOT.turn(ticket):
            outs.append(checkpoint(cp_blockdiag_sdpa, q, k, v, use_reentrant=False))
    for i in (1, 0):  # the backwards in the other order: each recompute must find its own micro-batch's step
        with STEP_SLOT.turn(tickets[i]):
            outs[i].square().sum().backward()
    assert STEP_SLOT.end(tickets) == (True, True)
    for (q, k, v), out, ids in zip(inputs, outs, LAYOUTS):
        ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        want = per_document(*ref_inputs, ids)
        want.square().sum().backward()
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        for got, ref in zip((q, k, v), ref_inputs):
            torch.testing.assert_close(got.grad, ref.grad, rtol=0, atol=1e-12)
    assert not STEP_SLOT.in_flight()


def test_attention_outside_every_turn_while_steps_are_in_flight_is_refused():
    tickets = [STEP_SLOT.begin(step_of(ids).state) for ids in LAYOUTS]
    q, k, v = qkv(0)
    try:
        with pytest.raises(RuntimeError, match="outside the turns of the steps in flight"):
            cp_blockdiag_sdpa(q, k, v)
        with STEP_SLOT.turn(tickets[0]):  # a turn of another step inside a turn: refused
            with pytest.raises(RuntimeError, match="already active"):
                with STEP_SLOT.turn(tickets[1]):
                    pass
    finally:
        assert STEP_SLOT.end(tickets, check_reached=False) == (True, False)  # the refused turn counted as reached
    with pytest.raises(RuntimeError, match="not in flight"):
        with STEP_SLOT.turn(tickets[0]):
            pass
    torch.testing.assert_close(cp_blockdiag_sdpa(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_a_step_no_call_reached_is_refused_when_it_ends():
    ticket = STEP_SLOT.begin(step_of(LAYOUTS[0]).state)
    with STEP_SLOT.turn(ticket):
        pass
    with pytest.raises(ModelRefusal, match="ended without the model calling"):
        STEP_SLOT.end([ticket])


def test_pipeline_steps_and_rows_are_checked_where_they_enter():
    with pytest.raises(ValueError, match="one step per micro-batch, got none"):
        PipelineSteps(())
    with pytest.raises(CPTypeError, match="train_ctxs\\[0\\]"):
        PipelineSteps((object(),))
    with pytest.raises(CPTypeError, match="takes a torch.distributed.pipelining schedule"):
        PipelineSteps((step_of(LAYOUTS[0]),))(object()).__enter__()
    rows = [{"input_ids": torch.arange(S).unsqueeze(0), "_packed_seq_ids": torch.tensor([ids])} for ids in LAYOUTS]
    steps, batch = make_cp_pipeline_batch_and_ctx(None, None, rows)
    assert batch["input_ids"].shape == (2, S) and torch.equal(batch["_packed_seq_ids"], torch.tensor(LAYOUTS))
    assert [s.geometry.doc_ids[:S].tolist() for s in steps.states] == [list(ids) for ids in LAYOUTS]
    assert rows[0].keys() == {"input_ids", "_packed_seq_ids"}  # the rows are not mutated
    with pytest.raises(ValueError, match="at least one row"):
        make_cp_pipeline_batch_and_ctx(None, None, [])
    with pytest.raises(ValueError, match="one length"):
        make_cp_pipeline_batch_and_ctx(None, None, [rows[0], {"input_ids": torch.zeros(1, S + 1, dtype=torch.long)}])
