"""Kernels against a direct float64 computation, on item tables with every shape the exchanges make."""

import pytest
import torch

from blockdiag_cp.kernels import CallOptions, DenseKernel, ItemAttention, ItemTable, SdpaKernel, merge_partial


def random_items(seed, L=40, N=60, window=None):
    """Disjoint query runs; each sees a random key range, causal (bottom-right) or full."""
    g = torch.Generator().manual_seed(seed)
    q_start, q_len, k_start, k_len, causal = [], [], [], [], []
    row = int(torch.randint(0, 3, (1,), generator=g))
    while row < L - 1:
        ql = int(torch.randint(1, 6, (1,), generator=g))
        ql = min(ql, L - row)
        is_causal = bool(torch.randint(0, 2, (1,), generator=g))
        kl = ql + int(torch.randint(0 if is_causal else 1 - ql, 12, (1,), generator=g))
        kl = max(kl, ql if is_causal else 1)
        ks = int(torch.randint(0, N - kl + 1, (1,), generator=g))
        for lst, val in zip((q_start, q_len, k_start, k_len, causal), (row, ql, ks, kl, is_causal)):
            lst.append(val)
        row += ql + int(torch.randint(0, 3, (1,), generator=g))
    t = lambda x: torch.tensor(x, dtype=torch.long)
    return ItemTable(t(q_start), t(q_len), t(k_start), t(k_len), torch.tensor(causal), L, N, window)


def direct(items, q, k, v, scale, softcap=None):
    """Row by row: softmax over the row's visible keys (scores capped at ``softcap * tanh(s / softcap)``)."""
    lo, hi = items.row_key_ranges()
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # [H, L, Dv]
    for r in range(q.shape[1]):
        if hi[r] > lo[r]:
            s = (q[:, r : r + 1] @ k[:, lo[r] : hi[r]].transpose(-1, -2)) * scale
            s = s if softcap is None else softcap * torch.tanh(s / softcap)
            out[:, r] = (torch.softmax(s, -1) @ v[:, lo[r] : hi[r]])[:, 0]
    return out


