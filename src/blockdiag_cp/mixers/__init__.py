"""Token mixers other than softmax attention: which ones a model has, and the refusal.

blockdiag-cp keeps documents apart inside the attention interface. A layer that mixes
tokens without calling it (a Gated DeltaNet or Mamba recurrence, a short causal
convolution, an RWKV-style scan, a sparse-attention indexer) would carry its state and
its convolution window across document boundaries on a packed row, and under CP would
run on the local shard alone, starting from an empty state on every rank. Those layers
are refused here until they are routed (`refuse_unrouted_mixers`).
"""

from .detect import UnroutedMixer, find_unrouted_mixers, refuse_unrouted_mixers, unrouted_config_mixers

__all__ = ("UnroutedMixer", "find_unrouted_mixers", "refuse_unrouted_mixers", "unrouted_config_mixers")
