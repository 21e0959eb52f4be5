"""How ranks talk: the communication layer and head parallelism.

    collectives.py  the differentiable collectives every exchange and entry uses
    heads.py        head-parallel (Ulysses) groups, the per-rank head split and its byte formulas
"""