@pytest.mark.parametrize("kernel", [DenseKernel(), SdpaKernel()], ids=["dense", "sdpa"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_kernel_matches_direct_softmax_forward_and_backward(kernel, seed, heads, window):
    H, Hk = heads
    items = random_items(seed, window=window)
    g = torch.Generator().manual_seed(100 + seed)
    q = torch.randn(H, 40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(Hk, 60, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    upstream = torch.randn(H, 40, 8, generator=g, dtype=torch.float64)
    ref = direct(items, q, k, v, 0.3)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, v))
    out = ItemAttention.apply(q, k, v, kernel, kernel.prepare(items, torch.device("cpu")), CallOptions(0.3))
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    assert (out - ref).abs().max() < 1e-12
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("kernel", [DenseKernel(), SdpaKernel()], ids=["dense", "sdpa"])
@pytest.mark.parametrize("v_dim", [5, 12])  # narrower (MLA) and wider values than the 8-wide queries and keys
@pytest.mark.parametrize("window, softcap, seed", [(None, None, 0), (3, None, 1), (None, 2.0, 2), (1, None, 3)])
def test_kernel_with_another_value_head_dim_matches_direct_softmax(kernel, v_dim, window, softcap, seed):
    """Note [Unequal head dims]: ``v [Hk, N, Dv]`` with ``Dv != Dk``: output ``[H, L, Dv]``, gradients dq and dk
    at ``Dk``, dv at ``Dv`` (the sdpa kernel's fused calls run zero-padded; softcap runs plain math unpadded)."""
    items = random_items(seed, window=window)
    g = torch.Generator().manual_seed(200 + seed)
    q = torch.randn(4, 40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 60, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 60, v_dim, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 40, v_dim, generator=g, dtype=torch.float64)
    ref = direct(items, q, k, v, 0.3, softcap)
    out = ItemAttention.apply(q, k, v, kernel, kernel.prepare(items, torch.device("cpu")), CallOptions(0.3, 0.0, softcap))
    assert out.shape == (4, 40, v_dim) and (out - ref).abs().max() < 1e-12
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    assert [tuple(t.shape) for t in grads] == [(4, 40, 8), (2, 60, 8), (2, 60, v_dim)]
    for got, want in zip(grads, torch.autograd.grad((ref * upstream).sum(), (q, k, v))):
        assert (got - want).abs().max() < 1e-12


def test_torchs_cpu_fused_op_still_wants_one_head_dim():
    """Why the sdpa kernel pads (Note [Unequal head dims]): torch's CPU flash op refuses values of another
    width. If a torch release accepts them, `CpuFusedOps.equal_head_dims` can become False (no padding)."""
    from blockdiag_cp.kernels.fused_ops import CpuFusedOps, MathOps

    assert CpuFusedOps.equal_head_dims and not MathOps.equal_head_dims
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="same head size"):
        CpuFusedOps().fwd(q, k, v, True, 0.3)


def test_rows_without_items_are_zero_with_minus_inf_lse():
    none = torch.zeros(0, dtype=torch.long)
    items = ItemTable(none, none, none, none, none.bool(), 5, 3)
    kernel = SdpaKernel()
    q, k = torch.randn(2, 5, 4), torch.randn(2, 3, 4)
    o, lse, _ = kernel.forward(kernel.prepare(items, torch.device("cpu")), q, k, k, CallOptions(0.5))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isinf(lse).all()


def test_merge_of_two_empty_partials_stays_finite():
    o = torch.zeros(2, 3, 4)
    lse = torch.full((2, 3), float("-inf"))
    merged, merged_lse = merge_partial(o, lse, o, lse)
    assert torch.equal(merged, o) and torch.isinf(merged_lse).all()


def test_item_table_rejects_overlapping_rows():
    t = lambda *x: torch.tensor(x)
    with pytest.raises(AssertionError):
        ItemTable(t(0, 1), t(2, 2), t(0, 0), t(2, 2), torch.tensor([True, True]), 4, 4)


def test_dense_dropout_is_seeded_and_unbiased_in_expectation():
    items = ItemTable(torch.tensor([0]), torch.tensor([64]), torch.tensor([0]), torch.tensor([64]),
                      torch.tensor([True]), 64, 64)
    kernel = DenseKernel()
    plan = kernel.prepare(items, torch.device("cpu"))
    q, k = torch.randn(1, 64, 8, dtype=torch.float64), torch.randn(1, 64, 8, dtype=torch.float64)
    v = torch.ones(1, 64, 8, dtype=torch.float64)
    torch.manual_seed(0)
    a, _, _ = kernel.forward(plan, q, k, v, CallOptions(0.3, 0.5))
    torch.manual_seed(0)
    b, _, _ = kernel.forward(plan, q, k, v, CallOptions(0.3, 0.5))
    assert torch.equal(a, b)
    assert abs(a.mean().item() - 1.0) < 0.1  # with v == 1 the undropped output is exactly 1


def test_first_touch_calls_write_each_gradient_row_once_and_zero_only_the_rest():
    """Note [First-touch gradient rows]: the squares write their query and key rows; a prefix call
    is first on keys no earlier call read, and adds onto the others; padding rows and keys no
    first-touch call writes are the rows zeroed first."""
    from blockdiag_cp.kernels.sdpa import fused_call_table

    t = lambda *v: torch.tensor(v)  # noqa: E731
    # query rows: piece A [0, 4) and piece B [5, 8) of one document; row 4 is padding.
    # key buffer: [0, 2) keys received from another rank, [2, 6) piece A's, [6, 9) piece B's,
    # [9, 11) keys of a block only a non-causal (ring-style) item reads, twice.
    items = ItemTable(t(0, 5), t(4, 3), t(0, 0), t(6, 9), torch.tensor([True, True]), 8, 11)
    calls = list(fused_call_table(items, torch.device("cpu")))
    shapes = [(c.causal, c.merge, c.q.length, c.k.length, c.q_first, c.k_first) for c in calls]
    assert shapes == [
        (True, False, 8, 8, True, True),  # both squares, bucketed into one call: first on q and k
        (False, True, 4, 2, False, True),  # A's prefix: first to read the received keys
        (False, True, 3, 6, False, False),  # B's prefix: every key it reads was read before
    ], shapes
    table = fused_call_table(items, torch.device("cpu"))
    assert table.zero_q_rows.tolist() == [4] and table.zero_k_rows.tolist() == [9, 10]
    ring = ItemTable(t(0, 4), t(4, 4), t(9, 9), t(2, 2), torch.tensor([False, False]), 8, 11)
    (shared,) = fused_call_table(ring, torch.device("cpu"))
    assert (shared.q_first, shared.k_first) == (True, False)  # both items read keys 9-10: they must add
    assert fused_call_table(ring, torch.device("cpu")).zero_k_rows.tolist() == list(range(11))


def test_sdpa_writes_key_gradients_in_the_exchanges_rows():
    """Note [Key gradients in the exchange's layout]: with `key_grad_rows`, buffer row j's dk/dv
    land in row key_grad_rows[j] (the same values), and gradient rows no buffer row maps to are 0."""
    t = lambda *v: torch.tensor(v)  # noqa: E731
    items = ItemTable(t(0, 5), t(4, 3), t(0, 0), t(6, 9), torch.tensor([True, True]), 8, 11)
    # a [local | received]-like layout of 13 rows: buffer rows reversed, rows 0 and 7 unused
    _remapped_key_gradients_equal_the_plain_ones(items, torch.tensor([12, 11, 10, 9, 8, 6, 5, 4, 3, 2, 1]), 13)


def test_item_table_rejects_shared_or_outside_key_gradient_rows():
    t = lambda *x: torch.tensor(x)  # noqa: E731
    base = dict(q_start=t(0), q_len=t(2), k_start=t(0), k_len=t(2), causal=torch.tensor([True]), num_q_rows=2,
                num_k_rows=2)
    with pytest.raises(AssertionError, match="share"):
        ItemTable(**base, key_grad_rows=t(1, 1), num_key_grad_rows=3)
    with pytest.raises(AssertionError, match="out of bounds"):
        ItemTable(**base, key_grad_rows=t(0, 3), num_key_grad_rows=3)


@pytest.mark.parametrize("keys_after", [0, 3])
def test_adjacent_unpadded_squares_are_one_slice_call_and_exact(keys_after):
    """Note [Token-major rows and buckets]: documents of one bucket length that follow each other in the rows
    are one call read as a slice and written with one copy (no gather, no scatter); a document between them
    of another length, or keys placed elsewhere, falls back to indices; both equal the direct softmax."""
    from blockdiag_cp.kernels.sdpa import fused_call_table

    t = lambda *x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    # four 8-token documents (rows 0-31, keys 0-31) and one of 13 (rows 32-44, its own bucket of 16); keys
    # shifted by `keys_after` for the last two 8-token documents: the call's key rows are then not one run
    shift = [0, 0, keys_after, keys_after, keys_after]
    items = ItemTable(t(0, 8, 16, 24, 32), t(8, 8, 8, 8, 13), t(*(a + b for a, b in zip((0, 8, 16, 24, 32), shift))),
                      t(8, 8, 8, 8, 13), torch.ones(5, dtype=torch.bool), 48, 48)
    table = fused_call_table(items, torch.device("cpu"))
    eights = next(c for c in table if c.q.length == 8)
    assert eights.q.count == 4 and eights.q.start == 0 and eights.q.gather is None and eights.q.write_start == 0
    assert (eights.k.gather is None) == (keys_after == 0)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 48, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kernel = SdpaKernel()
    out = ItemAttention.apply(q, k, v, kernel, kernel.prepare(items, torch.device("cpu")), CallOptions(0.3))
    ref = direct(items, q, k, v, 0.3)
    upstream = torch.randn(2, 48, 8, generator=g, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad((out * upstream).sum(), (q, k, v)),
                         torch.autograd.grad((ref * upstream).sum(), (q, k, v))):
        assert (got - want).abs().max() < 1e-12
    assert (out - ref).abs().max() < 1e-12


def _remapped_key_gradients_equal_the_plain_ones(items, grad_rows, num_grad_rows):
    """The sdpa kernel's dq and dk/dv with `items` as they are and with their key gradients in `grad_rows`
    of `num_grad_rows` rows: the same values, moved; rows no buffer row maps to are 0. Token-major inputs."""
    from dataclasses import replace

    remapped = replace(items, key_grad_rows=grad_rows, num_key_grad_rows=num_grad_rows)
    kernel = SdpaKernel()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(items.num_q_rows, 2, 16, generator=gen, dtype=torch.float64).transpose(0, 1)
    k, v = (torch.randn(items.num_k_rows, 2, 16, generator=gen, dtype=torch.float64).transpose(0, 1) for _ in range(2))
    do = torch.randn(2, items.num_q_rows, 16, generator=gen, dtype=torch.float64)
    grads = []
    for table in (items, remapped):
        calls = kernel.prepare(table, torch.device("cpu"))
        o, lse, aux = kernel.forward(calls, q, k, v, CallOptions(0.25))
        grads.append(kernel.backward(calls, do, q, k, v, o, lse, aux, CallOptions(0.25)))
    (dq, dk, dv), (dq2, dk2, dv2) = grads
    assert torch.equal(dq, dq2) and dk2.shape == dv2.shape == (2, num_grad_rows, 16)
    unused = sorted(set(range(num_grad_rows)) - set(grad_rows.tolist()))
    for plain, mapped in ((dk, dk2), (dv, dv2)):
        assert torch.allclose(mapped[:, grad_rows], plain, rtol=0, atol=1e-12)
        assert torch.equal(mapped[:, unused], torch.zeros(2, len(unused), 16, dtype=torch.float64))


def test_key_gradient_rows_shifted_as_one_slice_and_beside_padded_items():
    """Note [Key gradients in the exchange's layout], the cases the reversed layout above does not reach:
    gradient rows that follow each other (a slice written at another start, also by a call that adds),
    and padded items whose pads must land in the gradient rows' own dummy row, not the buffer's."""
    t = lambda *v: torch.tensor(v)  # noqa: E731
    items = ItemTable(t(0, 5), t(4, 3), t(0, 0), t(6, 9), torch.tensor([True, True]), 8, 11)
    _remapped_key_gradients_equal_the_plain_ones(items, torch.arange(11) + 2, 13)  # rows 0-1 unused
    # a 9-token document (bucket 16) then a 3-token one (bucket 8, 5 pads); buffer row 0's gradient goes to
    # row 12, the buffer's own pad row index
    padded = ItemTable(t(0, 9), t(9, 3), t(0, 9), t(9, 3), torch.tensor([True, True]), 12, 12)
    _remapped_key_gradients_equal_the_plain_ones(padded, torch.tensor([12, *range(1, 12)]), 13)
