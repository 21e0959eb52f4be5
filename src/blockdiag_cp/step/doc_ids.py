"""Document ids: resolve them from a batch, validate them, and derive runs and starts.

A document id tensor is ``[B, S]`` int64; 0 marks padding, every other value names
one document. Each document must be one contiguous run of positions; padding may sit
anywhere (between documents or at the tail). Attention is causal inside a document
and never crosses one, so the ids are all a CP step needs to rebuild the mask.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..plan.runs import doc_starts, run_starts, validate_doc_ids  # noqa: F401  (re-exported: the row's runs)


def _mask_4d_to_doc_ids(mask_B1SS: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, S]`` encoded by a 4-D block-causal mask ``[B, 1, S, S]``.

    A position is real when it may attend to itself (the diagonal); a new document
    starts at a real position that may not attend to its predecessor. Boolean and
    integer masks mark allowed pairs with nonzero values; floating masks are additive
    (0 = attend, a large negative value = masked), as SDPA and transformers use them.
    The mask must be exactly the block-causal mask of those documents, else a
    `ValueError` (a sliding-window or bidirectional mask cannot be represented).
    """
    if mask_B1SS.shape[1] != 1 or mask_B1SS.shape[2] != mask_B1SS.shape[3]:
        raise ValueError(
            f"a 4-D attention_mask must be [B, 1, S, S], got {tuple(mask_B1SS.shape)}"
        )
    allowed = mask_B1SS[:, 0] == 0 if mask_B1SS.is_floating_point() else mask_B1SS[:, 0] != 0
    real_BS = allowed.diagonal(dim1=-2, dim2=-1)
    sees_prev_BS = torch.zeros_like(real_BS)
    sees_prev_BS[:, 1:] = allowed.diagonal(offset=-1, dim1=-2, dim2=-1)
    starts_BS = real_BS & ~sees_prev_BS
    doc_ids = torch.where(real_BS, torch.cumsum(starts_BS.long(), dim=1), 0)
    rebuilt = block_causal_mask(doc_ids)
    if not torch.equal(rebuilt, allowed):
        raise ValueError(
            "attention_mask [B, 1, S, S] is not block-causal (causal inside documents, "
            "nothing across them); block-diagonal CP cannot represent it. Pass the "
            "per-token document ids as batch['_packed_seq_ids'] instead."
        )
    return doc_ids


def _cu_seqlens_to_doc_ids(cu_seqlens: torch.Tensor, seq_len: int, batch_size: int) -> torch.Tensor:
    """Document ids ``[1, S]`` from flattened cumulative lengths ``[n_docs + 1]``."""
    cu = cu_seqlens.reshape(-1).to(torch.long).cpu()
    if batch_size != 1:
        raise ValueError(f"cu_seq_lens_q describes one flattened row; the batch has B={batch_size}")
    if cu.numel() < 2 or cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > seq_len:
        raise ValueError(
            f"cu_seq_lens_q must start at 0, be non-decreasing and end at most at S={seq_len}; "
            f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}"
        )
    lengths = cu[1:] - cu[:-1]
    ids = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)
    return torch.cat([ids, ids.new_zeros(seq_len - ids.numel())]).unsqueeze(0)


