"""Round 2 of hardening: legal inputs that once gave silently wrong results, spurious errors or a crash.

Each case runs in one process and, where ranks are involved, on real gloo ranks.
"""

import math
import subprocess
import sys

import pytest
import torch

from blockdiag_cp import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_cp.testing import doc_ids_from_lengths, hang_timeout, oracle_attention, spawn

SEGMENTS = (5, 9, -2, 13, 4)  # S = 33; document 3 straddles ranks at cp = 2


def strided_layouts(H, S, D, seed=0):
    """(name, q [1, H, S, D]) with a last dimension that is not unit-stride, and a contiguous one."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(1, H, S, 2 * D, generator=g, dtype=torch.float64)
    permuted = torch.randn(1, D, H, S, generator=g, dtype=torch.float64).permute(0, 2, 3, 1)  # a [1, D, H, S] buffer
    return [("every_other", wide[..., ::2]), ("permuted", permuted), ("contiguous", wide[..., :D].contiguous())]


def run_rows(mesh, q_full, k_full, v_full, ids_1S, config, scale=None):
    """This rank's output rows and the step's positions for full-row q/k/v ``[1, H, S, D]`` (sharded here)."""
    batch = {"input_ids": torch.zeros_like(ids_1S), "_packed_seq_ids": ids_1S}
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=config)
    with train_ctx() as state:
        pos = state.positions
        real = pos < ids_1S.shape[1]
        shard = lambda t: torch.where(real[None, None, :, None], t[:, :, pos.clamp(max=ids_1S.shape[1] - 1)], 0)
        q_local = _restride_like(shard(q_full), q_full)
        out = cp_blockdiag_sdpa(q_local, shard(k_full), shard(v_full), scale=scale)
    return out, pos, real


def _restride_like(t, like):
    """`t` with the same memory order as `like` (so a non-unit-stride last dim stays one)."""
    if like.stride(-1) == 1:
        return t
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))
    buffer = t.permute(*order).contiguous()
    inverse = [order.index(d) for d in range(like.dim())]
    out = buffer.permute(*inverse)
    if out.stride(-1) == 1:  # same order as contiguous: widen the last dim instead
        out = torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)[..., ::2]
    return out


def strides_worker(rank, world, kernels_exchanges):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"] if world > 1 else None
    return check_strides(mesh, kernels_exchanges)


def check_strides(mesh, kernels_exchanges):
    ids = doc_ids_from_lengths(SEGMENTS).unsqueeze(0)
    S, H, D = ids.shape[1], 4, 8
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    errors = {}
    for name, q in strided_layouts(H, S, D):
        assert (q.stride(-1) == 1) == (name == "contiguous")
        ref = oracle_attention(q[0], k[0], v[0], ids[0], 1 / math.sqrt(D))
        for kernel, exchange in kernels_exchanges:
            out, pos, real = run_rows(mesh, q, k, v, ids, CPConfig(kernel=kernel, kv_exchange=exchange))
            errors[name, kernel, exchange] = float((out[0][:, real] - ref[:, pos[real]]).abs().max())
    return errors


COMBOS = [("auto", "auto"), ("sdpa", "ring"), ("dense", "a2a"), ("sdpa", "allgather")]


@pytest.mark.parametrize("world", [1, 2])
def test_queries_whose_last_dimension_is_not_unit_stride_are_exact(world, rank_pools):
    results = [check_strides(None, COMBOS)] if world == 1 else rank_pools(world).run(strides_worker, COMBOS)
    for errors in results:
        assert len(errors) == 3 * len(COMBOS)
        assert all(err < 1e-12 for err in errors.values()), errors


def test_non_positive_scale_is_exact():
    ids = doc_ids_from_lengths((6, -1, 9)).unsqueeze(0)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for kernel in ("sdpa", "dense"):
        for scale in (0.0, -0.7):
            out, pos, real = run_rows(None, q, k, v, ids, CPConfig(kernel=kernel), scale=scale)
            ref = oracle_attention(q[0], k[0], v[0], ids[0], scale)
            assert torch.isfinite(out).all(), (kernel, scale)
            assert (out[0][:, real] - ref[:, pos[real]]).abs().max() < 1e-12, (kernel, scale)


# --- documents whose positions do not restart at 0 -------------------------------------


def broken_positions(kind):
    """Two documents: (ids [1, S], position_ids [1, S]) whose only marker is the positions."""
    if kind == "start_at_1":  # DataCollatorWithFlattening(position_ids_start=1)
        pos = [1 + i for i in range(10)] + [1 + i for i in range(7)]
    else:  # a chunk of a longer document at 40..49 after one at 0..9
        pos = list(range(10)) + list(range(40, 50))
    return torch.tensor([pos])


@pytest.mark.parametrize("kind", ["start_at_1", "chunk"])
def test_position_breaks_split_documents_in_the_batch(kind):
    from blockdiag_cp import resolve_doc_ids

    pos = broken_positions(kind)
    ids = resolve_doc_ids({"position_ids": pos}, pos.shape[1], "cpu", 1)
    assert ids[0, 0] != ids[0, -1] and len(set(ids[0].tolist())) == 2
    assert ids[0].tolist() == [1] * 10 + [2] * (pos.shape[1] - 10)
    mrope = torch.stack([pos, pos, pos])  # [3, 1, S]: not split (image tokens do not step by one)
    assert resolve_doc_ids({"position_ids": mrope}, pos.shape[1], "cpu", 1).unique().tolist() == [1]


def tiny_llama(attn):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attn_implementation=attn)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def alone_logits(model, ids, pos, boundaries):
    """Each document alone (its own positions) through the model."""
    out, start = [], 0
    for end in (*boundaries, ids.shape[1]):
        out.append(model(input_ids=ids[:, start:end], position_ids=pos[:, start:end], use_cache=False).logits)
        start = end
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kind", ["start_at_1", "chunk"])
def test_position_breaks_split_documents_in_transformers_outside_a_step(kind):
    import blockdiag_cp.hf  # noqa: F401

    model = tiny_llama("blockdiag_cp")
    pos = broken_positions(kind)
    ids = torch.randint(0, 50, pos.shape, generator=torch.Generator().manual_seed(3))
    got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    want = alone_logits(model, ids, pos, (10,))
    assert (got - want).abs().max() < 1e-10


def position_break_worker(rank, world, kind):
    from torch.distributed.device_mesh import init_device_mesh

    import blockdiag_cp.hf  # noqa: F401
    from blockdiag_cp import gather_sequence

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    model = tiny_llama("blockdiag_cp")
    pos = broken_positions(kind)
    ids = torch.randint(0, 50, pos.shape, generator=torch.Generator().manual_seed(3))
    want = alone_logits(model, ids, pos, (10,))
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, {"input_ids": ids, "position_ids": pos})
    with train_ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        full = gather_sequence(logits)
    return float((full - want).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["start_at_1", "chunk"])
def test_position_breaks_split_documents_inside_a_step(kind, rank_pools):
    assert all(err < 1e-10 for err in rank_pools(2).run(position_break_worker, kind))


def test_padding_mask_with_restarting_positions_outside_a_step():
    """B = 1, a padding attention_mask and restarting position_ids: real tokens never see the padding."""
    import blockdiag_cp.hf  # noqa: F401

    model = tiny_llama("blockdiag_cp")
    lengths, pad = (6, 8), 3
    ids = torch.randint(0, 50, (1, sum(lengths) + pad), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([list(range(6)) + list(range(8)) + [0, 1, 2]])
    mask = torch.tensor([[1] * 14 + [0] * pad])
    got = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits[:, :14]
    want = alone_logits(model, ids[:, :14], pos[:, :14], (6,))
    assert (got - want).abs().max() < 1e-10
    left = model(input_ids=ids.flip(1), position_ids=pos.flip(1), attention_mask=mask.flip(1), use_cache=False)
    assert torch.isfinite(left.logits).all()


# --- the late-recompute guard: no spurious error, and no wrong gradients ----------------------


def test_ordinary_checkpointed_call_after_a_step_is_stock_sdpa():
    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]])
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids})
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
    with train_ctx():
        cp_blockdiag_sdpa(q, q, q).sum().backward()
    q2 = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)  # same shard length, no step
    out = torch.utils.checkpoint.checkpoint(cp_blockdiag_sdpa, q2, q2, q2, None, 0.0, True, use_reentrant=False)
    out.sum().backward()  # no "recomputed after the step ended" error
    q3 = q2.detach().clone().requires_grad_(True)
    torch.nn.functional.scaled_dot_product_attention(q3, q3, q3, is_causal=True).sum().backward()
    assert torch.allclose(q2.grad, q3.grad, rtol=0, atol=1e-12)


def late_backward_worker(rank, world, reentrant):
    from torch.distributed.device_mesh import init_device_mesh

    import blockdiag_cp.hf  # noqa: F401

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    model = tiny_llama("blockdiag_cp")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    lengths = (7, 12, 5)
    ids = torch.randint(0, 50, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, {"input_ids": ids, "position_ids": pos})
    with train_ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    try:
        logits.sum().backward()  # after train_ctx() exited: the recompute must refuse
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [True, False])
def test_transformers_backward_after_the_step_is_refused_on_every_rank(reentrant):
    messages = spawn(late_backward_worker, 2, reentrant)
    assert all(m is not None and "after the block-diagonal CP step ended" in m for m in messages), messages


# --- ranks that pass different heads, head dims or dtypes ------------------------------------


def mismatch_worker(rank, world, what):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    ids = doc_ids_from_lengths(SEGMENTS).unsqueeze(0)
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, {"input_ids": torch.zeros_like(ids),
                                                                     "_packed_seq_ids": ids})
    L = batch["input_ids"].shape[1]
    H, Hk, D, dtype = 4, 2, 8, torch.float32
    odd = rank == world - 1
    if odd and what == "heads":
        H, Hk = 8, 4
    if odd and what == "head_dim":
        D = 16
    if odd and what == "dtype":
        dtype = torch.float64
    q = torch.randn(1, H, L, D, dtype=dtype)
    kv = torch.randn(1, Hk, L, D, dtype=dtype)
    with train_ctx():
        try:
            cp_blockdiag_sdpa(q, kv, kv, enable_gqa=True)
        except ValueError as exc:
            return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("what", ["heads", "head_dim", "dtype"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_passing_different_shapes_or_dtypes_fail_together(what, world):
    messages = spawn(mismatch_worker, world, what)
    assert all(m is not None and "disagree on the attention call" in m for m in messages), messages


def bad_shard_worker(rank, world):
    """One rank passes a wrong shard length: that rank names it, the others name that rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    ids = doc_ids_from_lengths(SEGMENTS).unsqueeze(0)
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, {"input_ids": torch.zeros_like(ids),
                                                                     "_packed_seq_ids": ids})
    L = batch["input_ids"].shape[1] - (rank == 1)
    q = torch.randn(1, 4, L, 8)
    with train_ctx():
        try:
            cp_blockdiag_sdpa(q, q, q)
        except ValueError as exc:
            return str(exc)
    return None


