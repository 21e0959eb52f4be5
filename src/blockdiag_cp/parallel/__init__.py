"""How ranks talk: the communication layer, head parallelism and gradient reduction.

    collectives.py  the differentiable collectives every exchange and entry uses
    heads.py        head-parallel (Ulysses) groups, the per-rank head split and its byte formulas
    grads.py        reduce_gradients: over dp x cp, plain and DTensor (tensor-parallel) parameters alike
"""

from .grads import reduce_gradients

__all__ = ("reduce_gradients",)
