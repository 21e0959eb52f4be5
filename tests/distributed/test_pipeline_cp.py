"""Pipeline parallelism x CP (issue #54): every schedule torch 2.13 ships at pp 2 x cp 2 (and dp 2 x pp 2 x cp 2)
on gloo, with and without activation checkpointing, against one process without any parallelism
(examples/train_pp_cp.py's recipe); a hybrid's routed mixers under a zero-bubble schedule; the refusals.

Every micro-batch is a different packed row (other documents, same length), so a micro-batch that attends with
another's plan (its neighbour's, or the last one entered when its checkpointed layers are recomputed) changes the
losses and gradients far beyond the tolerance."""

import argparse

import pytest
import torch

pytest.importorskip("transformers")

from examples_module import example  # noqa: E402

ARGS = dict(dp=1, steps=2, microbatches=4, seq_len=64, layers=4, lr=1e-2)
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: (schedule, checkpointing, layout, static shapes): every schedule with and without (non-reentrant) checkpointing;
#: reentrant checkpointing where torch allows it (static shapes: torch's shape inference and zero-bubble's split
#: backward call autograd.grad, which reentrant checkpointing refuses)
RUNS = (*((s, c, "balanced", False) for s in SCHEDULES for c in ("none", "non_reentrant")),
        ("1F1B", "reentrant", "contiguous", True), ("Interleaved1F1B", "reentrant", "balanced", True))
TOLERANCE = 1e-10  # float64


def recipe():
    return example("train_pp_cp")


def schedules_worker(rank, world, runs, dp):
    """Each run of `runs` with the example's own `train` on one (dp, pp 2, cp) mesh, float64."""
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp.step.slot import STEP_SLOT

    mesh = init_device_mesh("cpu", (dp, 2, world // (2 * dp)), mesh_dim_names=("dp", "pp", "cp"))
    results = []
    for schedule, checkpointing, layout, static in runs:
        args = argparse.Namespace(**{**ARGS, "dp": dp}, schedule=schedule, checkpointing=checkpointing, layout=layout,
                                  static_shapes=static)
        results.append(recipe().train(args, mesh, torch.device("cpu"), torch.float64))
        assert not STEP_SLOT.in_flight() and STEP_SLOT.current() is None  # every micro-batch's step ended
    return results


def assert_like_one_process(per_rank, reference, what):
    losses = [r["losses"] for r in per_rank if r["losses"] is not None]
    assert losses, what
    for got in losses:
        assert max(abs(a - b) for a, b in zip(got, reference["losses"], strict=True)) < TOLERANCE, (what, got)
    for key in ("grads", "params"):
        merged = {name: t for r in per_rank for name, t in r[key].items()}
        assert set(merged) == set(reference[key]), what  # every stage's parameters came back
        err = max(float((merged[n] - t).abs().max()) for n, t in reference[key].items())
        assert err < TOLERANCE, (what, key, err)


@pytest.mark.slow
def test_every_schedule_pp2_x_cp2_trains_like_one_process(rank_pools):
    """pp 2 x cp 2: losses, last gradients and final parameters of every schedule equal one process's."""
    reference = recipe().single_process_run(argparse.Namespace(**ARGS), torch.float64)
    per_rank = rank_pools(4).run(schedules_worker, RUNS, 1)
    for i, run in enumerate(RUNS):
        assert_like_one_process([r[i] for r in per_rank], reference, run)


@pytest.mark.slow
def test_dp2_x_pp2_x_cp2_trains_like_one_process(own_pools):
    """8 ranks: each dp replica trains its own micro-batches; gradients summed over dp x cp of each stage."""
    runs = (("ZBVZeroBubble", "non_reentrant", "balanced", False), ("1F1B", "non_reentrant", "contiguous", False))
    reference = recipe().single_process_run(argparse.Namespace(**{**ARGS, "dp": 2}), torch.float64)
    per_rank = own_pools(8).run(schedules_worker, runs, 2)
    for i, run in enumerate(runs):
        assert_like_one_process([r[i] for r in per_rank], reference, run)


# -- a hybrid's routed token mixers (LFM2's short convolutions: their halo crosses CP ranks per micro-batch)

#: (untied embeddings: a weight tied across stages needs its gradient summed over the pipeline ranks holding it,
#: as in any pipeline)
HYBRID = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, conv_L_cache=3, tie_word_embeddings=False,
              layer_types=["conv", "full_attention", "conv", "full_attention"])


def hybrid_model():
    import transformers

    from blockdiag_cp.hf import prepare_model

    torch.manual_seed(0)
    config = transformers.Lfm2Config(**HYBRID)
    config._attn_implementation = "blockdiag_cp"
    model = transformers.Lfm2ForCausalLM(config).double()
    prepare_model(model)
    return model


def hybrid_rows():
    from blockdiag_cp.loss import add_shift_labels

    rows = recipe().replica_rows(0, 1, ARGS["microbatches"], ARGS["seq_len"])
    return [add_shift_labels({"input_ids": r.input_ids, "position_ids": r.position_ids}) for r in rows]


def hybrid_reference():
    """The prepared model in one process, each row in a one-rank step: loss and gradients."""
    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    model, rows = hybrid_model(), hybrid_rows()
    tokens = sum(int((r["shift_labels"] != -100).sum()) for r in rows)
    total = 0.0
    for row in rows:
        ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, dict(row))
        with ctx():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            loss = recipe().token_loss(logits, batch["shift_labels"], tokens)
            loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad for n, p in model.named_parameters()}


