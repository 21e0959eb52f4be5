"""One CP step, from the batch to the frozen state the attention layers read.

    batch.py     make_cp_blockdiag_batch_and_ctx: pad, shard, build the step (the entry)
    world.py     make_cp_world_batch_and_ctx: every replica's row planned over all dp x cp ranks
    doc_ids.py   which document each position belongs to (0 = padding)
    rows.py      a collator's B rows as one packed row
    agree.py     every rank of the CP group holds the same row (one small collective)
    state.py     StepState: plan, geometry, exchange routing and kernel call tables, built once
    notes.py     what the step's calls decided (fallbacks, window kinds, vision work)
    call.py      AttentionCall: an attention call as its entry names it; LayerFeatures
    dispatch.py  attend: the one choice of compiled op or eager path (Note [One way down])
    opaque.py    the attention as one custom op for torch.compile (Note [One opaque op])
    attend.py    the eager attention: inside the step, one row's outside a step, stock SDPA
    slot.py      the active step, readable from autograd's recompute threads
    kept.py      autograd graphs of compiled attention calls, kept until their backward
    gather.py    gather_sequence: unshard logits or hidden states
"""
