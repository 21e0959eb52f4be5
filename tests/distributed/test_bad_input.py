"""Bad input gets a clear error where it enters; ranks that disagree fail together, not hang."""

import pytest
import torch

from blockdiag_cp import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx, plan_shards
from blockdiag_cp.testing import spawn


def ids_batch(S=8, **extra):
    return {"input_ids": torch.ones(1, S, dtype=torch.long), **extra}


@pytest.mark.parametrize(
    "batch, message",
    [
        ({"input_ids": torch.ones(2, 8, dtype=torch.long)}, "local batch size must be 1"),
        ({"input_ids": torch.ones(1, 8, dtype=torch.long), "inputs_embeds": torch.ones(1, 8, 4)}, "exactly one"),
        ({"labels": torch.ones(1, 8, dtype=torch.long)}, "exactly one"),
        ({"input_ids": torch.ones(1, 0, dtype=torch.long)}, "empty"),
        (ids_batch(labels=torch.ones(1, 7, dtype=torch.long)), "labels"),
        (ids_batch(position_ids=torch.ones(3, 1, 9, dtype=torch.long)), "position_ids"),
        (ids_batch(attention_mask=torch.ones(1, 8, 8)), r"\[B, S\]"),
        (ids_batch(_packed_seq_ids=torch.tensor([[1, 1, 2, 2, 1, 1, 3, 3]])), "separate runs"),
    ],
)
def test_bad_batches_are_value_errors(batch, message):
    with pytest.raises(ValueError, match=message):
        make_cp_blockdiag_batch_and_ctx(None, None, batch)


@pytest.mark.parametrize("knob", ["kv_exchange", "kernel", "layout"])
def test_unknown_config_values_list_the_choices(knob):
    with pytest.raises(ValueError, match="choose one of"):
        CPConfig(**{knob: "nope"})


def test_config_must_be_a_cpconfig():
    with pytest.raises(TypeError, match="CPConfig"):
        make_cp_blockdiag_batch_and_ctx(None, None, ids_batch(), config={"layout": "balanced"})


def test_plan_shards_rejects_bad_arguments():
    with pytest.raises(ValueError, match="choose one of"):
        plan_shards(torch.ones(1, 4, dtype=torch.long), 2, layout="zigzag")
    with pytest.raises(ValueError, match="positive"):
        plan_shards(torch.ones(4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="one packed row"):
        plan_shards(torch.ones(2, 4, dtype=torch.long), 2)


def qkv(L, H=4, Hk=4, D=8):
    return torch.randn(1, H, L, D), torch.randn(1, Hk, L, D), torch.randn(1, Hk, L, D)


def test_sdpa_inside_a_step_checks_shapes():
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch())
    with train_ctx():
        with pytest.raises(ValueError, match="shard of length 8"):
            cp_blockdiag_sdpa(*qkv(7))
        q, k, v = qkv(8, H=4, Hk=2)
        with pytest.raises(ValueError, match="enable_gqa"):
            cp_blockdiag_sdpa(q, k, v)
        q, k, v = qkv(8, H=4, Hk=3)
        with pytest.raises(ValueError, match="multiple"):
            cp_blockdiag_sdpa(q, k, v, enable_gqa=True)
        assert cp_blockdiag_sdpa(*qkv(8, H=4, Hk=2), enable_gqa=True).shape == (1, 4, 8, 8)
        q, k, _ = qkv(8, H=4, Hk=2)
        with pytest.raises(ValueError, match="same batch, heads and length"):  # values of other heads than keys
            cp_blockdiag_sdpa(q, k, torch.randn(1, 4, 8, 5), enable_gqa=True)
        with pytest.raises(ValueError, match="query head_dim 8 != key head_dim 5"):
            cp_blockdiag_sdpa(q, torch.randn(1, 2, 8, 5), torch.randn(1, 2, 8, 5), enable_gqa=True)
        assert cp_blockdiag_sdpa(q, k, torch.randn(1, 2, 8, 5), enable_gqa=True).shape == (1, 4, 8, 5)  # MLA


