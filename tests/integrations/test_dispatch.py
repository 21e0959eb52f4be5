"""Note [One way down] (step/dispatch.py): an entry only names its attention call; `step.dispatch.attend`
alone picks the compiled op (``blockdiag_cp::attention``) or the eager path, for `cp_blockdiag_sdpa` and
transformers' attention function alike. Counted with the profiler, checked against the eager result."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

BACKEND = "aot_eager"
OP = "blockdiag_cp::attention"


def inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ids = torch.tensor([[1] * 7 + [2] * 9 + [3] * 4])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": ids, "_packed_seq_ids": ids})
    return (q, k, v), train_ctx


def op_calls(fn):
    """``(fn(), how many times the opaque op ran)``; a compiled `fn` runs once first (its compile is not counted)."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(event.name == OP for event in prof.events())


def test_only_a_compiled_call_is_the_op_and_it_equals_the_eager_call():
    """Eager: never the op. Compiled: the op once per call inside a step and for a call outside one that could
    be a CP layer's late recompute; a masked call outside a step is stock SDPA, traced (no op)."""
    import torch._dynamo

    torch._dynamo.reset()
    (q, k, v), train_ctx = inputs()
    mask = torch.ones(20, 20, dtype=torch.bool).tril()

    def plain(q, k, v):
        return cp_blockdiag_sdpa(q, k, v)

    def masked(q, k, v):
        return cp_blockdiag_sdpa(q, k, v, attn_mask=mask)

    for fn, in_step, traced_ops in ((plain, True, 1), (plain, False, 1), (masked, False, 0)):
        compiled = torch.compile(fn, backend=BACKEND, fullgraph=True)
        with train_ctx() if in_step else torch.enable_grad():
            want, eager_ops = op_calls(lambda: fn(q, k, v))
            got, ops = op_calls(lambda: compiled(q, k, v))
        assert (eager_ops, ops) == (0, traced_ops), (fn.__name__, in_step)
        assert (got - want).abs().max() < 1e-12


def test_outside_a_step_the_drop_in_is_stock_sdpa_with_its_mask_eager_and_compiled():
    import torch._dynamo

    torch._dynamo.reset()
    (q, k, v), _ = inputs()
    mask = torch.randn(20, 20, dtype=torch.float64)  # an additive float mask
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)

    def fn(q, k, v):
        return cp_blockdiag_sdpa(q, k, v, attn_mask=mask, scale=0.3)

    for run in (fn, torch.compile(fn, backend=BACKEND, fullgraph=True)):
        assert (run(q, k, v) - want).abs().max() < 1e-12


def test_a_compiled_call_under_autocast_casts_like_the_eager_call():
    """RoPE under autocast leaves q/k in float32 with v in bfloat16: compiled, the op's inputs are cast first
    (its fake output takes the queries' dtype), so the output is bfloat16 and equals the eager call's."""
    import torch._dynamo

    torch._dynamo.reset()
    (q, k, v), train_ctx = inputs()
    q, k, v = q.detach().float(), k.detach().float(), v.detach().bfloat16()
    compiled = torch.compile(lambda q, k, v: cp_blockdiag_sdpa(q, k, v), backend=BACKEND, fullgraph=True)
    with train_ctx(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = cp_blockdiag_sdpa(q, k, v), compiled(q, k, v)
    assert want.dtype == got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_a_compiled_drop_in_recomputed_after_its_step_is_refused():
    """A compiled `cp_blockdiag_sdpa` under non-reentrant checkpointing, backward after ``train_ctx()`` exited:
    the recompute raises, whether the checkpoint is around the compiled function (retraced outside the step:
    the op's ``stock`` call checks) or traced inside it (the op's ``step`` call finds no step)."""
    import torch._dynamo

    (q, k, v), train_ctx = inputs()

    def attend(q, k, v):
        return cp_blockdiag_sdpa(q, k, v)

    for where in ("around", "inside"):
        torch._dynamo.reset()
        if where == "around":
            compiled = torch.compile(attend, backend=BACKEND)
            fn = lambda *t: checkpoint(compiled, *t, use_reentrant=False)  # noqa: E731
        else:
            fn = torch.compile(lambda *t: checkpoint(attend, *t, use_reentrant=False), backend=BACKEND)
        with train_ctx():
            out = fn(q, k, v)
        with pytest.raises(RuntimeError, match="recomputed in backward"):
            out.sum().backward()


@pytest.mark.parametrize("compiled", [False, True])
def test_layer_features_outside_a_step_are_refused(compiled):
    """Outside a step `cp_blockdiag_sdpa` is stock SDPA, which has no window, softcap or sinks: each is refused
    (eager and traced alike, masked or not), never dropped."""
    import torch._dynamo

    torch._dynamo.reset()
    (q, k, v), _ = inputs()
    mask = torch.ones(20, 20, dtype=torch.bool).tril()
    for features in (dict(sliding_window=4), dict(softcap=30.0), dict(sinks=torch.zeros(4, dtype=torch.float64))):
        for attn_mask in (None, mask):
            def fn(q, k, v):
                return cp_blockdiag_sdpa(q, k, v, attn_mask=attn_mask, **features)

            run = torch.compile(fn, backend=BACKEND) if compiled else fn
            with pytest.raises(ValueError, match="work inside a block-diagonal CP step"):
                run(q, k, v)


def test_transformers_row_call_is_the_op_only_when_compiled():
    """transformers' attention function outside a step: a packed row (its documents from ``position_ids``, or
    ``cu_seq_lens_q``) is the op once compiled, never eagerly, with the eager call's result; several rows are
    transformers' own SDPA, compiled without a break (its late-recompute check reads the slot only eagerly)."""
    pytest.importorskip("transformers")
    import torch._dynamo

    import blockdiag_cp.hf  # noqa: F401  (registers "blockdiag_cp")
    from blockdiag_cp.hf import blockdiag_cp_attention

    torch._dynamo.reset()
    layer = torch.nn.Module()
    layer.is_causal = True
    (q, k, v), _ = inputs()
    positions = torch.cat([torch.arange(12), torch.arange(8)]).unsqueeze(0)

    def row(q, k, v):
        return blockdiag_cp_attention(layer, q, k, v, None, scaling=0.3, position_ids=positions)[0]

    compiled = torch.compile(row, backend=BACKEND, fullgraph=True)
    want, eager_ops = op_calls(lambda: row(q, k, v))
    got, ops = op_calls(lambda: compiled(q, k, v))
    assert (eager_ops, ops) == (0, 1) and (got - want).abs().max() < 1e-12
    first = torch.nn.functional.scaled_dot_product_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], is_causal=True,
                                                             scale=0.3)
    assert (want[:, :12].transpose(1, 2) - first).abs().max() < 1e-12  # the first document alone
    cu_seqlens = torch.tensor([0, 12, 20], dtype=torch.int32)  # the same documents, marked as the flattening collator does

    def marked(q, k, v):
        return blockdiag_cp_attention(layer, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu_seqlens)[0]

    for fn in (marked, torch.compile(marked, backend=BACKEND, fullgraph=True)):
        assert (fn(q, k, v) - want).abs().max() < 1e-12
    rows = [torch.cat([t, t]) for t in (q, k, v)]
    batch = torch.compile(lambda q, k, v: blockdiag_cp_attention(layer, q, k, v, None)[0], backend=BACKEND,
                          fullgraph=True)
    assert (batch(*rows) - blockdiag_cp_attention(layer, *rows, None)[0]).abs().max() < 1e-12


