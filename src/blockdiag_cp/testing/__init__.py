"""The verification harness: a dense float64 oracle, multi-process runs on real collectives,
and a counter of host synchronisations.

Used by the test suite, the benchmarks and ``blockdiag-cp verify``; a training script
never imports it. A `ParityCase` describes one
packed row and one configuration; `run_parity_case` (inside an initialized process
group) shards it with `make_cp_blockdiag_batch_and_ctx`, runs forward and backward
through `cp_blockdiag_sdpa`, and compares every rank's output rows and the summed
input gradients with `oracle_attention` on the full row.

    oracle.py      oracle_attention, doc_ids_from_lengths, gated_delta_rule_oracle, ssd_oracle
    parity.py      ParityCase, run_parity_case, parity_worker, reference_error
    ranks.py       spawn, RankPool: real gloo ranks in subprocesses; hang_timeout (BLOCKDIAG_CP_TIMEOUT_SCALE)
    zoo.py         the model zoo sweep: every transformers causal LM exact or refused (zoo_configs.py: tiny configs)
    host_syncs.py  count_host_syncs
"""

from .host_syncs import HOST_SYNC_OPS, count_host_syncs
from .oracle import doc_ids_from_lengths, gated_delta_rule_oracle, oracle_attention, ssd_oracle
from .parity import ParityCase, ParityResult, oracle_case, parity_worker, reference_error, run_parity_case
from .ranks import RankPool, hang_timeout, spawn

__all__ = (
    "HOST_SYNC_OPS",
    "ParityCase",
    "ParityResult",
    "RankPool",
    "count_host_syncs",
    "hang_timeout",
    "doc_ids_from_lengths",
    "gated_delta_rule_oracle",
    "ssd_oracle",
    "oracle_attention",
    "oracle_case",
    "parity_worker",
    "reference_error",
    "run_parity_case",
    "spawn",
)
