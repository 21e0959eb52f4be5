"""A local batch of ``B`` rows as the one packed row block-diagonal CP shards.

`flatten_rows` turns what a collator hands over (``[B, S]`` padded rows, several
documents per row, or already one flattened row) into one row ``[1, B * S]`` in which
no document crosses a row boundary: each row's documents get their own ids, padding
stays padding (id 0), and the next-token targets are those the model's own loss
would use on the unflattened batch (each row shifted on its own, its last position
ignored), so the loss equals the loss of the run without CP token for token.
"""

from __future__ import annotations

from typing import Any

import torch

from .doc_ids import resolve_doc_ids

#: keys that describe the rows as they come (used for the document ids, then dropped)
ROW_METADATA = ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

#: the target of a token that predicts nothing (torch's cross-entropy default)
IGNORE_INDEX = -100


def shifted_labels(labels_BS: torch.Tensor) -> torch.Tensor:
    """``[B, S]``: each row's ``labels`` shifted left by one, the last position ignored.

    Exactly what transformers' causal-LM loss computes from ``labels`` (so collators
    that mark each document's first token with -100 give per-document targets).
    """
    return torch.nn.functional.pad(labels_BS[..., 1:], (0, 1), value=IGNORE_INDEX)


def flatten_rows(batch: dict[str, Any]) -> dict[str, Any]:
    """One packed row from a batch of ``B`` rows (a new dict; ``B == 1`` rows pass through).

    Adds ``shift_labels`` (from ``labels``, unless the collator gave them) and, for
    ``B > 1``, ``_packed_seq_ids`` with row-unique document ids; flattens every
    ``[B, S]`` tensor (``[3, B, S]`` mRoPE positions, ``[B, S, E]`` embeddings) and
    drops the row metadata (``attention_mask``, ``cu_seq_lens_*``, ...) once the
    document ids are known. Non-tensor entries pass through unchanged.
    """
    primary = batch.get("input_ids", batch.get("inputs_embeds"))
    if not isinstance(primary, torch.Tensor) or primary.dim() < 2:
        raise ValueError("flatten_rows needs 'input_ids' [B, S] or 'inputs_embeds' [B, S, E]")
    out = dict(batch)
    B, S = primary.shape[:2]
    if out.get("shift_labels") is None and isinstance(out.get("labels"), torch.Tensor):
        out["shift_labels"] = shifted_labels(out["labels"])
    if B == 1:
        return out
    if out.get("cu_seq_lens_q") is not None:
        raise ValueError("cu_seq_lens_q describes one flattened row, but the batch has B > 1 rows")
    doc_ids_BS = resolve_doc_ids(out, S, primary.device, B)
    offsets = torch.cumsum(doc_ids_BS.amax(dim=1), dim=0) - doc_ids_BS.amax(dim=1)
    out["_packed_seq_ids"] = torch.where(doc_ids_BS != 0, doc_ids_BS + offsets.unsqueeze(1), 0).reshape(1, -1)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(S, device=primary.device).expand(B, S)
    for key in ROW_METADATA:
        out.pop(key, None)
    for key, value in list(out.items()):
        if isinstance(value, torch.Tensor) and key != "_packed_seq_ids":
            out[key] = _flatten(key, value, B, S)
    return out


def _flatten(key: str, t: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """``[B, S, ...]`` -> ``[1, B * S, ...]``; ``[3, B, S]`` positions -> ``[3, 1, B * S]``; others unchanged."""
    if key == "position_ids" and t.dim() == 3 and t.shape[1:] == (B, S):
        return t.reshape(t.shape[0], 1, B * S)
    if t.dim() >= 2 and t.shape[:2] == (B, S):
        return t.reshape(1, B * S, *t.shape[2:])
    return t
