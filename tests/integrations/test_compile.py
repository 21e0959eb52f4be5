"""torch.compile inside and outside CP steps (Note [One way down] in step/dispatch.py, Note [One
opaque op] in step/opaque.py): per-layer ``fullgraph=True`` compile trains exactly like the
uncompiled run without CP; a whole-model compile has no graph break; changing rows do not
recompile; checkpointing and late recompute."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import blockdiag_cp.hf  # noqa: E402,F401  (registers "blockdiag_cp")

VOCAB, S, STEPS = 50, 48, 3
BACKEND = "aot_eager"  # inductor builds C++ (a minute per model on 2 cores): the benchmark runs it


def make_model(attn="blockdiag_cp", dtype=torch.float64):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attn_implementation=attn)
    return transformers.LlamaForCausalLM(config).to(dtype)


def rows(steps=STEPS, seq_len=S, seed=3):
    """`steps` packed rows of `seq_len` tokens, each cut into other documents: ``(ids [1, S], lengths)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        cuts = sorted(set(torch.randint(1, seq_len, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq_len])]
        out.append((torch.randint(0, VOCAB, (1, seq_len), generator=g), lengths))
    return out


def positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def reference_run(steps=STEPS):
    """No CP, no compile: transformers' SDPA on each document alone; AdamW. Losses, last grads, params."""
    model = make_model("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids, lengths in rows(steps):
        loss_sum, start = 0.0, 0
        for n in lengths:
            x = ids[:, start : start + n]
            logits = model(input_ids=x, use_cache=False).logits
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")
            start += n
        loss = loss_sum / (S - len(lengths))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters()], [p.detach().clone() for p in model.parameters()]


def compile_layers(model, fullgraph=True):
    for layer in model.model.layers:
        layer.compile(backend=BACKEND, fullgraph=fullgraph)


