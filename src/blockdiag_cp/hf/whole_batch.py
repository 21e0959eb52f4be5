"""The Trainer mixin's whole-batch mode: what it verifies, and what it refuses by name.

Note [The whole-batch mode of the mixin]
----------------------------------------
``BlockDiagCPMixin(..., whole_batch=True)`` trains each global micro-batch (every replica's
batch of the step) on all ``dp x cp`` ranks: each rank passes its replica's rows (flattened
to one packed row, as without it) to `make_cp_world_batch_and_ctx`, which plans every
replica's documents over the world (``CPConfig(layout="grouped")`` by default, Note [Grouped
planner]). The Trainer's loss is then exact as with fixed rows (Note [The loss under CP equals
the loss without CP] in trainer.py): each rank's loss is ``world * (its token sum) / N`` with
``N`` the micro-batch's global target count, each target of every replica on exactly one rank,
so the world average is the global token mean; gradients, ``grad_norm`` and the logged loss
follow. Evaluation and prediction run as with fixed rows (each replica's rows on its CP group),
so their per-replica gathers are unchanged. The micro-batches of an optimizer step, fetched together
by the Trainer, are agreed and planned on a background thread in order (Note [Planning off the
critical path]): each one's plan is built while the ones before it train.

A rank's shard now mixes tokens of several replicas, so every loss path whose value is a
per-replica quantity cannot be computed on it: a per-micro-batch mean (no global token count:
``average_tokens_across_devices=False``, models with ``accepts_loss_kwargs=False``), a
``compute_loss_func`` (it is given a replica's unsharded outputs), an MoE router's
load-balancing loss (per-replica statistics) and NEFTune (each replica draws its own noise).
They are refused when the trainer is built, by name. Label smoothing and TRL's SFT losses are
sums over tokens divided by the global count: exact. Only trainers of rows (the Trainer, TRL's
``SFTTrainer``) have the mode; DPO and GRPO score rows per replica.
"""

from __future__ import annotations

from typing import Any

#: (what is set, why it is per replica) for each loss path the whole-batch mode refuses
_PER_REPLICA = (
    ("average_tokens_across_devices=False", "each rank's loss is its own micro-batch's mean"),
    ("compute_loss_func", "it computes a replica's loss from that replica's unsharded outputs"),
    ("a model with accepts_loss_kwargs=False", "its loss is a per-micro-batch mean, with no global token count"),
    ("output_router_logits (an MoE router's load-balancing loss)", "its statistics are per replica"),
    ("neftune_noise_alpha", "each replica draws its own noise for its own rows"),
)


def refuse_scoring_trainers() -> None:
    """`ValueError`: the mode plans trainers of rows only (Note [The whole-batch mode of the mixin])."""
    raise ValueError("whole_batch=True plans trainers of rows (transformers' Trainer, TRL's SFTTrainer); DPO and "
                     "GRPO score their rows per replica: train them with whole_batch=False")


def refuse_per_replica_losses(args: Any, compute_loss_func: Any, accepts_loss_kwargs: bool, router_loss: bool) -> None:
    """`ValueError` naming each option whose loss is per replica (Note [The whole-batch mode of the mixin])."""
    set_ = (not getattr(args, "average_tokens_across_devices", True), compute_loss_func is not None,
            not accepts_loss_kwargs, router_loss, bool(getattr(args, "neftune_noise_alpha", None)))
    found = [f"{name} ({why})" for (name, why), on in zip(_PER_REPLICA, set_) if on]
    if found:
        raise ValueError("whole_batch=True spreads every replica's documents over all dp x cp ranks, so a rank's "
                         f"shard mixes replicas; these compute a per-replica loss: {'; '.join(found)}. Turn them "
                         "off, or train with whole_batch=False (each replica's rows on its own CP group).")