def position_breaks(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: True where a position does not continue its predecessor by +1.

    transformers' rule for packed rows (``find_packed_sequence_indices``): a new
    sequence starts wherever consecutive ``position_ids`` do not step by exactly one,
    whether they restart at 0, at 1 (``position_ids_start=1``) or jump (a chunk of a
    longer document at positions 40..49 after one at 0..9). Position 0 is never a break.
    """
    breaks = torch.zeros_like(position_ids_BS, dtype=torch.bool)
    breaks[:, 1:] = position_ids_BS[:, 1:] != position_ids_BS[:, :-1] + 1
    return breaks


def split_at_position_breaks(doc_ids_BS: torch.Tensor, position_ids: Any) -> torch.Tensor:
    """Split documents where 2-D ``position_ids`` break (see `position_breaks`).

    Without this, a packed row whose only document marker is its ``position_ids``
    (transformers' ``DataCollatorWithFlattening``) would be one document and attention
    would leak across documents. Other shapes (mRoPE ``[3, B, S]``) are left alone:
    their positions do not step by one across image tokens.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape != doc_ids_BS.shape:
        return doc_ids_BS
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise ValueError(f"position_ids must be integers, got dtype {position_ids.dtype}")
    breaks = position_breaks(position_ids.to(device=doc_ids_BS.device, dtype=torch.long))
    real = doc_ids_BS != 0
    if not bool((breaks & real).any()):
        return doc_ids_BS
    new_run = breaks.clone()
    new_run[:, 1:] |= doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1]
    new_run[:, 0] = True
    run_index = torch.cumsum(new_run.long(), dim=1)
    return torch.where(real, run_index, 0)


def resolve_doc_ids(batch: Mapping[str, Any], seq_len: int, device, batch_size: int) -> torch.Tensor:
    """Resolve per-position document ids ``[B, S]`` (int64, 0 == padding).

    Order (the seed's, extended where it would silently merge documents):

    1. ``batch["_packed_seq_ids"]`` ``[B, S]``: the collator's 1-based document index.
    2. ``batch["cu_seq_lens_q"]`` ``[n + 1]``: flattened cumulative lengths (B == 1).
    3. ``batch["attention_mask"]`` ``[B, 1, S, S]`` block-causal: the documents it
       encodes (the seed keeps only the diagonal, which merges documents).
    4. ``batch["attention_mask"]`` ``[B, S]``: a 0/1 validity mask or indexed ids.
    5. Otherwise the whole row is one document.

    For 2-5, 2-D ``position_ids`` additionally split documents wherever they do not
    step by +1 (transformers' packed-sequence rule, see `position_breaks`).
    Any other ``attention_mask`` shape is a `ValueError`. The result is validated
    (see `validate_doc_ids`).

    Args:
        batch: the training batch.
        seq_len: ``S``, the unpadded sequence length.
        device: device of the returned tensor.
        batch_size: ``B``, used for the all-ones fallback.

    Returns:
        ``[B, S]`` int64 document ids, 0 == padding.
    """
    packed = batch.get("_packed_seq_ids")
    if packed is not None:
        return validate_doc_ids(packed, seq_len, batch_size, source="_packed_seq_ids").to(device)
    cu = batch.get("cu_seq_lens_q")
    mask = batch.get("attention_mask")
    if cu is not None:
        doc_ids, source = _cu_seqlens_to_doc_ids(cu, seq_len, batch_size), "cu_seq_lens_q"
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        doc_ids, source = _mask_4d_to_doc_ids(mask), "attention_mask"
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
        doc_ids, source = mask, "attention_mask"
    elif mask is not None:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"attention_mask must be [B, S] (validity or document index) or [B, 1, S, S] "
            f"(block-causal), got {shape}; or pass batch['_packed_seq_ids'] [B, S]"
        )
    else:
        doc_ids, source = torch.ones(batch_size, seq_len, dtype=torch.long), "default (one document)"
    if isinstance(doc_ids, torch.Tensor) and doc_ids.shape == (batch_size, seq_len) and not doc_ids.is_floating_point():
        doc_ids = split_at_position_breaks(doc_ids.to(torch.long), batch.get("position_ids"))
    return validate_doc_ids(doc_ids, seq_len, batch_size, source=source).to(device)


#: The seed's name for `resolve_doc_ids` (code outside this repo calls it).
_cp_blockdiag_doc_ids = resolve_doc_ids


def block_causal_mask(doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """``[B, S, S]`` bool: query i may see key j (same nonzero document, j <= i).

    Dense: for references and small inputs only.
    """
    same = doc_ids_BS.unsqueeze(-1) == doc_ids_BS.unsqueeze(-2)
    real = (doc_ids_BS != 0).unsqueeze(-1)
    S = doc_ids_BS.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=doc_ids_BS.device).tril()
    return same & real & causal