def cp_train(rank, world, layout, checkpointing, whole_model):
    """`STEPS` AdamW steps of the model under CP (`world` ranks), compiled per layer (fullgraph) or whole."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.loss import add_shift_labels

    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None
    model = make_model()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    model.train()
    forward = torch.compile(model, backend=BACKEND) if whole_model else model
    if not whole_model:
        compile_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids, lengths in rows():
        batch = add_shift_labels({"input_ids": ids, "position_ids": positions(lengths)})
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"] if mesh else None, None, batch,
                                                           config=CPConfig(layout=layout))
        with train_ctx():
            logits = forward(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[0], batch["shift_labels"][0], reduction="sum")
            loss = loss / (S - len(lengths))
            opt.zero_grad()
            loss.backward()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        losses.append(value.item())
    stats = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
             "kept": len(__import__("blockdiag_cp.step.slot", fromlist=["STEP_SLOT"]).STEP_SLOT.kept)}
    return losses, [p.grad.clone() for p in model.parameters()], [p.detach().clone() for p in model.parameters()], stats


def assert_same_training(result, reference):
    (losses, grads, params, stats), (ref_losses, ref_grads, ref_params) = result, reference
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-10, (losses, ref_losses)
    assert max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) < 1e-10
    assert max(float((p - r).abs().max()) for p, r in zip(params, ref_params)) < 1e-10
    assert stats["kept"] == 0, stats  # every kept attention graph went with its backward


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize("world, layout, checkpointing", [
    (2, "balanced", None),
    pytest.param(1, "contiguous", "non_reentrant", marks=pytest.mark.slow),
    pytest.param(2, "contiguous", "reentrant", marks=pytest.mark.slow),
])
def test_fullgraph_compiled_layers_in_a_cp_step_train_like_the_run_without_cp(world, layout, checkpointing,
                                                                              reference, rank_pools):
    results = rank_pools(world).run(cp_train, layout, checkpointing, False) if world > 1 else [
        cp_train(0, 1, layout, checkpointing, False)]
    for result in results:
        assert_same_training(result, reference)
        # one graph per decoder layer kind (both layers share the code), plus its recompute for checkpointing
        assert result[3]["breaks"] == 0, result[3]


@pytest.mark.slow  # the fast loop compiles each block fullgraph (no break either)
def test_whole_model_compile_in_a_cp_step_has_no_graph_break(reference, rank_pools):
    for result in rank_pools(2).run(cp_train, "balanced", None, True):
        assert_same_training(result, reference)
        assert result[3]["breaks"] == 0 and result[3]["graphs"] == 1, result[3]  # one graph, over 3 different rows


@pytest.mark.slow
def test_outside_a_step_a_compiled_packed_row_equals_eager():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True)
    for ids, lengths in rows():
        pos = positions(lengths)
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        got = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert (got - want).abs().max() < 1e-12
        got.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.slow
def test_rows_of_changing_length_recompile_once():
    """10 steps (a one-process step: what dynamo guards on does not depend on cp), each row of
    another length and other documents: one recompile (the length becomes dynamic), then none."""
    graphs = count_graphs_over_rows(10)
    assert graphs[0] == 1 and graphs[-1] == 2 and graphs[2:] == [2] * 8, graphs


def count_graphs_over_rows(steps):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    torch._dynamo.reset()
    counters.clear()
    model = make_model(dtype=torch.float32)
    compiled = torch.compile(model, backend=BACKEND)
    graphs = []
    for step in range(steps):
        ids, lengths = rows(1, seq_len=40 + 5 * step, seed=step)[0]
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids,
                                                                        "position_ids": positions(lengths)})
        with train_ctx():
            compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


@pytest.mark.slow  # compiles a model (seconds); the eager late recompute is refused in the fast loop (test_regressions)
def test_a_compiled_layer_recomputed_after_its_step_is_refused():
    """Non-reentrant checkpointing around compiled layers, backward after train_ctx() exited: the
    recompute (a second graph, outside a step) raises instead of attending unsharded."""
    import torch._dynamo

    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    torch._dynamo.reset()
    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    compile_layers(model, fullgraph=False)
    ids, lengths = rows(1)[0]
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "position_ids": positions(lengths)})
    with train_ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    with pytest.raises(RuntimeError, match="recomputed in backward"):
        logits.sum().backward()


def test_the_drop_in_compiles_fullgraph_in_and_outside_a_step():
    """`cp_blockdiag_sdpa` itself under torch.compile(fullgraph=True): a world-1 step on a packed row
    (window and sinks too) and stock SDPA outside, forward and backward equal to eager."""
    import torch._dynamo

    from blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)

    def attend(q, k, v, sinks, window):
        return cp_blockdiag_sdpa(q, k, v, sliding_window=window, sinks=sinks)

    compiled = torch.compile(attend, backend=BACKEND, fullgraph=True)
    ids = torch.tensor([[1] * 7 + [2] * 9 + [3] * 4])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "_packed_seq_ids": ids})
    for window in (None, 5):
        results = []
        for fn in (attend, compiled):
            with train_ctx():
                out = fn(q, k, v, sinks, window)
                out.square().sum().backward()
            results.append((out.detach(), *(t.grad.clone() for t in (q, k, v, sinks))))
            for t in (q, k, v, sinks):
                t.grad = None
        for eager, traced in zip(*results):
            assert (eager - traced).abs().max() < 1e-12
    outside = torch.compile(lambda q, k, v: cp_blockdiag_sdpa(q, k, v, is_causal=True), backend=BACKEND, fullgraph=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (outside(q, k, v) - want).abs().max() < 1e-12


@pytest.mark.slow
def test_a_compiled_prepared_hybrid_equals_eager(family="nemotron_h"):
    """A hybrid's routed mixers plan on the host: under torch.compile they run eagerly (a graph break
    around each), so a packed row in a world-1 step equals the eager model, forward and backward."""
    import torch._dynamo
    from test_hybrid_models import build, loss_of, packed_row

    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.hf import prepare_model

    torch._dynamo.reset()
    model = build(family)
    prepare_model(model)
    ids, pos = packed_row()
    eager = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    loss_of(eager, ids).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend=BACKEND)
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "position_ids": pos})
    with train_ctx():
        got = compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss_of(got, ids).backward()
    assert (got - eager).abs().max() < 1e-12
    assert max(float((p.grad - w).abs().max()) for p, w in zip(model.parameters(), want)) < 1e-12


@pytest.mark.filterwarnings("ignore:blockdiag-cp kernel='auto' uses 'dense'")
def test_attention_dropout_under_compile_draws_one_mask_for_a_layer_and_its_recompute():
    """Dropout inside the compiled attention: with non-reentrant checkpointing (recompute in backward)
    the loss and every gradient equal the run without checkpointing from the same seed, so the
    recompute drew the forward's mask; and the mask is a real one (another seed, another loss)."""
    import torch._dynamo

    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    ids, lengths = rows(1)[0]

    def run(checkpointing, seed):
        torch._dynamo.reset()
        model = make_model()
        model.config.attention_dropout = 0.3
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.3
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        compile_layers(model)
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids,
                                                                        "position_ids": positions(lengths)})
        torch.manual_seed(seed)
        with train_ctx():
            loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.square().mean()
            loss.backward()
        return loss.item(), [p.grad for p in model.parameters()]

    plain, checkpointed, other = run(False, 7), run(True, 7), run(False, 8)
    assert plain[0] == checkpointed[0] and plain[0] != other[0]
    assert max(float((a - b).abs().max()) for a, b in zip(plain[1], checkpointed[1])) < 1e-12


