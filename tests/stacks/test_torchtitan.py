"""torchtitan's trainer with document-packed rows under blockdiag-cp (issue #48, docs/torchtitan.md).

The slow tests share two launches of torchtitan's own training on CPU gloo ranks (tests/stacks/torchtitan_run.py):
a tiny llama3 (torchtitan's debugmodel flavor cut to 2 layers) from a config_registry module this test writes
(torchtitan 0.3.0's config format: a Python function plus ``--section.key`` CLI overrides), its own text
dataloader packing a tiny local dataset with a tiny local tokenizer (nothing downloaded):

* no CP, one rank (``blockdiag_cp.cp_degree`` 1): the reference;
* cp 2 on two ranks: per-step losses, grad norms, final parameters and the first row's per-token losses
  equal the reference (float32 training, so 1e-5);
* the leak probe, in the cp 2 launch: the first row again with its first document perturbed (same length):
  every other document's per-token losses are unchanged (1e-6), the perturbed document's moved.

torchtitan 0.3.0's Trainer does not run on a CPU-only machine by itself (it picks "cuda" and dies at
``torch.cuda.set_device``); the runs go through `blockdiag_cp.integrations.torchtitan_cpu`, which points
torchtitan's device choice at the CPU. FSDP (torchtitan's ``fully_shard`` over the data ranks) runs on gloo.
"""

import pathlib

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan 0.3.0 imports it unconditionally (its MoE kernels)

from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from torchtitan_assets import documents, write_assets, write_dataset, write_tokenizer  # noqa: E402
from torchtitan_assets import launch as launch_torchtitan  # noqa: E402

from blockdiag_cp.integrations.torchtitan import (  # noqa: E402
    BlockDiagCPAttention,
    CPGroupRows,
    blockdiag_config,
    check_options,
    doc_ids_from_positions,
    route_attention,
)

HERE = pathlib.Path(__file__).resolve().parent
SEQ_LEN = 192
STEPS = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan")
    write_assets(root)
    return root


def launch(root: pathlib.Path, name: str, world: int, *overrides: str) -> dict:
    """One torchtitan run under torchrun; returns what torchtitan_run.py recorded."""
    out = launch_torchtitan(root, name, world, HERE / "torchtitan_run.py", (str(root / "data_perturbed"),),
                            overrides, SEQ_LEN, STEPS)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(assets):
    """The two launches every slow comparison shares."""
    return {"ref": launch(assets, "ref", 1), "cp2": launch(assets, "cp2", 2, "--blockdiag_cp.cp_degree", "2")}


