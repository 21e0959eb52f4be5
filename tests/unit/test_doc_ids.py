"""Document-id resolution (the seed's order, extended) and validation errors."""

import pytest
import torch

from blockdiag_cp import resolve_doc_ids
from blockdiag_cp.step.doc_ids import block_causal_mask, doc_starts, validate_doc_ids


def ids(*values):
    return torch.tensor([values])


def test_packed_seq_ids_win_over_everything():
    batch = {"_packed_seq_ids": ids(1, 1, 2, 2, 0), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    out = resolve_doc_ids(batch, 5, "cpu", 1)
    assert out.dtype == torch.long
    assert out.tolist() == [[1, 1, 2, 2, 0]]


def test_four_d_block_causal_mask_keeps_document_boundaries():
    doc = ids(1, 1, 1, 2, 2, 0, 3)
    mask = block_causal_mask(doc).unsqueeze(1)  # [1, 1, S, S] bool
    out = resolve_doc_ids({"attention_mask": mask}, 7, "cpu", 1)
    assert out.tolist() == [[1, 1, 1, 2, 2, 0, 3]]


def test_four_d_additive_float_mask():
    doc = ids(1, 1, 2, 2)
    allowed = block_causal_mask(doc).unsqueeze(1)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert resolve_doc_ids({"attention_mask": additive}, 4, "cpu", 1).tolist() == [[1, 1, 2, 2]]


def test_four_d_mask_that_is_not_block_causal_is_refused():
    full = torch.ones(1, 1, 4, 4, dtype=torch.bool)  # bidirectional
    with pytest.raises(ValueError, match="not block-causal"):
        resolve_doc_ids({"attention_mask": full}, 4, "cpu", 1)


def test_two_d_validity_mask_and_indexed_mask():
    assert resolve_doc_ids({"attention_mask": ids(1, 1, 1, 0)}, 4, "cpu", 1).tolist() == [[1, 1, 1, 0]]
    assert resolve_doc_ids({"attention_mask": ids(1, 1, 2, 3)}, 4, "cpu", 1).tolist() == [[1, 1, 2, 3]]


def test_no_marker_means_one_document():
    assert resolve_doc_ids({}, 3, "cpu", 1).tolist() == [[1, 1, 1]]
    assert resolve_doc_ids({}, 2, "cpu", 2).tolist() == [[1, 1], [1, 1]]


def test_cu_seq_lens_from_flattening_collator():
    batch = {"cu_seq_lens_q": torch.tensor([0, 2, 5], dtype=torch.int32)}
    assert resolve_doc_ids(batch, 6, "cpu", 1).tolist() == [[1, 1, 2, 2, 2, 0]]


def test_restarting_position_ids_split_documents():
    batch = {"position_ids": ids(0, 1, 2, 0, 1, 0)}
    assert resolve_doc_ids(batch, 6, "cpu", 1).tolist() == [[1, 1, 1, 2, 2, 3]]
    # plain positions do not split
    assert resolve_doc_ids({"position_ids": ids(0, 1, 2, 3)}, 4, "cpu", 1).tolist() == [[1, 1, 1, 1]]


def test_restarts_combine_with_validity_mask():
    batch = {"attention_mask": ids(1, 1, 1, 1, 0), "position_ids": ids(0, 1, 0, 1, 0)}
    assert resolve_doc_ids(batch, 5, "cpu", 1).tolist() == [[1, 1, 2, 2, 0]]


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.tensor([[1.0, 1.0, 2.0]]), "integers"),
        (torch.tensor([[1, -1, 2]]), ">= 0"),
        (torch.tensor([[1, 1]]), "shaped like the sequence"),
        (torch.tensor([1, 1, 2]), "shaped like the sequence"),
        (torch.tensor([[1, 2, 1]]), "separate runs"),
        (torch.tensor([[1, 0, 1]]), "separate runs"),
    ],
)
def test_invalid_doc_ids_are_value_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        resolve_doc_ids({"_packed_seq_ids": bad}, 3, "cpu", 1)


def test_interior_padding_is_valid():
    out = validate_doc_ids(ids(1, 1, 0, 0, 2, 0, 3), 7, 1)
    assert out.tolist() == [[1, 1, 0, 0, 2, 0, 3]]


def test_unknown_attention_mask_shape_is_refused():
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        resolve_doc_ids({"attention_mask": torch.ones(1, 3, 3)}, 3, "cpu", 1)


def test_bad_cu_seq_lens_are_refused():
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        resolve_doc_ids({"cu_seq_lens_q": torch.tensor([0, 4, 2])}, 4, "cpu", 1)


def test_doc_starts():
    assert doc_starts(torch.tensor([1, 1, 0, 2, 2, 2, 0])).tolist() == [0, 0, 2, 3, 3, 3, 6]


def test_validity_mask_with_interior_padding_and_restarts():
    batch = {"attention_mask": ids(1, 1, 0, 1, 1), "position_ids": ids(0, 1, 0, 0, 1)}
    assert resolve_doc_ids(batch, 5, "cpu", 1).tolist() == [[1, 1, 0, 3, 3]]