def test_a_padded_row_outside_a_step_keeps_its_padding_eager_and_compiled():
    """One row with left padding: transformers builds its ``[1, 1, S, S]`` mask, the row call reads the padding
    from it; the real tokens' logits equal SDPA's, eagerly and compiled (the op gets the mask)."""
    transformers = pytest.importorskip("transformers")
    import torch._dynamo

    import blockdiag_cp.hf  # noqa: F401  (registers "blockdiag_cp")

    torch._dynamo.reset()

    def llama(attn):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
        return transformers.LlamaForCausalLM(config).double()

    ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    want = llama("sdpa")(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, 4:]
    ours = llama("blockdiag_cp")
    compiled = torch.compile(ours, backend=BACKEND)
    for model in (ours, compiled):
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, 4:]
        assert (got - want).abs().max() < 1e-10


def test_a_compiled_packed_row_of_a_model_with_unrouted_mixers_is_refused():
    """transformers' row call outside a step, compiled, for a model whose token mixers outside attention are not
    routed (Lfm2's convolutions): a row of several documents is refused by name (its documents are counted on
    the host: the eager path, under a graph break); a row of one document equals the eager call."""
    transformers = pytest.importorskip("transformers")
    import torch._dynamo

    import blockdiag_cp.hf  # noqa: F401  (registers "blockdiag_cp")
    from blockdiag_cp.hf import blockdiag_cp_attention

    torch._dynamo.reset()
    layer = torch.nn.Module()
    layer.config = transformers.Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           layer_types=["conv", "full_attention"])
    layer.is_causal = True
    (q, k, v), _ = inputs()

    def row(q, k, v, position_ids):
        return blockdiag_cp_attention(layer, q, k, v, None, position_ids=position_ids)[0]

    compiled = torch.compile(row, backend=BACKEND)
    one = torch.arange(20).unsqueeze(0)
    assert (compiled(q, k, v, one) - row(q, k, v, one)).abs().max() < 1e-12
    two = torch.cat([torch.arange(12), torch.arange(8)]).unsqueeze(0)
    for fn in (row, compiled):
        with pytest.raises(ValueError, match="on a packed row"):
            fn(q, k, v, two)


def test_an_attention_call_of_no_known_kind_is_an_invariant_error():
    from blockdiag_cp.errors import InvariantError
    from blockdiag_cp.step.call import AttentionCall, LayerFeatures

    with pytest.raises(InvariantError, match="unknown attention call kind 'ring'"):
        AttentionCall("ring", LayerFeatures())


def test_an_attention_calls_defaults_are_constants_that_any_dynamo_can_build():
    """Calls are built inside compiled blocks; torch 2.11's dynamo builds a frozen dataclass's defaults without a
    source and fails on anything but a constant (the H200 run: a ``LayerFeatures()`` default broke
    ``fullgraph=True``). Every default of `AttentionCall` is None, a bool or a number."""
    import dataclasses

    from blockdiag_cp.step.call import AttentionCall

    defaults = {f.name: f.default for f in dataclasses.fields(AttentionCall) if f.default is not dataclasses.MISSING}
    assert all(f.default_factory is dataclasses.MISSING for f in dataclasses.fields(AttentionCall))
    assert defaults and all(v is None or isinstance(v, (bool, int, float)) for v in defaults.values()), defaults
