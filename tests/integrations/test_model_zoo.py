"""The decoder families people pack: sliding windows, alternating local/global layers, softcapping, sinks.

Tiny random Mistral, Qwen2, Gemma 2, Gemma 3 and gpt-oss, with windows shorter than the
documents, at cp = 2 and 3, both layouts, every CPU exchange: logits, loss and
parameter gradients equal each document run alone through the same transformers model.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")


LENGTHS = (7, 12, 5, 9, 3, 14)  # windows of 4 cut every document but the 3-token one
VOCAB = 50
#: name -> (config class, model class, config kwargs, dtype, reference attention, tolerance)
ZOO = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4), torch.float64, "sdpa", 1e-10),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
              torch.float64, "sdpa", 1e-10),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=4, head_dim=8, attn_logit_softcapping=20.0,
                                                         final_logit_softcapping=None),
               torch.float64, "eager", 1e-6),  # eager: softmax in float32 (the only path with softcapping)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=4, head_dim=8), torch.float64, "sdpa",
               1e-8),  # Gemma's RMSNorm runs in float32 inside a float64 model: its weight gradients differ by 1e-9
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(sliding_window=4, head_dim=8, num_local_experts=4,
                                                          num_experts_per_tok=2),
                torch.float32, "eager", 2e-5),  # experts run in float32 only; eager is the path with sinks
}
EXCHANGES = ("auto", "a2a", "halo", "allgather", "ring")


def make_model(name, attn):
    config_cls, model_cls, extra, dtype, _, _ = ZOO[name]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation=attn, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype)
    if name == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()  # learned sinks start at 0: make them matter
    return model


def packed_row():
    return sweep.packed_row(LENGTHS, VOCAB)


def reference(name):
    """Each document alone through the model's own attention: logits, mean loss, parameter gradients."""
    model = make_model(name, ZOO[name][4])
    ids, _ = packed_row()
    logits, loss_sum, start = [], 0.0, 0
    for n in LENGTHS:
        out = model(input_ids=ids[:, start : start + n], use_cache=False).logits
        logits.append(out.detach())
        loss_sum = loss_sum + torch.nn.functional.cross_entropy(out[0, :-1].double(), ids[0, start + 1 : start + n],
                                                                reduction="sum")
        start += n
    loss = loss_sum / sum(n - 1 for n in LENGTHS)
    loss.backward()
    return torch.cat(logits, 1), loss.item(), [p.grad.clone() for p in model.parameters()]


def zoo_worker(rank, world, names):
    from torch.distributed.device_mesh import init_device_mesh

    import blockdiag_cp.hf  # noqa: F401
    from blockdiag_cp import CPConfig

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    worst = {}
    for name in names:
        ref_logits, ref_loss, ref_grads = reference(name)
        for layout in ("contiguous", "balanced"):
            for exchange in EXCHANGES:
                run = sweep.run_row_under_cp(make_model(name, "blockdiag_cp"), mesh,
                                             CPConfig(layout=layout, kv_exchange=exchange), LENGTHS, VOCAB)
                worst[name, layout, exchange] = (max(run.errors_against(ref_logits, ref_loss, ref_grads)),
                                                 ZOO[name][5])
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_model_families_match_each_document_run_alone(world, rank_pools):
    names = tuple(ZOO)
    for worst in rank_pools(world).run(zoo_worker, names):
        assert len(worst) == len(names) * 2 * len(EXCHANGES)
        bad = {key: err for key, (err, tol) in worst.items() if not err <= tol}
        assert not bad, bad


def test_sliding_window_outside_a_step_on_a_packed_row():
    import blockdiag_cp.hf  # noqa: F401

    ids, pos = packed_row()
    for name in ("mistral", "gemma2", "gpt_oss"):
        ref_logits, _, _ = reference(name)
        model = make_model(name, "blockdiag_cp")
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        scale = max(1.0, float(ref_logits.abs().max()))
        assert float((logits - ref_logits).detach().abs().max()) / scale <= ZOO[name][5], name


# -- the sweep of every causal LM of transformers (blockdiag_cp.testing.zoo) ------------------------------------------

from pathlib import Path  # noqa: E402

