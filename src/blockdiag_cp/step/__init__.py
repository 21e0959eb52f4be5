"""One CP step, from the batch to the frozen state the attention layers read.

    pipeline.py  the one step pipeline both entries run: inputs, read, agree, plan, move, heads, state
    inputs.py    the sequence-aligned batch keys, their checks and padding
    batch.py     make_cp_blockdiag_batch_and_ctx: the row source of one replica's row (pad and slice)
    world.py     make_cp_world_batch_and_ctx: the row source of every replica's row over all dp x cp ranks
    world_plan.py  plan_rank_state: one rank's whole-batch step state from run lengths, without a process group
    micro_batches.py  a step per micro-batch of a pipeline schedule, every stage action a turn of its step
    prefetch.py  prefetched_world_steps: the whole-batch step, the next micro-batch planned beside the current one
    doc_ids.py   which document each position belongs to (0 = padding)
    rows.py      a collator's B rows as one packed row
    state.py     StepState: plan, geometry, exchange routing and kernel call tables, built once
    notes.py     what the step's calls decided (fallbacks, window kinds, vision work)
    call.py      AttentionCall: an attention call as its entry names it; LayerFeatures
    dispatch.py  attend: the one choice of compiled op or eager path (Note [One way down])
    opaque.py    the attention as one custom op for torch.compile (Note [One opaque op])
    attend.py    the eager attention: inside the step, one row's outside a step, stock SDPA
    slot.py      the active step, readable from autograd's recompute threads
    kept.py      autograd graphs of compiled attention calls, kept until their backward
    gather.py    gather_sequence: unshard logits or hidden states
    linear_ce.py a shard's next-token cross-entropy from its hidden states and the LM head, no logits
"""
