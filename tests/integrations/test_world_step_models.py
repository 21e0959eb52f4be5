"""Models through the whole-batch step (`make_cp_world_batch_and_ctx`) at dp 2 x cp 2: every document of
every replica's row run alone, with the token mean over the whole batch, is what the four ranks compute
together (logits, loss, every parameter's gradient, float64): a tiny Llama, and a hybrid of each mixer kind
(LFM2's short convolutions, Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba2), with checkpointing."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf  # noqa: E402,F401  (registers "blockdiag_cp")
from blockdiag_cp import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_cp.hf import prepare_model  # noqa: E402
from blockdiag_cp.testing.world_parity import TINY_ROW_COSTS  # noqa: E402
from integrations.test_hybrid_models import FAMILIES, VOCAB, build  # noqa: E402

#: each replica's row (document lengths; -n: padding): one long document against many short ones
ROWS = ((2, 31, 1, 5, -3), (4, 1, 3, 6, 2, 5, 1, 7, -2))
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def build_model(family):
    if family == "llama":
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**LLAMA)
        config._attn_implementation = "blockdiag_cp"
        return transformers.LlamaForCausalLM(config).double()
    model = build(family)
    prepare_model(model)
    return model


def replica_row(d):
    """Replica `d`'s input ids, positions (restarting per document) and document ids."""
    g = torch.Generator().manual_seed(10 + d)
    segments = ROWS[d]
    ids = torch.randint(1, VOCAB, (1, sum(abs(n) for n in segments)), generator=g)
    positions = torch.cat([torch.arange(abs(n)) for n in segments]).unsqueeze(0)
    doc = torch.cat([torch.full((abs(n),), i + 1 if n > 0 else 0) for i, n in enumerate(segments)]).unsqueeze(0)
    return ids, positions, doc


def documents():
    """Every document of every replica in dp order (the global row's order): its input ids ``[1, n]``."""
    out = []
    for d in range(len(ROWS)):
        ids, _, doc = replica_row(d)
        out += [ids[:, doc[0] == i] for i in range(1, int(doc.max()) + 1)]
    return out


def each_document_alone(family):
    """Logits (concatenated in global-row order), loss (token mean over the whole batch) and gradients."""
    model = build_model(family)
    docs = documents()
    count = sum(doc.shape[1] - 1 for doc in docs)
    logits, losses = [], []
    for doc in docs:
        ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": doc})
        with ctx():
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(out[0, :-1].double(), doc[0, 1:], reduction="sum") / count
            loss.backward()
        logits.append(out.detach())
        losses.append(loss.detach())
    return torch.cat(logits, 1), float(torch.stack(losses).sum()), [p.grad.clone() for p in model.parameters()]


def world_worker(rank, world, family, checkpointing, exchange="auto"):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, PlanOptions, gather_sequence, make_cp_world_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
    model = build_model(family)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids, positions, doc = replica_row(mesh.get_local_rank("dp"))
    batch = add_shift_labels({"input_ids": ids, "position_ids": positions, "_packed_seq_ids": doc})
    config = CPConfig(layout="grouped", kv_exchange=exchange, plan=PlanOptions(costs=TINY_ROW_COSTS))
    ctx, batch = make_cp_world_batch_and_ctx(mesh, batch, config=config)
    count = sum(d.shape[1] - 1 for d in documents())
    with ctx() as state:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0].double(), batch["shift_labels"][0], reduction="sum") / count
        loss.backward()
        full = gather_sequence(logits.detach())
    grads = [p.grad.clone() for p in model.parameters()]
    total = loss.detach().clone()
    dist.all_reduce(total)
    for grad in grads:
        dist.all_reduce(grad)
    return full, float(total), grads, state.plan.local_lens, state.exchange.name


def assert_matches(result, reference, tolerance):
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = result, reference
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=tolerance)
    assert abs(loss - ref_loss) < max(tolerance, 1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


CASES = [("llama", False), ("nemotron_h", True),
         pytest.param("lfm2", False, marks=pytest.mark.slow), pytest.param("qwen3_5", True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("family, checkpointing", CASES)
def test_a_model_through_the_whole_batch_step_equals_every_document_alone(family, checkpointing, rank_pools):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = each_document_alone(family)
    tolerance = 1e-10 if family == "llama" else FAMILIES[family][4]
    results = rank_pools(4).run(world_worker, family, checkpointing)
    for full, loss, grads, local_lens, exchange in results:
        assert_matches((full, loss, grads), reference, tolerance)
        assert exchange == "p2p"
    lens = results[0][3]
    assert len(set(lens)) > 1, lens  # the grouped plan gave ranks different lengths, and the step ran them


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["a2a", "allgather", "ring"])
def test_every_cpu_exchange_carries_a_hybrid_through_the_whole_batch_step(exchange, rank_pools):
    reference = each_document_alone("nemotron_h")
    for full, loss, grads, _, ran in rank_pools(4).run(world_worker, "nemotron_h", False, exchange):
        assert_matches((full, loss, grads), reference, FAMILIES["nemotron_h"][4])
        assert ran == exchange