def hybrid_worker(rank, world, schedule_name):
    """pp 2 x cp 2, `schedule_name`, non-reentrant checkpointing: this rank's loss share and stage gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import make_cp_pipeline_batch_and_ctx
    from blockdiag_cp.parallel import reduce_gradients

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    model = hybrid_model()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    schedule, modules = recipe().build_schedule(model, schedule_name, mesh["pp"], torch.device("cpu"),
                                                ARGS["microbatches"])
    steps, batch = make_cp_pipeline_batch_and_ctx(mesh["cp"], None, hybrid_rows())
    tokens = (batch["shift_labels"] != -100).sum()
    dist.all_reduce(tokens, group=mesh["cp"].get_group())
    first, last = any(m.embed is not None for m in modules), any(m.head is not None for m in modules)
    losses = []
    with steps(schedule):
        schedule.step(*((batch["input_ids"],) if first else ()), position_ids=batch["position_ids"],
                      loss_kwargs={"tokens": tokens}, **(dict(target=batch["shift_labels"], losses=losses) if last else {}))
    params = {id(p): n for n, p in model.named_parameters()}
    local = [p for m in modules for p in m.parameters()]
    reduce_gradients(local, mesh["cp"])
    return float(sum(losses)) if last else None, {params[id(p)]: p.grad for p in local}


@pytest.mark.slow
def test_a_hybrids_routed_mixers_under_a_zero_bubble_schedule_with_checkpointing(rank_pools):
    want_loss, want_grads = hybrid_reference()
    per_rank = rank_pools(4).run(hybrid_worker, "InterleavedZeroBubble")
    assert abs(sum(r[0] for r in per_rank if r[0] is not None) - want_loss) < TOLERANCE  # the last stage's CP shares
    grads = {n: g for r in per_rank for n, g in r[1].items()}
    assert set(grads) == set(want_grads)
    errors = {n: float((grads[n] - g).abs().max()) for n, g in want_grads.items()}
    assert max(errors.values()) < TOLERANCE, sorted(errors.items(), key=lambda e: -e[1])[:3]


# -- the refusals (issue #54 item 4), on every rank, before any work

def refusal(fn, *args, error=ValueError):
    """The message of the `error` that ``fn(*args)`` raises (None if it returns)."""
    try:
        fn(*args)
    except error as exc:
        return str(exc)
    return None


def refusals_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    from blockdiag_cp import CPConfig, PipelineSteps, make_cp_pipeline_batch_and_ctx
    from blockdiag_cp.errors import ModelRefusal
    from blockdiag_cp.loss import add_shift_labels
    from blockdiag_cp.step.slot import STEP_SLOT
    from blockdiag_cp.tools.demo import make_model

    ex, cpu, M = recipe(), torch.device("cpu"), ARGS["microbatches"]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    pp, cp = mesh["pp"], mesh["cp"]
    rows = [add_shift_labels({"input_ids": r.input_ids, "position_ids": r.position_ids})
            for r in ex.replica_rows(0, 1, M, 64)]  # documents of 16 to 32 tokens: every row laid out differently
    model = make_model("blockdiag_cp", torch.float64)
    schedule, modules = ex.build_schedule(model, "1F1B", pp, cpu, M)
    steps, batch = make_cp_pipeline_batch_and_ctx(cp, None, rows)
    found = {"count": refusal(lambda: PipelineSteps(steps.train_ctxs[:3])(schedule).__enter__())}
    stage = PipelineStage(modules[0], pp.get_local_rank(), 2, cpu, group=pp.get_group())
    split = ScheduleGPipe(stage, n_microbatches=M, loss_fn=ex.token_loss, args_chunk_spec=(TensorChunkSpec(1),))
    found["split"] = refusal(lambda: steps(split).__enter__())
    other_rows = rows[::-1] if pp.get_local_rank() == 1 else rows  # the second stage got other documents
    found["dropped"] = refusal(lambda: make_cp_pipeline_batch_and_ctx(cp, None, other_rows)[0](schedule).__enter__())
    found["grouped"] = refusal(lambda: make_cp_pipeline_batch_and_ctx(cp, None, rows, config=CPConfig(layout="grouped")))
    short = [{key: t[:, :60] for key, t in rows[0].items()}, *rows[1:]]
    found["lengths"] = refusal(make_cp_pipeline_batch_and_ctx, cp, None, short)
    found["outside"] = found["never_reached"] = None
    try:
        with steps(schedule):  # a stage's forward outside the schedule's actions: its micro-batch's documents missing
            found["outside"] = refusal(modules[0], batch["input_ids"][:1] if modules[0].embed is not None else
                                       torch.zeros(1, batch["input_ids"].shape[1], 64, dtype=torch.float64),
                                       batch["position_ids"][:1], error=RuntimeError)
    except ModelRefusal as exc:  # and the steps, which no schedule action ran, end unreached
        found["never_reached"] = str(exc)
    found["in_flight_after"] = STEP_SLOT.in_flight()
    found.update(several_rows_refusals(cp, schedule, modules, rows))
    return found


def several_rows_refusals(cp, schedule, modules, rows):
    """Micro-batches of two rows, at pp 2: given to the first stage alone (the other stage would wait for its
    activations), and as every stage's positions: every rank raises, before any stage work."""
    from blockdiag_cp import make_cp_pipeline_batch_and_ctx
    from blockdiag_cp.step.slot import STEP_SLOT

    first, last = modules[0].embed is not None, modules[-1].head is not None

    def schedule_step(input_ids, position_ids):
        steps, batch = make_cp_pipeline_batch_and_ctx(cp, None, rows)
        with steps(schedule):
            schedule.step(*((input_ids(batch),) if first else ()), position_ids=position_ids(batch),
                          loss_kwargs={"tokens": torch.tensor(1)},
                          **(dict(target=batch["shift_labels"], losses=[]) if last else {}))

    def two(t):
        return torch.cat([t, t])

    found = {"first_stage_rows": refusal(schedule_step, lambda b: two(b["input_ids"]), lambda b: b["position_ids"]),
             "every_stage_rows": refusal(schedule_step, lambda b: b["input_ids"], lambda b: two(b["position_ids"]))}
    found["in_flight_after_rows"] = STEP_SLOT.in_flight()
    found["first"] = first
    return found


