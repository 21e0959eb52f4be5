"""How ranks talk: the communication layer, head parallelism and gradient reduction.

    collectives.py  the differentiable collectives every exchange and entry uses
    heads.py        head-parallel (Ulysses) groups, the per-rank head split and its byte formulas
    agree.py        every rank of a group holds the same row / buckets (one small collective, Note [Ranks agree])
    grads.py        reduce_gradients: over dp x cp, plain and DTensor (tensor-parallel) parameters alike
    cpu_heap.py     keep_cpu_heap: large CPU tensors from glibc's heap, freed ones kept for reuse
"""

from .cpu_heap import keep_cpu_heap
from .grads import reduce_gradients

__all__ = ("keep_cpu_heap", "reduce_gradients")
