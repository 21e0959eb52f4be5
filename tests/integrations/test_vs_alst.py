"""DeepSpeed's ALST (Ulysses SP through the Trainer, ``sp_attn_implementation="sdpa"``: its attention on CPU) lets
packed documents attend to each other; the mixin on the same row and ranks does not (benchmarks/vs_ulysses_alst.py's
own runs, on real gloo ranks; docs/vs_ulysses.md)."""

import importlib
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_alst_with_sdpa_attends_across_packed_documents_and_the_mixin_does_not(monkeypatch):
    pytest.importorskip("deepspeed")
    if not hasattr(pytest.importorskip("accelerate.utils"), "DeepSpeedSequenceParallelConfig"):
        pytest.skip("this accelerate has no DeepSpeed sequence parallelism (it came in 1.12)")
    from blockdiag_cp.testing import spawn

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned ranks import the benchmark by name, as its own do
    bench = importlib.import_module("vs_ulysses_alst")
    docs = bench.row_documents("uniform:4", 256)
    case = dict(row="uniform:4", docs=docs, heads=2, kv_heads=2, tokens=256, steps=1, zero=1, attn="sdpa",
                dtype="float32", sp=2)
    ids = bench.collate([{"documents": docs}])
    targets = bench.next_token_targets(ids["input_ids"][0], ids["position_ids"][0])
    leaks = {}
    for method in ("alst", "balanced"):
        got = spawn(bench.run_method, 2, case, method, timeout=600)[0]
        assert got["attn"] == ("sdpa" if method == "alst" else "blockdiag_cp")
        before, after = (bench.token_losses(x, targets) for x in got["logits"])
        leaks[method] = bench.leak(before, after, [len(d) for d in docs])
    assert leaks["balanced"] == 0.0  # bit for bit: no other document's loss moves
    assert leaks["alst"] > 1e-2  # its sdpa drops the packed mask: a plain causal mask over the whole row