def test_dropout_needs_a_kernel_that_has_it():
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch(), config=CPConfig(kernel="sdpa"))
    with train_ctx(), pytest.raises(ValueError, match="no attention dropout"):
        cp_blockdiag_sdpa(*qkv(8), dropout_p=0.1)


def test_dropout_equals_a_reference_with_the_same_generator_state():
    """auto falls back to dense for dropout: the result is dropout(softmax) @ v with the same random draws."""
    doc = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch(_packed_seq_ids=doc))
    q, k, v = (t.double() for t in qkv(8))
    with train_ctx() as state, pytest.warns(UserWarning, match="uses 'dense'"):
        torch.manual_seed(0)
        out = cp_blockdiag_sdpa(q, k, v, dropout_p=0.5)
    assert [kernel.name for kernel in state.fallback_kernels] == ["dense"]
    assert state.call_notes.kernel_fallbacks == {"kernel='sdpa' has no attention dropout": "dense"}
    torch.manual_seed(0)
    scores = (q[0] @ k[0].transpose(-1, -2)) / 8 ** 0.5
    same_doc = (doc[0, :, None] == doc[0, None, :]) & (doc[0, :, None] != 0)
    visible = same_doc & torch.ones(8, 8, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    keep = torch.rand_like(probs) >= 0.5
    expected = (probs * keep / 0.5) @ v[0]
    assert torch.allclose(out[0], expected, rtol=0, atol=1e-12)
    assert not torch.allclose(out[0], probs @ v[0])  # dropout did drop something


def test_outside_a_step_it_is_stock_sdpa():
    q, k, v = qkv(5)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(cp_blockdiag_sdpa(q, k, v, is_causal=True), expected)


def test_invalid_layer_features_are_refused_by_name_inside_a_step():
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch())
    q, k, v = qkv(8)
    heads = q.shape[1]
    bad = [(dict(sliding_window=0), "sliding_window must be a positive int"),
           (dict(sliding_window=True), "sliding_window must be a positive int"),
           (dict(softcap=-1.0), "softcap must be a positive number"),
           (dict(sinks=torch.zeros(heads + 1)), f"one logit per query head, \\[{heads}\\], got \\({heads + 1},\\)"),
           (dict(sinks=torch.zeros(heads, device="meta")), "sinks are on meta, the queries on cpu")]
    for features, message in bad:
        with train_ctx(), pytest.raises(ValueError, match=message):
            cp_blockdiag_sdpa(q, k, v, **features)
    with train_ctx():  # valid ones pass
        cp_blockdiag_sdpa(q, k, v, sliding_window=2, softcap=5.0, sinks=torch.zeros(heads))


def test_two_different_steps_cannot_be_active_together():
    ctx_a, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch())
    ctx_b, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch())
    with ctx_a():
        with ctx_a():  # the same step may be re-entered
            pass
        with pytest.raises(RuntimeError, match="already active"), ctx_b():
            pass


def test_checkpoint_recompute_after_the_step_ended_is_refused():
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch())
    q, k, v = (t.requires_grad_() for t in qkv(8))
    with train_ctx():
        out = torch.utils.checkpoint.checkpoint(cp_blockdiag_sdpa, q, k, v, use_reentrant=False)
    with pytest.raises(RuntimeError, match="inside `with train_ctx"):
        out.sum().backward()


def disagree_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = torch.tensor([[1, 1, 2, 2, 2, 3, 3, 3]]) if rank != 1 else torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3]])
    try:
        make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, ids_batch(_packed_seq_ids=ids))
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_ranks_that_disagree_fail_together():
    messages = spawn(disagree_worker, 3)
    assert all(m is not None and "disagree" in m for m in messages)


def group_mismatch_worker(rank, world):
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "cp"))
    with mock.patch.object(type(mesh), "get_group", lambda self, *a: dist.group.WORLD):
        try:
            make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, ids_batch())
        except ValueError as exc:
            return str(exc)
    return None


def test_cp_group_size_must_equal_mesh_size():
    messages = spawn(group_mismatch_worker, 2)
    assert all(m is not None and "mis-resolved" in m for m in messages)


