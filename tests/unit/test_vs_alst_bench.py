"""benchmarks/vs_ulysses_alst.py's own measures: the row's targets, the leak probe's reading, the summary line."""

import importlib.util
import pathlib

import pytest
import torch

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "vs_ulysses_alst.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vs_ulysses_alst", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_targets_stop_at_every_document_end(bench):
    # documents [5, 6, 7] [8, 9] [4]: position_ids restart at each one's start
    ids = torch.tensor([5, 6, 7, 8, 9, 4])
    pos = torch.tensor([0, 1, 2, 0, 1, 0])
    assert bench.next_token_targets(ids, pos).tolist() == [6, 7, -100, 9, -100, -100]


def test_row_documents_fill_the_row_and_the_edit_touches_only_its_document(bench):
    docs = bench.row_documents("uniform:3", 100)
    assert [len(d) for d in docs] == [34, 33, 33] and all(0 < t < bench.VOCAB - 1 for d in docs for t in d)
    edited = bench.perturbed(docs, victim=1)
    assert edited[0] == docs[0] and edited[2] == docs[2] and [len(d) for d in edited] == [34, 33, 33]
    assert sum(a != b for a, b in zip(edited[1], docs[1])) >= 30  # (nearly) every token of the victim changed
    assert all(0 < t < bench.VOCAB - 1 for t in edited[1])
    assert [len(d) for d in bench.row_documents("one", 64)] == [64]


def test_leak_reads_only_the_other_documents(bench):
    before = torch.zeros(10, dtype=torch.float64)
    after = before.clone()
    after[0:4] = 5.0  # the victim (document 0, 4 tokens) changes as much as it likes
    assert bench.leak(before, after, [4, 6]) == 0.0
    after[9] = -0.25  # the last token of the other document moved: that is the leak
    assert bench.leak(before, after, [4, 6]) == 0.25
    after2 = before.clone()
    after2[3] = 1.0  # the victim's last position, its last index (an off-by-one would count it)
    assert bench.leak(before, after2, [4, 6]) == 0.0
    assert bench.leak(before, after2, [3, 7]) == 1.0  # now position 3 belongs to the other document
    assert bench.leak(before, after, [10]) is None  # one document: nothing to leak into


def test_leak_of_a_middle_victim(bench):
    before = torch.zeros(9, dtype=torch.float64)
    after = before.clone()
    after[3:6] = 2.0
    assert bench.leak(before, after, [3, 3, 3], victim=1) == 0.0
    after[2] = 0.5
    assert bench.leak(before, after, [3, 3, 3], victim=1) == 0.5


def test_summary_line_counts_and_ratios(bench):
    ok = lambda b, ms: {"exact": True, "bytes": b, "ms": ms}  # noqa: E731
    cases = [
        {"alst": {"exact": False, "bytes": 1000.0, "ms": 100.0}, "balanced": ok(10.0, 50.0), "ulysses": ok(1000.0, 80.0)},
        {"alst": {"exact": True, "bytes": 2000.0, "ms": 200.0}, "balanced": ok(1500.0, 300.0), "ulysses": ok(2000.0, 200.0)},
        {"alst": {"refused": "Attention head count 6 is not divisible by SP size 4"}, "balanced": ok(5.0, 9.0),
         "ulysses": {"exact": False, "bytes": 1.0, "ms": 1.0}},
    ]
    assert bench.summary_line(cases) == ("vs ALST: exact ours 2/3, ALST 1/3; bytes ours/ALST 0.01-1x; "
                                         "time ours/ALST 0.5-1.5x")
    assert bench.summary_line(cases[2:]) == "vs ALST: exact ours 0/1, ALST 0/1; bytes ours/ALST n/a; time ours/ALST n/a"


def test_ulysses_degree_is_the_largest_that_splits_heads_and_ranks(bench):
    assert [bench.ulysses_degree(h, sp) for h, sp in [(4, 2), (4, 4), (6, 4), (6, 2), (8, 4), (3, 4)]] == [2, 4, 2, 2, 4, 1]


def test_the_attention_meter_counts_the_calls_writes_forward_and_backward_and_nothing_else(bench, tmp_path):
    with open(tmp_path / "sink", "wb", buffering=0) as sink:
        class Writes(torch.autograd.Function):  # an attention that sends 1000 bytes forward and 500 backward
            @staticmethod
            def forward(ctx, x):
                sink.write(b"f" * 1000)
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                sink.write(b"b" * 500)
                return grad * 2

        class After(torch.autograd.Function):  # a later layer that writes in its backward: not the call's
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                sink.write(b"z" * 3000)
                return grad

        meter = bench.AttentionBytes()
        attention = meter.wrap(lambda module, q, k, v, mask, **kw: (Writes.apply(q + k + v), None))
        q, k, v = (torch.randn(4, requires_grad=True) for _ in range(3))
        out, weights = attention(None, q, k, v, None, dropout=0.0)
        sink.write(b"x" * 7777)  # between the call and its backward
        assert weights is None and meter.total == 1000
        After.apply(out).sum().backward()
        assert meter.total == 1500
        assert torch.equal(q.grad, torch.full((4,), 2.0))  # the brackets pass gradients through unchanged
