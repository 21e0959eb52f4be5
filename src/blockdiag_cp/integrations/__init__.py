"""Ways in from training stacks built beside transformers' Trainer (issue #48).

One module per stack, each imported only by that stack's users (it imports the stack):

    axolotl        an axolotl plugin (its YAML's ``plugins:`` list)
    llamafactory   LLaMA-Factory's SFT workflow with ``neat_packing``
    torchtitan     torchtitan's trainer with document-packed rows
    automodel      NeMo AutoModel's recipes: this library's step as their ContextParallelSharder

Each runs the stack's own training loop with per-document attention sharded by this library's plan, and
refuses by name the stack's options that would be silently different under CP.
"""