@pytest.mark.filterwarnings("ignore:blockdiag-cp kernel='auto' uses 'dense'")
def test_compiled_dropout_attention_draws_the_same_mask_under_any_checkpointing():
    """The compiled drop-in with attention dropout in a world-1 step, checkpointed three ways: reentrant
    (its forward runs without gradients, the recompute with them), non-reentrant around the compiled
    function, and non-reentrant traced inside it. Each run's output and q/k/v gradients equal the run
    without checkpointing from the same seed (one mask per forward and recompute); another seed differs."""
    import torch._dynamo
    from torch.utils.checkpoint import checkpoint

    from blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    ids = torch.tensor([[1] * 7 + [2] * 9 + [3] * 4])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "_packed_seq_ids": ids})

    def attend(q, k, v):
        return torch.sin(cp_blockdiag_sdpa(q * 1.5, k, v, dropout_p=0.3))

    compiled = torch.compile(attend, backend=BACKEND, fullgraph=True)
    inside = torch.compile(lambda q, k, v: checkpoint(attend, q, k, v, use_reentrant=False), backend=BACKEND)
    runs = {"plain": compiled, "inside": inside,
            "reentrant": lambda *t: checkpoint(compiled, *t, use_reentrant=True),
            "non_reentrant": lambda *t: checkpoint(compiled, *t, use_reentrant=False)}

    def run(how, seed):
        q, k, v = (t.clone().requires_grad_() for t in qkv)
        torch.manual_seed(seed)
        with train_ctx():
            out = runs[how](q, k, v)
            out.square().sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    plain = run("plain", 7)
    for how in ("reentrant", "non_reentrant", "inside"):
        assert max(float((a - b).abs().max()) for a, b in zip(plain, run(how, 7))) < 1e-12, how
    assert float((run("plain", 8)[0] - plain[0]).abs().max()) > 0.1  # a real mask: another seed, another output


def test_the_opaque_ops_output_is_its_own_memory():
    """The op's output may be reused in place (inductor writes into its buffers): it must share no memory
    with the kept graph, whose kernel saved its own output for backward (the dense kernel does). Written
    over after use, the gradients are unchanged."""
    from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.step.call import AttentionCall, LayerFeatures
    from blockdiag_cp.step.opaque import opaque_attention

    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    ids = torch.tensor([[1] * 7 + [2] * 9 + [3] * 4])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "_packed_seq_ids": ids},
                                                   config=CPConfig(kernel="dense"))
    weights, grads = torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64), []
    for overwrite in (False, True):
        q, k, v = (t.clone().requires_grad_() for t in qkv)
        with train_ctx():
            out = opaque_attention(AttentionCall("step", LayerFeatures()), q, k, v)
            loss = (out * weights).sum()  # saves only the weights
            if overwrite:
                out.detach().fill_(0.0)  # as a compiler reusing the buffer would
            loss.backward()
        grads.append([t.grad for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_eager_under_compile_runs_the_function_eagerly_only_while_tracing():
    """A decorated function called from compiled code runs as Python (it sees no tracing), on every call."""
    from blockdiag_cp.eager import eager_under_compile

    calls = []

    @eager_under_compile
    def host_side(x):
        """docstring kept"""
        calls.append(torch.compiler.is_compiling())
        return x + (100.0 if torch.compiler.is_compiling() else 1.0)

    assert host_side.__doc__ == "docstring kept" and host_side(torch.zeros(1)).item() == 1.0
    compiled = torch.compile(lambda x: host_side(x * 2) * 3, backend=BACKEND)
    assert [compiled(torch.ones(1)).item() for _ in range(2)] == [9.0, 9.0]
    assert calls == [False, False, False], calls  # once eagerly, then once per compiled call, never traced


def test_a_kept_graph_goes_with_its_backward_or_its_handle():
    """Note [One opaque op]: the op keeps its eager graph until its backward takes it (once: a second
    backward is a clear error) or until the forward's outputs die without a backward."""
    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.step.call import AttentionCall, LayerFeatures
    from blockdiag_cp.step.opaque import opaque_attention
    from blockdiag_cp.step.slot import STEP_SLOT

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ids = torch.tensor([[1] * 7 + [2] * 9 + [3] * 4])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "_packed_seq_ids": ids})
    before = len(STEP_SLOT.kept)
    with train_ctx():
        out = opaque_attention(AttentionCall("step", LayerFeatures()), q, k, v)
        assert len(STEP_SLOT.kept) == before + 1
        out.sum().backward(retain_graph=True)
        assert len(STEP_SLOT.kept) == before  # taken by its backward
        with pytest.raises(RuntimeError, match="backward ran twice"):
            out.sum().backward()
        unused = opaque_attention(AttentionCall("step", LayerFeatures()), q, k, v)  # a forward whose backward never runs
        assert len(STEP_SLOT.kept) == before + 1
        del unused, out  # the handle dies with the graph that saved it (reference counting, no collection)
        assert len(STEP_SLOT.kept) == before
        with torch.no_grad():
            opaque_attention(AttentionCall("step", LayerFeatures()), q, k, v)
        assert len(STEP_SLOT.kept) == before  # nothing kept without gradients