from blockdiag_cp.testing import zoo as sweep  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
#: the fast loop's models, at cp 3 and both layouts: a control, Llama 4 with documents past its temperature floor
#: (exact once prepared, refused unprepared), and one of each silently-wrong group of issue #34, refused by name
CURATED = {
    "llama": sweep.EXACT,
    "llama4_text (full attention, temperature floor 4)": sweep.PREPARED,
    "bloom": sweep.REFUSED,  # an own attention (ALiBi), outside the interface
    "mamba": sweep.REFUSED,  # no attention layer at all
    "doge": sweep.REFUSED,  # a learned mask handed to the attention
}


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_curated_causal_lms_are_exact_or_refused_by_name_at_cp3(layout, rank_pools):
    cases = [case for case in sweep.all_cases() if case.name in CURATED]
    results = sweep.sweep(rank_pools(3).run, cases, layout)
    assert {r.case: r.verdict for r in results} == CURATED, [(r.case, r.verdict, r.reason) for r in results]
    reasons = {r.case: r.reason for r in results}
    assert "BloomAttention" in reasons["bloom"] and "mask the model built itself" in reasons["doge"]


@pytest.mark.slow
def test_every_causal_lm_of_transformers_is_exact_or_refused_and_docs_show_the_sweep(rank_pools):
    """The full sweep (Note [The zoo sweep]): no model silently wrong; docs/models.md's table is its rendering
    (regenerate it with ``python -m blockdiag_cp.testing.zoo --write docs/models.md``)."""
    results = sweep.sweep(rank_pools(2).run, sweep.all_cases(), "balanced")
    bad = [(r.case, r.verdict, r.reason) for r in results if r.verdict not in sweep.ACCEPTED]
    assert not bad, bad
    assert len(results) == len(sweep.all_cases()) > 190
    assert sweep.committed_table(DOCS) == sweep.render_table(results, 2, "balanced")


def test_the_sweeps_verdicts_catch_a_wrong_result_and_a_crash():
    """The verdict logic, on made-up numbers: past the tolerance is wrong, a non-refusal error is a crash."""

    def run_wrong(model, ref, mesh, layout):
        return 2 * sweep.TOLERANCE

    def run_crash(model, ref, mesh, layout):
        raise KeyError("x")

    def run_refuse(model, ref, mesh, layout):
        raise ValueError("blockdiag-cp: refused")

    build = lambda: torch.nn.Linear(1, 1)  # noqa: E731
    reference = sweep.Reference(build().state_dict(), torch.ones(1, 2, 3), {})
    assert sweep._run_path(build, reference, None, "", (run_wrong,))[0] == sweep.WRONG
    assert sweep._run_path(build, reference, None, "", (run_crash,))[0] == sweep.CRASHED
    assert sweep._run_path(build, reference, None, "", (run_refuse,))[:2] == (sweep.REFUSED, "blockdiag-cp: refused")
    want = torch.tensor([1.0, 2.0 + 1e-3], dtype=torch.float64)
    assert sweep.relative(torch.tensor([1.0, 2.0], dtype=torch.float64), want) == pytest.approx(1e-3 / 2.001)
    assert sweep.relative(torch.ones(2), torch.zeros(2), floor=4.0) == 0.25  # against the model's scale
    assert sweep.relative(torch.zeros(2), torch.zeros(2)) == 0.0


def test_the_table_is_written_between_its_markers_and_read_back(tmp_path):
    results = [sweep.ZooResult("b", "BForCausalLM", sweep.REFUSED, "its own attention"),
               sweep.ZooResult("a", "AForCausalLM", sweep.EXACT, "", 1e-12)]
    table = sweep.render_table(results, 2, "balanced")
    assert table.index("| `a` |") < table.index("| `b` |") and "refused: its own attention" in table
    page = tmp_path / "models.md"
    page.write_text("# Models\n\nprose\n")
    sweep.write_table(page, table)
    sweep.write_table(page, table.replace("own attention", "own attention!"))  # replaced, not appended
    assert sweep.committed_table(page) == table.replace("own attention", "own attention!")
    assert page.read_text().startswith("# Models\n\nprose\n") and page.read_text().count(sweep.BEGIN) == 1