@pytest.mark.slow
def test_a_rank_with_a_wrong_shard_fails_every_rank():
    messages = spawn(bad_shard_worker, 3)
    assert "shard of length" in messages[1]
    assert all(m is not None and "rank(s) [1] rejected their attention call" in m for m in (messages[0], messages[2]))


def test_meta_inputs_embeds_are_a_clear_error():
    batch = {"inputs_embeds": torch.empty(1, 8, 4, device="meta"), "_packed_seq_ids": torch.ones(1, 8, dtype=torch.long)}
    with pytest.raises(ValueError, match="meta device"):
        make_cp_blockdiag_batch_and_ctx(None, None, batch)


# --- the command line ---------------------------------------------------------------------


@pytest.mark.slow  # one CLI process per case; tests/contract/test_cli.py checks the error format fast
@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--docs", "unknown:5"], "uniform:N"),
        (["bench", "--docs", "uniform:0"], "N must be between 1"),
        (["bench", "--docs", "uniform:200", "--seq-len", "100"], "N must be between 1"),
        (["bench", "--docs", "5000,5000", "--seq-len", "8192"], "sum to at most"),
        (["verify", "--heads", "3", "--kv-heads", "2"], "multiple of --kv-heads"),
        (["verify", "--kernel", "flash"], "needs CUDA"),
        (["demo", "--kernel", "te"], "needs CUDA"),
    ],
)
def test_bad_settings_are_one_line_and_exit_code_2(argv, message):
    result = subprocess.run([sys.executable, "-m", "blockdiag_cp", *argv], capture_output=True, text=True,
                            timeout=hang_timeout(120))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_out_into_a_missing_folder_is_created_before_the_run(tmp_path):
    from blockdiag_cp.tools.cli import build_parser, settings_problem

    target = tmp_path / "new" / "deeper" / "demo.png"
    assert settings_problem(build_parser().parse_args(["demo", "--out", str(target)])) is None
    assert target.parent.is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    problem = settings_problem(build_parser().parse_args(["bench", "--out", str(blocker / "sub" / "prefix")]))
    assert problem is not None and "cannot create the folder" in problem


