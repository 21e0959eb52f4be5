"""`StepCosts`: what one training step costs per token, per attention pair and per byte moved.

The cost formulas live here, as `StepCosts` methods, and nowhere else: `seconds` (the model
below), `document_seconds` (runs kept whole), `span_seconds` (a piece of a cut document),
`row_seconds` (a row of whole documents), `link_seconds` / `exposed_seconds` (K/V traffic).
The grouped planner (grouped.py, groups.py), the whole-batch projection (whole_batch.py) and
`blockdiag-cp plan` (through cost.py's `SchemeCost.seconds`) cost their work with them.

Note [The step's cost model]
----------------------------
The grouped planner (grouped.py) balances *modeled seconds*, not tokens or pairs. One
forward + backward of the whole model on a rank costs

    token_seconds * tokens                       every layer's per-token work (projections,
                                                 MLP or active experts, norms, the LM head,
                                                 hybrid mixers' per-token scans)
  + pair_seconds * pairs                         every attention layer's query-key pairs
                                                 (a pair of a rectangle, the keys before a
                                                 piece of >= 768 queries, at `rectangle_factor`:
                                                 Note [Kernel-aware work] in balanced.py)
  + piece_seconds * pieces                       a fixed cost per document piece a rank holds
                                                 (its own kernel calls; 0 by default: GPU
                                                 kernels batch them, the CPU ones do not)
  + carry_seconds * tokens of continuing pieces  a hybrid's recurrences rerun a piece that
                                                 continues a document on another rank from
                                                 an identity state (Note [Passing a
                                                 recurrent state across ranks, in parallel])

(`StepCosts.seconds`) and its K/V exchange moves `kv_bytes_per_token` per row it sends (forward, all attention
layers; backward sends the same bytes again as gradients) at `intra_gbps` inside a node and
`inter_gbps` across nodes. A transfer hides behind the attention of the queries over the keys
the rank holds itself (it can run while the other keys arrive); what is left is added.

FLOPs follow the usual counts: a matmul of an ``[n, k]`` by a ``[k, m]`` weight is ``2 n k m``
forward and twice that backward (``6 x parameters`` per token); a query-key pair is
``2 (D_qk + D_v)`` per head forward and 2.5 times that backward (``7 H (D_qk + D_v)``). Seconds
are FLOPs at `tflops` (an effective rate, not the peak). The defaults are a 1B-class Llama
(hidden 2048, 16 layers, 32 heads of 64, 8 K/V heads, MLP 8192, vocabulary 128256, bf16) on
links of 400 GB/s in a node and 50 GB/s across nodes at 400 TFLOP/s: a token costs about as
much as 16k attention pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import numpy as np

# numpy is imported inside the functions that need it: `CPConfig` imports this module, and the
# package root and ``blockdiag-cp --help`` stay plain Python (tests/contract/test_cli.py).

#: A rectangle's pair costs this fraction of a causal square's (Note [Kernel-aware work] in balanced.py) ...
RECTANGLE_PAIR_COST = 0.88
#: ... in pieces of at least this many queries (where the CPU kernel runs 256-query blocks); shorter pieces run
#: 32- or 64-query blocks whose per-pair cost depends mostly on their own length, and count pairs as they are
RECTANGLE_MIN_QUERIES = 768


def transformer_flops(
    *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int,
    v_head_dim: Optional[int] = None, attention_layers: Optional[int] = None, active_experts: int = 1,
    mixer_state: int = 0, bytes_per_element: int = 2,
) -> tuple[float, float, float, float]:
    """``(FLOPs per token, per pair, per carried token, K/V bytes per token)`` of a decoder of `layers` layers
    (`attention_layers` of them attention, the rest token mixers whose recurrent state is `mixer_state` wide
    per head-dim row), forward + backward (Note [The step's cost model])."""
    attention_layers = layers if attention_layers is None else attention_layers
    v_dim = head_dim if v_head_dim is None else v_head_dim
    projections = hidden * (heads * (head_dim + v_dim) + kv_heads * (head_dim + v_dim))
    mlp = 3 * hidden * intermediate * max(1, active_experts)
    per_token = 6.0 * (layers * (projections + mlp) + hidden * vocab)
    per_pair = pair_flops(heads=heads, head_dim=head_dim, v_head_dim=v_dim, layers=attention_layers)
    carry = 6.0 * (layers - attention_layers) * heads * head_dim * mixer_state
    return per_token, per_pair, carry, float(kv_heads * (head_dim + v_dim) * bytes_per_element * attention_layers)


def pair_flops(*, heads: int, head_dim: int, v_head_dim: int, layers: int = 1) -> float:
    """FLOPs of one query-key pair over `heads` heads and `layers` attention layers, forward + backward:
    ``2 (D_qk + D_v)`` per head forward (``q k^T`` and ``p v``), 2.5 times that backward."""
    return 7.0 * heads * (head_dim + v_head_dim) * layers


def pairs_before(offset: "np.ndarray", window: Optional[int]) -> "np.ndarray":
    """``F(n)`` (float64, the shape of `offset`, an integer array): query-key pairs of a document's first `n`
    queries, each seeing its earlier keys and itself, at most `window` (None: all)."""
    import numpy as np

    n = offset.astype(np.float64)
    if window is None:
        return n * (n + 1) / 2
    w = float(window)
    return np.where(n <= w, n * (n + 1) / 2, w * (w + 1) / 2 + (n - w) * w)


#: a 1B-class Llama at 400 TFLOP/s: the defaults of `StepCosts` (Note [The step's cost model])
_LLAMA_1B = tuple(transformer_flops(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
                              vocab=128256))
_DEFAULT_TFLOPS = 400.0


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """Seconds per token, per attention pair and per byte of one step (Note [The step's cost model]).

    Attributes:
        token_seconds: forward + backward of every layer's per-token work, per token.
        pair_seconds: forward + backward of every attention layer, per causal query-key pair.
        carry_seconds: extra per token of a piece that continues a document on another rank
            (hybrid recurrences; 0 for attention-only models).
        piece_seconds: fixed cost of each document piece on a rank (per-piece kernel calls).
        kv_bytes_per_token: K and V bytes of one token over every attention layer (one way).
        intra_gbps, inter_gbps: link speed per rank inside a node and across nodes, GB/s.
        rectangle_factor, rectangle_min_queries: the kernel-aware cost of rectangle pairs.
    """

    token_seconds: float = _LLAMA_1B[0] / (_DEFAULT_TFLOPS * 1e12)
    pair_seconds: float = _LLAMA_1B[1] / (_DEFAULT_TFLOPS * 1e12)
    carry_seconds: float = 0.0
    piece_seconds: float = 0.0
    kv_bytes_per_token: float = _LLAMA_1B[3]
    intra_gbps: float = 400.0
    inter_gbps: float = 50.0
    rectangle_factor: float = RECTANGLE_PAIR_COST
    rectangle_min_queries: int = RECTANGLE_MIN_QUERIES

    def __post_init__(self) -> None:
        for name in ("token_seconds", "pair_seconds", "carry_seconds", "piece_seconds", "kv_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(f"StepCosts.{name} must be a finite number >= 0, got {value!r}")
        if self.token_seconds == 0 and self.pair_seconds == 0:
            raise ValueError("StepCosts: token_seconds and pair_seconds are both 0: nothing to balance")
        for name in ("intra_gbps", "inter_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"StepCosts.{name} must be a positive number (GB/s), got {value!r}")
        if not 0 < self.rectangle_factor <= 1:
            raise ValueError(f"StepCosts.rectangle_factor must be in (0, 1], got {self.rectangle_factor!r}")

    @property
    def pairs_per_token(self) -> float:
        """How many attention pairs cost as much as one token."""
        return self.token_seconds / self.pair_seconds if self.pair_seconds else math.inf

    def seconds(self, tokens: Any, pairs: Any, pieces: Any = 1, carried: Any = 0) -> Any:
        """Modeled seconds of `tokens` tokens, `pairs` attention pairs, `pieces` document pieces and `carried`
        tokens of pieces that continue a document (Note [The step's cost model]); numbers or numpy arrays."""
        return (self.token_seconds * tokens + self.pair_seconds * pairs + self.carry_seconds * carried
                + self.piece_seconds * pieces)

    def document_seconds(self, lengths: "np.ndarray", window: Optional[int] = None,
                         real: Optional["np.ndarray"] = None) -> "np.ndarray":
        """``[R]`` seconds of runs of `lengths` tokens kept whole on one rank: a document its tokens, its pairs
        and one piece; a run of padding (`real` False; None: every run a document) its tokens only."""
        import numpy as np

        if real is None:
            return self.seconds(lengths, pairs_before(lengths, window))
        return self.seconds(lengths, np.where(real, pairs_before(lengths, window), 0.0), pieces=real)

    def row_seconds(self, lengths: "np.ndarray", window: Optional[int] = None) -> float:
        """A row's documents (`lengths`), each kept whole, together (seconds)."""
        return float(self.seconds(lengths.sum(), pairs_before(lengths, window).sum(), pieces=lengths.size))

    def span_pairs(self, lo: "np.ndarray", hi: "np.ndarray", window: Optional[int] = None) -> "np.ndarray":
        """``[P]`` pairs charged for spans ``[lo, hi)`` of their documents' offsets, each a piece on its rank
        (integer arrays): its causal square, and the rectangle of the keys before it at `rectangle_factor` when
        it has at least `rectangle_min_queries` queries (Note [Kernel-aware work] in balanced.py); under a
        `window`, exactly its pairs."""
        import numpy as np

        if window is not None:
            return pairs_before(hi, window) - pairs_before(lo, window)
        n = (hi - lo).astype(np.float64)
        rate = np.where(n >= self.rectangle_min_queries, self.rectangle_factor, 1.0)
        return n * (n + 1) / 2 + rate * n * lo

    def span_seconds(self, lo: "np.ndarray", hi: "np.ndarray", window: Optional[int] = None) -> "np.ndarray":
        """``[P]`` seconds of spans ``[lo, hi)`` of their documents, each a piece on its rank: tokens,
        `span_pairs`, the piece, and the carry of a span that continues its document (``lo > 0``)."""
        import numpy as np

        n = (hi - lo).astype(np.float64)
        return self.seconds(n, self.span_pairs(lo, hi, window), carried=n * (lo > 0))

    def link_seconds(self, intra_bytes: Any, inter_bytes: Any) -> Any:
        """Seconds to move `intra_bytes` inside a node and `inter_bytes` across nodes (numbers or arrays)."""
        return intra_bytes / (self.intra_gbps * 1e9) + inter_bytes / (self.inter_gbps * 1e9)

    def exposed_seconds(self, intra_bytes: "np.ndarray", inter_bytes: "np.ndarray",
                        hidden: "np.ndarray") -> "np.ndarray":
        """Link seconds left over once a transfer hides behind `hidden` seconds of attention over the rank's own
        keys (Note [The step's cost model])."""
        import numpy as np

        return np.maximum(self.link_seconds(intra_bytes, inter_bytes) - hidden, 0.0)

    def with_links(self, intra_gbps: Optional[float] = None, inter_gbps: Optional[float] = None) -> "StepCosts":
        return replace(self, intra_gbps=intra_gbps or self.intra_gbps, inter_gbps=inter_gbps or self.inter_gbps)

    @staticmethod
    def for_transformer(*, tflops: float = _DEFAULT_TFLOPS, intra_gbps: float = 400.0, inter_gbps: float = 50.0,
                        **sizes: Any) -> "StepCosts":
        """Costs of a decoder from its sizes (the keywords of `transformer_flops`) at `tflops` (effective)."""
        per_token, per_pair, carry, kv_bytes = transformer_flops(**sizes)
        rate = tflops * 1e12
        return StepCosts(token_seconds=per_token / rate, pair_seconds=per_pair / rate, carry_seconds=carry / rate,
                         kv_bytes_per_token=kv_bytes, intra_gbps=intra_gbps, inter_gbps=inter_gbps)

    @staticmethod
    def for_attention(*, head_dim: int, v_head_dim: Optional[int] = None, tflops: float = _DEFAULT_TFLOPS,
                      intra_gbps: float = 400.0, inter_gbps: float = 50.0) -> "StepCosts":
        """Costs of one attention layer's pairs, per head (``head_dim`` for queries and keys, ``v_head_dim`` for
        values; None: `head_dim`), nothing per token: what `blockdiag-cp plan` predicts a layer with."""
        widths = dict(head_dim=head_dim, v_head_dim=head_dim if v_head_dim is None else v_head_dim)
        return StepCosts(token_seconds=0.0, pair_seconds=pair_flops(heads=1, **widths) / (tflops * 1e12),
                         intra_gbps=intra_gbps, inter_gbps=inter_gbps)

    @staticmethod
    def from_config(config: Any, **overrides: Any) -> "StepCosts":
        """Costs of a transformers model config (its text config for a VLM): sizes read from the usual fields
        (MLA's ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``, MoE's ``num_experts_per_tok`` and
        ``moe_intermediate_size``, a hybrid's ``layer_types``); `overrides` go to `for_transformer`."""
        text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
        sizes = _config_sizes(text)
        sizes.update(overrides)
        return StepCosts.for_transformer(**sizes)


def _config_sizes(config: Any) -> dict[str, Any]:
    """The keyword arguments of `StepCosts.for_transformer` a transformers config gives."""
    get = lambda *names, default=None: next((getattr(config, n) for n in names if getattr(config, n, None)), default)  # noqa: E731
    hidden, layers = get("hidden_size", "d_model", "n_embd"), get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    if not (hidden and layers and heads):
        raise ValueError(f"{type(config).__name__} lacks hidden_size, num_hidden_layers or num_attention_heads; "
                         "give StepCosts explicit numbers (StepCosts(token_seconds=..., pair_seconds=...))")
    qk = (get("qk_nope_head_dim", default=0) + get("qk_rope_head_dim", default=0)) or get("head_dim") or hidden // heads
    kinds = get("layer_types", "layers_block_type", default=None)
    attention_layers = None if not isinstance(kinds, (list, tuple)) else sum(
        "attention" in str(k) and "linear" not in str(k) for k in kinds)
    experts = get("num_experts_per_tok", "num_experts_per_token", default=1)
    moe = get("moe_intermediate_size", default=None)
    intermediate = moe if (moe and experts > 1) else get("intermediate_size", "ffn_dim", default=4 * hidden)
    return dict(hidden=hidden, layers=layers, heads=heads, kv_heads=get("num_key_value_heads", default=heads),
                head_dim=qk, v_head_dim=get("v_head_dim"), intermediate=intermediate,
                vocab=get("vocab_size", default=32000), attention_layers=attention_layers, active_experts=experts,
                mixer_state=get("linear_key_head_dim", "mamba_d_state", "ssm_state_size", "state_size", default=0))

