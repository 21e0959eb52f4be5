"""The pieces of `blockdiag_cp.integrations.automodel` that need no NeMo AutoModel (issue #55): the model call's
pre-hook at cp 1 (documents kept apart outside a step) and inside a step, the config checks, the seed entry's
``shard_primary=`` flag. AutoModel's own code runs in tests/stacks/test_automodel.py (its own venv)."""

import pytest
import torch

pytest.importorskip("transformers")

import blockdiag_cp.hf  # noqa: E402,F401  registers attn_implementation="blockdiag_cp"
from blockdiag_cp import CPConfig, make_cp_blockdiag_batch_and_ctx  # noqa: E402
from blockdiag_cp.errors import CPTypeError  # noqa: E402
from blockdiag_cp.integrations import automodel  # noqa: E402
from blockdiag_cp.step.doc_ids import block_causal_mask  # noqa: E402
from blockdiag_cp.testing.oracle import doc_ids_from_lengths  # noqa: E402

SEGMENTS = (7, -3, 9, 1, 5)


def tiny_llama(attn: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float64)


def packed_row(restarting: bool = True):
    """AutoModel's packed row: positions restarting per document (0 on padding; else the row's 0..S-1, as for chunks
    of longer documents: only the ids mark the documents), ``_packed_seq_ids``, a 4-D block-causal mask."""
    doc_ids = doc_ids_from_lengths(SEGMENTS)
    ids = torch.randint(1, 32, (1, doc_ids.numel()), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) if n > 0 else torch.zeros(-n, dtype=torch.long) for n in SEGMENTS])
    if not restarting:
        positions = torch.arange(doc_ids.numel())
    return {"input_ids": ids, "position_ids": positions[None], "_packed_seq_ids": doc_ids[None],
            "attention_mask": block_causal_mask(doc_ids[None]).unsqueeze(1)}


def alone_logits(row) -> torch.Tensor:
    model = tiny_llama("sdpa")
    doc_ids = row["_packed_seq_ids"][0]
    out = torch.zeros(1, doc_ids.numel(), 32, dtype=torch.float64)
    for doc in doc_ids.unique().tolist():
        if doc:
            where = (doc_ids == doc).nonzero().flatten()
            out[:, where] = model(input_ids=row["input_ids"][:, where], position_ids=row["position_ids"][:, where]).logits
    return out


@pytest.mark.parametrize("drop,restarting", [((), True), (("_packed_seq_ids",), True), (("attention_mask",), True),
                                             (("attention_mask",), False)])
def test_cp1_model_call_keeps_documents_apart(drop, restarting):
    """At cp 1 AutoModel hands the model the collator's row; the pre-hook passes its documents as lengths (with
    positions that do not restart, only ``_packed_seq_ids`` marks them)."""
    row = packed_row(restarting)
    want = alone_logits(row)
    model = tiny_llama(automodel.ATTN_IMPLEMENTATION)
    model.register_forward_pre_hook(automodel._model_call_inputs, with_kwargs=True)
    call = {k: v for k, v in row.items() if k not in drop}
    got = model(**call, padding_mask=row["_packed_seq_ids"] == 0).logits
    real = row["_packed_seq_ids"][0] != 0
    assert (got[:, real] - want[:, real]).abs().max() < 1e-12
    without = tiny_llama(automodel.ATTN_IMPLEMENTATION)(input_ids=row["input_ids"]).logits  # one causal row
    assert (without[:, real] - want[:, real]).abs().max() > 1e-3


def test_in_a_step_the_metadata_leaves_the_call():
    row = packed_row()
    model = tiny_llama(automodel.ATTN_IMPLEMENTATION)
    model.register_forward_pre_hook(automodel._model_call_inputs, with_kwargs=True)
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, dict(row), loss_mask=torch.ones(1, 25))
    assert {"padding_mask", "_packed_seq_ids", "loss_mask"} <= set(batch)
    with train_ctx():
        got = model(**batch).logits  # the blockdiag_cp attention refuses arguments it does not apply
    real = row["_packed_seq_ids"][0] != 0
    assert (got[:, real] - alone_logits(row)[:, real]).abs().max() < 1e-12


def test_config_checks():
    assert automodel._checked_config(None).layout == "balanced"
    assert automodel._config_of("contiguous", None).layout == "contiguous"
    own = CPConfig(layout="contiguous", kv_exchange="allgather")
    assert automodel._config_of("balanced", own) is own
    with pytest.raises(ValueError, match="equal shards"):
        automodel._checked_config(CPConfig(layout="grouped"))
    with pytest.raises(CPTypeError):
        automodel._checked_config({"layout": "balanced"})
    assert automodel._load_kwargs({"torch_dtype": "bfloat16", "x": 1}) == {"dtype": torch.bfloat16, "x": 1}
    assert automodel._load_kwargs({"dtype": "torch.float32"}) == {"dtype": torch.float32}
    assert automodel._load_kwargs({"dtype": "auto"}) == {"dtype": "auto"}


def test_seed_entry_shard_primary():
    row = packed_row()
    assert len(make_cp_blockdiag_batch_and_ctx(None, None, dict(row), shard_primary=True)) == 2
    with pytest.raises(ValueError, match="shard_primary=False"):
        make_cp_blockdiag_batch_and_ctx(None, None, dict(row), shard_primary=False)