@pytest.mark.slow
def test_what_cannot_be_exact_is_refused_by_name_on_every_rank(rank_pools):
    for found in rank_pools(4).run(refusals_worker):
        assert "runs 4 micro-batches but 3 steps" in found["count"], found
        assert "splits micro-batches along dimension(s) [1]" in found["split"], found
        assert "disagree on their micro-batches" in found["dropped"], found
        assert "layout='grouped' is refused" in found["grouped"], found
        assert "one length" in found["lengths"] and "[60, 64, 64, 64]" in found["lengths"], found
        assert "outside the turns of the steps in flight" in found["outside"], found
        assert "ended without the model calling" in found["never_reached"], found
        assert found["in_flight_after"] is False
        # micro-batches of two rows (each [2, 32]): the first stage's inputs refused on every rank of the pipeline
        if found["first"]:
            assert "micro-batch 0 of stage(s) [0] is shaped [(2, 32)]" in found["first_stage_rows"], found
            assert "each micro-batch must be one packed row of this rank's 32 positions" in found["first_stage_rows"]
        else:
            assert "pipeline rank(s) [0] rejected their micro-batch inputs" in found["first_stage_rows"], found
        assert "micro-batch 0 of stage(s) [" in found["every_stage_rows"] and "[(2, 32)]" in found["every_stage_rows"]
        assert found["in_flight_after_rows"] is False
