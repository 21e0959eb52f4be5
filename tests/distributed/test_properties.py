"""Property-based parity, document isolation, determinism, low precision, linear memory."""

import resource

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiag_cp.testing import ParityCase, reference_error, run_parity_case, spawn

EXCHANGES = ("allgather", "halo", "a2a", "ring", "auto")


def mesh_worker(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return [run_parity_case(case, mesh["cp"]) for case in cases]


@pytest.fixture(params=[2, 3, 4])
def pool(request, rank_pools):
    return rank_pools(request.param)


segments = st.lists(st.one_of(st.integers(1, 24), st.integers(-6, -1)), min_size=1, max_size=12).filter(
    lambda s: any(n > 0 for n in s)
)
heads = st.sampled_from([(4, 4), (4, 2), (6, 3), (8, 1)])


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(segs=segments, hk=heads, layout=st.sampled_from(["contiguous", "balanced"]), seed=st.integers(0, 99))
def test_random_layouts_match_the_oracle(pool, segs, hk, layout, seed):
    cases = [ParityCase(tuple(segs), heads=hk[0], kv_heads=hk[1], kv_exchange=ex, kernel=kernel, layout=layout,
                        seed=seed) for ex in EXCHANGES for kernel in ("dense", "sdpa")]
    for rank_results in pool.run(mesh_worker, cases):
        for r in rank_results:
            assert r.out_err < 1e-10 and r.grad_err < 1e-10, (r.case, r.out_err, r.grad_err)


def isolation_worker(rank, world, segments, doc, combos):
    """For each (exchange, layout): outputs and input gradients with and without perturbing `doc`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.testing import doc_ids_from_lengths

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = doc_ids_from_lengths(segments).unsqueeze(0)
    base = torch.randn(1, ids.shape[1], 3 * 2 * 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bump = torch.randn(int((ids[0] == doc).sum()), base.shape[-1], dtype=torch.float64)
    results = {}
    for exchange, layout in combos:
        runs = []
        for perturb in (False, True):
            x = base.clone()
            if perturb:
                x[0, ids[0] == doc] += bump
            x.requires_grad_(True)
            config = CPConfig(kv_exchange=exchange, layout=layout)
            batch = {"inputs_embeds": x, "_packed_seq_ids": ids}
            ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=config)
            with ctx() as state:
                q, k, v = (t.reshape(1, t.shape[1], 2, 8).transpose(1, 2) for t in batch["inputs_embeds"].split(16, -1))
                out = cp_blockdiag_sdpa(q, k, v)
                out.square().sum().backward()
            grad = x.grad.clone()
            dist.all_reduce(grad)
            runs.append((out.detach(), grad, state.positions))
        results[exchange, layout] = runs
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_perturbing_one_document_changes_no_other_bit(world):
    from blockdiag_cp.testing import doc_ids_from_lengths

    segments, doc = (9, 3, -2, 17, 1, 6, 5), 3  # document 3 (17 tokens) straddles ranks
    combos = [(ex, lay) for ex in EXCHANGES for lay in ("contiguous", "balanced")]
    ids = doc_ids_from_lengths(segments)
    for per_combo in spawn(isolation_worker, world, segments, doc, combos):
        assert sorted(per_combo) == sorted(combos)
        for combo, ((out_a, grad_a, pos), (out_b, grad_b, _)) in per_combo.items():
            real = pos < ids.numel()
            other_rows = torch.zeros_like(pos, dtype=torch.bool)
            other_rows[real] = ids[pos[real]] != doc
            assert torch.equal(out_a[:, :, other_rows], out_b[:, :, other_rows]), combo
            if bool((~other_rows & real).any()):
                assert not torch.equal(out_a, out_b), combo  # the perturbed document did change
            others = ids != doc
            assert torch.equal(grad_a[0, others], grad_b[0, others]), combo


@pytest.mark.slow
def test_runs_are_bitwise_deterministic():
    """Two runs in fresh processes give the same output rows and input gradients, bit for bit."""
    case_list = [ParityCase((11, 2, -3, 23, 4), heads=4, kv_heads=2, kv_exchange=ex, kernel=k, layout=lay)
                 for ex in ("ring", "a2a", "allgather") for k in ("sdpa", "dense") for lay in ("contiguous", "balanced")]
    first = spawn(mesh_worker, 3, case_list)
    second = spawn(mesh_worker, 3, case_list)
    for a_rank, b_rank in zip(first, second):
        assert len(a_rank) == len(b_rank) == len(case_list)
        for a, b in zip(a_rank, b_rank):
            assert torch.equal(a.output, b.output), a.case
            assert torch.equal(a.input_grad, b.input_grad), a.case
    for case in (ParityCase((11, 2, -3, 23, 4), kernel=k) for k in ("sdpa", "dense")):
        a, b = run_parity_case(case, None), run_parity_case(case, None)
        assert torch.equal(a.output, b.output) and torch.equal(a.input_grad, b.input_grad), case


def test_low_precision_within_reference_error(rank_pools):
    cases = [ParityCase((40, -30, 25, 60, -50), heads=8, kv_heads=2, head_dim=16, kv_exchange=ex, kernel=k,
                        layout=layout, dtype=dtype)
             for dtype in ("bfloat16", "float16") for layout in ("contiguous", "balanced")
             for ex in ("auto", "ring", "allgather") for k in ("sdpa", "dense")]
    bounds = {dtype: reference_error(next(c for c in cases if c.dtype == dtype)) for dtype in ("bfloat16", "float16")}
    for rank_results in rank_pools(4).run(mesh_worker, cases):
        assert len(rank_results) == len(cases)
        for r in rank_results:
            ref_out, ref_grad = bounds[r.case.dtype]
            assert r.out_err <= 2 * ref_out + 1e-3 and r.grad_err <= 2 * ref_grad + 1e-3, (r.case, r.out_err, r.grad_err)


def large_scores_worker(rank, world, combos):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.testing import doc_ids_from_lengths

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = doc_ids_from_lengths((12, -40, 9)).unsqueeze(0)  # rank 1 of 4 holds only padding
    finite = {}
    for dtype, kernel in combos:
        x = (torch.randn(1, ids.shape[1], 48, generator=torch.Generator().manual_seed(0)) * 300).to(dtype)
        x.requires_grad_(True)
        batch = {"inputs_embeds": x, "_packed_seq_ids": ids}
        ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, config=CPConfig(kernel=kernel))
        with ctx():
            q, k, v = (t.reshape(1, t.shape[1], 2, 8).transpose(1, 2) for t in batch["inputs_embeds"].split(16, -1))
            out = cp_blockdiag_sdpa(q, k, v)
            out.float().sum().backward()
        finite[str(dtype), kernel] = bool(torch.isfinite(out).all()) and bool(torch.isfinite(x.grad).all())
    return finite


def test_no_nan_with_huge_scores_and_padding_ranks(rank_pools):
    combos = [(dtype, kernel) for dtype in (torch.bfloat16, torch.float16, torch.float32) for kernel in ("sdpa", "dense")]
    for finite in rank_pools(4).run(large_scores_worker, combos):
        assert len(finite) == len(combos) and all(finite.values()), finite


def memory_worker(rank, world, S):
    from torch.distributed.device_mesh import init_device_mesh

    from blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.testing import doc_ids_from_lengths

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    lengths = [509] * (S // 509) + [S % 509]  # documents straddle every rank boundary
    ids = doc_ids_from_lengths([n for n in lengths if n]).unsqueeze(0)
    x = torch.randn(1, S, 3 * 2 * 16, requires_grad=True)
    with open("/proc/self/statm") as f:  # resident pages now (ru_maxrss may still hold start-up's peak)
        before = int(f.read().split()[1]) * resource.getpagesize()
    ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, {"inputs_embeds": x, "_packed_seq_ids": ids})
    with ctx():
        q, k, v = (t.reshape(1, t.shape[1], 2, 16).transpose(1, 2) for t in batch["inputs_embeds"].split(32, -1))
        cp_blockdiag_sdpa(q, k, v).sum().backward()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


@pytest.mark.slow
def test_memory_grows_linearly_with_sequence_length():
    sizes = (65536, 131072, 262144)  # large enough that the step, not start-up, sets the peak
    peaks = {S: max(spawn(memory_worker, 2, S)) for S in sizes}
    # linear: doubling S about doubles the step's peak (quadratic would quadruple it)
    assert peaks[262144] <= 2.6 * peaks[131072] and peaks[131072] <= 2.6 * peaks[65536], peaks
    one_L_by_S_mask = (262144 // 2) * 262144  # bytes of a single bool [L, S] mask at the largest size
    assert peaks[262144] < one_L_by_S_mask / 20, peaks


def saved_storage_bytes(kernel: str) -> tuple[int, int]:
    """Bytes of the distinct storages one layer saves for backward (through the saved-tensor
    hooks), and the bytes of q (world 1, 8 heads of 16; a 600-token document, which gets a
    call of its own, and two short ones, which are bucketed)."""
    from blockdiag_cp import CPConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.testing import doc_ids_from_lengths

    ids = doc_ids_from_lengths([600, 40, 24]).unsqueeze(0)
    S = ids.shape[1]
    x = torch.randn(1, S, 3 * 8 * 16, requires_grad=True)
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": x, "_packed_seq_ids": ids},
                                                  config=CPConfig(kernel=kernel))
    saved = []
    with ctx():
        q, k, v = (t.reshape(1, S, 8, 16).transpose(1, 2) for t in batch["inputs_embeds"].split(128, -1))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = cp_blockdiag_sdpa(q, k, v)
        out.sum().backward()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values()), q.numel() * 4


def test_sdpa_layer_saves_its_call_copies_not_the_inputs_again():
    # The sdpa kernel keeps the head-major q/k/v its calls read (Note [Head-major call
    # inputs]); the layer must save those through save_for_backward (so checkpointing
    # and saved-tensor hooks govern them; attributes on ctx would outlive a checkpointed
    # forward) and must not also save q and the K/V buffer: o + lse + one copy each of
    # q, k and v is about 4.1 q; the inputs again would add the projected row's 3 q.
    sdpa_bytes, q_bytes = saved_storage_bytes("sdpa")
    assert 3.5 * q_bytes <= sdpa_bytes <= 4.6 * q_bytes, sdpa_bytes / q_bytes
    dense_bytes, _ = saved_storage_bytes("dense")  # a kernel that reads its inputs in backward saves them
    assert dense_bytes >= 4 * q_bytes, dense_bytes / q_bytes