def test_document_counts_are_kept_exactly():
    from blockdiag_cp.tools.bench import doc_lengths

    for spec, S in (("uniform:100", 100), ("powerlaw:99", 100), ("powerlaw:300", 32768), ("uniform:7", 8192)):
        lengths = doc_lengths(spec, S)
        assert sum(lengths) == S and min(lengths) >= 1 and len(lengths) == int(spec.split(":")[1]), spec


# --- the property-based probe that found these: random strides, position offsets, masks --------


def probe_worker(rank, world, segments, starts, layout_kind, kernel, exchange, layout, seed):
    """Documents marked only by position breaks and a padding mask; q in a random memory layout."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    true_ids = doc_ids_from_lengths(segments)
    pos, docs = [], iter(starts)
    for n in segments:
        if n > 0:
            start = next(docs)
            pos += list(range(start, start + n))
        else:
            pos += [0] * -n
    S, H, Hk, D = true_ids.numel(), 4, 2, 8
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, S, D, generator=g, dtype=torch.float64) for h in (H, Hk, Hk))
    q = dict(strided_layouts(H, S, D, seed))[layout_kind] if layout_kind != "contiguous" else q
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    upstream = torch.randn(H, S, D, generator=g, dtype=torch.float64)
    batch = {"input_ids": torch.zeros(1, S, dtype=torch.long), "position_ids": torch.tensor([pos]),
             "attention_mask": (true_ids != 0).long().unsqueeze(0)}
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(mesh, None, batch,
                                                   config=CPConfig(kernel=kernel, kv_exchange=exchange, layout=layout))
    with train_ctx() as state:
        p = state.positions
        real = p < S
        shard = lambda t: torch.where(real[None, None, :, None], t[:, :, p.clamp(max=S - 1)], 0)
        out = cp_blockdiag_sdpa(_restride_like(shard(q), q), shard(k), shard(v), enable_gqa=True)
        (out[0][:, real] * upstream[:, p[real]]).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for grad in grads:
        dist.all_reduce(grad)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = oracle_attention(qq[0], kk[0], vv[0], true_ids, 1 / math.sqrt(D))
    (ref * upstream).sum().backward()
    out_err = float((out[0].detach()[:, real] - ref.detach()[:, p[real]]).abs().max()) if bool(real.any()) else 0.0
    grad_err = max(float((a - b.grad).abs().max()) for a, b in zip(grads, (qq, kk, vv)))
    return out_err, grad_err


@pytest.fixture(scope="module")
def pool2():
    from blockdiag_cp.testing import RankPool

    with RankPool(2) as p:
        yield p


def test_probe_random_strides_position_offsets_and_masks(pool2):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    segments = st.lists(st.one_of(st.integers(1, 12), st.integers(-4, -1)), min_size=1, max_size=8).filter(
        lambda s: any(n > 0 for n in s))

    @settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(segs=segments, offsets=st.lists(st.integers(0, 50), min_size=8, max_size=8),
           layout_kind=st.sampled_from(["every_other", "permuted", "contiguous"]),
           combo=st.sampled_from([("sdpa", "auto"), ("sdpa", "ring"), ("dense", "a2a"), ("sdpa", "allgather")]),
           layout=st.sampled_from(["contiguous", "balanced"]), seed=st.integers(0, 99))
    def probe(segs, offsets, layout_kind, combo, layout, seed):
        starts, previous_end = [], None
        for n, offset in zip((n for n in segs if n > 0), offsets):
            start = offset if offset != previous_end else offset + 2  # never continue the previous document
            starts.append(start)
            previous_end = start + n
        for out_err, grad_err in pool2.run(probe_worker, tuple(segs), tuple(starts), layout_kind, *combo, layout, seed):
            assert out_err < 1e-10 and grad_err < 1e-10, (segs, starts, layout_kind, combo, layout, out_err, grad_err)

    probe()


def new_group_worker(rank, world):
    import torch.distributed as dist

    dist.new_group(list(range(world)))


def test_a_pool_reports_the_process_groups_its_ranks_hold(pool2):
    """The suite replaces pools whose idle gloo groups would poll a small machine busy."""
    pool2.run(new_group_worker)
    before = pool2.groups_held
    assert before >= 2  # the default group and the new one
    pool2.run(new_group_worker)
    assert pool2.groups_held == before + 1
