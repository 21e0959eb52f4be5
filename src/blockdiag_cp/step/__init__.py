"""One CP step, from the batch to the frozen state the attention layers read.

    pipeline.py  the one step pipeline both entries run: inputs, read, agree, plan, move, heads, state
    inputs.py    the sequence-aligned batch keys, their checks and padding
    batch.py     make_cp_blockdiag_batch_and_ctx: the row source of one replica's row (pad and slice)
    world.py     make_cp_world_batch_and_ctx: the row source of every replica's row over all dp x cp ranks
    doc_ids.py   which document each position belongs to (0 = padding)
    rows.py      a collator's B rows as one packed row
    agree.py     every rank of the CP group holds the same row (one small collective)
    state.py     StepState: plan, geometry, exchange routing and kernel call tables, built once
    notes.py     what the step's calls decided (fallbacks, window kinds, vision work)
    attend.py    a layer's attention inside the step (and one row's outside a step): exchange -> kernel
    slot.py      the active step, readable from autograd's recompute threads
    kept.py      autograd graphs of compiled attention calls, kept until their backward
    gather.py    gather_sequence: unshard logits or hidden states
"""