def test_multi_dimensional_mesh_is_refused():
    messages = spawn(two_d_mesh_worker, 2)
    assert all(m is not None and "1-D" in m for m in messages)


def two_d_mesh_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    try:
        make_cp_blockdiag_batch_and_ctx(mesh, None, ids_batch())
    except ValueError as exc:
        return str(exc)
    return None


def test_missing_position_ids_value_is_filled():
    _, out = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch(position_ids=None))
    assert torch.equal(out["position_ids"], torch.arange(8).unsqueeze(0))


def test_tensors_on_another_device_than_the_step_are_refused():
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch())
    q, k, v = (t.to("meta") for t in qkv(8))
    with train_ctx(), pytest.raises(ValueError, match="planned on cpu"):
        cp_blockdiag_sdpa(q, k, v)


def one_bad_rank_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    batch = ids_batch() if rank != 2 else {"input_ids": torch.ones(2, 8, dtype=torch.long)}
    try:
        make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_batch_rejected_on_one_rank_fails_every_rank():
    messages = spawn(one_bad_rank_worker, 3)
    assert "batch size must be 1" in messages[2]
    assert all(m is not None and "rank(s) [2] rejected" in m for m in messages[:2])


def fake_flash_padding_worker(rank, world, checkpoint=None):
    """flash on CPU through a fake module, a rank of only padding, the a2a exchange: no hang
    (also when the layer is checkpointed: the padding rank must recompute with the others)."""
    import sys
    import types
    from dataclasses import replace
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    import blockdiag_cp.kernels as kernels
    import blockdiag_cp.kernels.choose as choose
    from blockdiag_cp.registry import KERNELS, Registry
    from blockdiag_cp.testing import ParityCase, run_parity_case

    fake = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        outs = []
        for i in range(cu_q.numel() - 1):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            qq, kk, vv = q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1)
            l, m = qq.shape[1], kk.shape[1]
            mask = torch.ones(l, m, dtype=torch.bool).tril(m - l) if causal else None
            o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=softmax_scale,
                                                                 enable_gqa=True)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    fake.flash_attn_varlen_func = flash_attn_varlen_func
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    on_cpu = Registry(KERNELS.family, tuple(replace(s, gpu_only=False) for s in KERNELS))  # flash allowed on CPU
    with mock.patch.dict(sys.modules, {"flash_attn": fake}), mock.patch.object(choose, "KERNELS", on_cpu):
        case = ParityCase((20, -20), heads=4, kv_heads=2, kv_exchange="a2a", kernel="flash", checkpoint=checkpoint)
        with mock.patch.object(kernels.FlashKernel, "check", lambda self, q, p: None):  # float64 on CPU
            return run_parity_case(case, mesh["cp"])


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_autograd_native_kernel_on_a_padding_rank_keeps_collectives_matched(checkpoint):
    results = spawn(fake_flash_padding_worker, 3, checkpoint)
    assert all(r.kernel == "flash" and r.out_err < 1e-12 and r.grad_err < 1e-12 for r in results)


def test_non_causal_modules_are_refused_inside_a_step():
    pytest.importorskip("transformers")
    import types

    from blockdiag_cp.hf import blockdiag_cp_attention

    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, ids_batch())
    encoder = types.SimpleNamespace(is_causal=False)
    with train_ctx(), pytest.raises(ValueError, match="not causal"):
        blockdiag_cp_attention(encoder, *qkv(8), None)


def test_unknown_keyword_arguments_are_named_once_per_call_site_and_change_nothing():
    import warnings

    from blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    q = torch.randn(1, 2, 6, 4)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(1, 6, dtype=torch.long)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with ctx():
            expected = cp_blockdiag_sdpa(q, q, q)
            for _ in range(3):  # one attention layer called three times: one warning
                out = cp_blockdiag_sdpa(q, q, q, sliding_windw=2)
    named = [w for w in caught if "sliding_windw" in str(w.message)]
    assert len(named) == 1 and "sliding_window" in str(named[0].message)
    assert torch.equal(out, expected)  # the misspelt window is ignored, as the seed's signature does