@pytest.mark.slow
def test_cp2_trains_as_the_run_without_cp(runs):
    ref, cp2 = runs["ref"], runs["cp2"]
    assert cp2["cp_degree"] == 2 and cp2["world"] == 2 and ref["world"] == 1
    assert len(ref["losses"]) == len(cp2["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(cp2["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cp2["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-4, atol=0)
    assert ref["params"].keys() == cp2["params"].keys()
    # float32 Adam: an element whose gradient is ~0 moves by up to lr x (a float32 rounding's sign), so a few
    # elements in 10^5 differ by ~1e-5 after 3 steps; any real difference moves every element by ~lr
    for name, p_ref in ref["params"].items():
        delta = cp2["params"][name] - p_ref
        assert delta.abs().max() < 5e-5 and delta.norm() < 1e-5 * p_ref.norm(), (name, delta.abs().max())
    probe_ref, probe_cp2 = ref["probe"], cp2["probe"]
    assert torch.equal(probe_ref["inputs"], probe_cp2["inputs"])  # the CP group read the reference's row
    valid = probe_ref["labels"] != -100
    torch.testing.assert_close(probe_cp2["nll"][valid], probe_ref["nll"][valid], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_perturbing_one_document_moves_no_other_documents_loss(runs):
    base, perturbed = runs["cp2"]["probe"], runs["cp2"]["probe_other"]
    assert torch.equal(base["doc_ids"], perturbed["doc_ids"])
    doc_ids = base["doc_ids"]
    assert int(doc_ids.max()) >= 3, "the probe row should hold several documents"
    first = doc_ids == 1
    assert not torch.equal(base["inputs"][first], perturbed["inputs"][first])
    assert torch.equal(base["inputs"][~first], perturbed["inputs"][~first])
    others = ~first & (base["labels"] != -100)
    torch.testing.assert_close(perturbed["nll"][others], base["nll"][others], rtol=0, atol=1e-6)
    assert (perturbed["nll"][first] - base["nll"][first]).abs().max() > 1e-3


def test_doc_ids_follow_torchtitans_own_document_boundaries(tmp_path):
    """torchtitan's text dataset packs documents into rows; the ids start a document exactly where its tokens do."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    write_tokenizer(tmp_path / "tok")
    docs = documents()
    write_dataset(tmp_path / "data", docs)
    tokenizer = HuggingFaceTokenizer(HuggingFaceTokenizer.Config(), tokenizer_path=str(tmp_path / "tok"))
    dataset = HuggingFaceTextDataset("c4_test", str(tmp_path / "data"), tokenizer, seq_len=SEQ_LEN)
    row, labels = next(iter(dataset))
    lengths = [len(t.split()) + 1 for t in docs]  # <s> + words as inputs; </s> is the last word's label
    expected = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[:SEQ_LEN]
    assert torch.equal(doc_ids_from_positions(row["positions"][None])[0], expected)
    eos_labels = (labels == tokenizer.eos_id).nonzero().flatten()
    assert torch.equal(expected[eos_labels + 1], expected[eos_labels] + 1)  # a document ends at its </s> target


def test_a_cp_group_reads_one_replicas_rows(tmp_path):
    """4 data ranks at cp 2: ranks 0, 1 read replica 0's rows and ranks 2, 3 replica 1's, as 2 replicas would."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    write_tokenizer(tmp_path / "tok")
    write_dataset(tmp_path / "data", documents())
    tokenizer = HuggingFaceTokenizer(HuggingFaceTokenizer.Config(), tokenizer_path=str(tmp_path / "tok"))
    rows = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(tmp_path / "data"))
    kwargs = {"tokenizer": tokenizer, "seq_len": SEQ_LEN, "local_batch_size": 1}

    def first_row(config, world, rank):
        return next(iter(config.build(dp_world_size=world, dp_rank=rank, **kwargs)))[0]["input"]

    grouped = [first_row(CPGroupRows.Config(rows=rows, cp_degree=2), 4, rank) for rank in range(4)]
    replicas = [first_row(rows, 2, replica) for replica in range(2)]
    for rank in range(4):
        assert torch.equal(grouped[rank], replicas[rank // 2])
    assert not torch.equal(replicas[0], replicas[1])
    with pytest.raises(ValueError, match="cp_degree=3 must divide the 4 data ranks"):
        CPGroupRows.Config(rows=rows, cp_degree=3).build(dp_world_size=4, dp_rank=0, **kwargs)


def test_leading_tokens_of_a_carried_over_document_are_a_document():
    positions = torch.tensor([[7, 8, 9, 0, 1, 0, 1, 2]])
    assert doc_ids_from_positions(positions).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]]


def test_route_attention_routes_every_layer_and_leaves_the_input_config():
    model = llama3_debugmodel().model_spec.model
    routed = route_attention(model)
    assert all(isinstance(layer.attention.inner_attention, BlockDiagCPAttention.Config) for layer in routed.layers)
    assert not any(isinstance(layer.attention.inner_attention, BlockDiagCPAttention.Config) for layer in model.layers)


def test_a_model_with_its_own_masks_is_refused():
    from torchtitan.models.gpt_oss.config_registry import gpt_oss_debugmodel

    with pytest.raises(ValueError, match="builds its own attention masks"):
        route_attention(gpt_oss_debugmodel().model_spec.model)


def test_the_routed_attention_refuses_to_run_outside_a_step_or_drop_an_argument():
    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx

    attention = BlockDiagCPAttention(BlockDiagCPAttention.Config())
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(RuntimeError, match="outside a blockdiag-cp step"):
        attention(q, q, q)
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.zeros(1, 8, dtype=torch.long),
                                                                "_packed_seq_ids": torch.tensor([[1] * 5 + [2] * 3])})
    k, v = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4)
    with train_ctx():
        out = attention(q, k, v)  # torchtitan's (B, L, N, H)
        with pytest.raises(ValueError, match="score_mod"):
            attention(q, k, v, score_mod=lambda score, *idx: score)
    for doc in (slice(0, 5), slice(5, 8)):  # each document alone, causal
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(t[:, doc].transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
        torch.testing.assert_close(out[:, doc], alone)


@pytest.mark.parametrize("path, value", [
    ("parallelism.context_parallel_degree", 2),
    ("parallelism.tensor_parallel_degree", 2),
    ("parallelism.spmd_backend", "spmd_types"),
    ("training.local_batch_size", 2),
    ("validator.enable", True),
    ("compile.enable", True),
])
def test_options_that_would_differ_are_refused_by_name(path, value):
    config = blockdiag_config(llama3_debugmodel(), cp_degree=2)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.local_batch_size = 1
    config.checkpoint.enable = False
    check_options(config)  # the recipe's options pass
    section, name = path.split(".")
    setattr(getattr(config, section), name, value)
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        check_options(config)
