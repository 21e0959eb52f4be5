"""The Trainer mixin's strategies for scoring trainers: TRL's ``DPOTrainer`` and, generating its rows, ``GRPOTrainer``.

Their batches are not sharded when they enter: each fused-head scoring forward of padded rows
runs as one packed row under CP (Note [Scoring forwards under CP] in hf/scoring.py), and the
trainer's own code, its loss and metrics included, runs per replica (Note [Trainer code runs per
replica, the model per CP rank] in hf/replica.py). A generating trainer also generates, rewards
and scores its old and reference log-probs per replica, with the completions of CP rank 0.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch

from .replica import ReplicaAccelerator
from .scoring import ScoringSession
from .whole_batch import refuse_scoring_trainers

logger = logging.getLogger(__name__)


class ScoringStrategy:
    """TRL's ``DPOTrainer`` under the mixin: scoring forwards under CP, the trainer's code per replica.

    Args:
        trainer: the mixed-in trainer (`BlockDiagCPMixin`), built: its meshes, ``cp_config`` and dp group set.

    `session` is the `ScoringSession` of every step; it is the step context the Trainer's
    ``_prepare_context_parallel_inputs`` returns, and is entered around each loss and prediction step.
    """

    #: the kind's name in the options tables (hf/options.py)
    kind: ClassVar[str] = "scoring"

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.session = ScoringSession(trainer.cp_mesh, trainer.cp_config)

    @staticmethod
    def prepare_args(training_args: Any, cp_size: int) -> None:
        """Nothing to change in the arguments before the Trainer is built."""

    def scored_models(self) -> list[torch.nn.Module]:
        """The policy and the reference model (unwrapped), if there is one."""
        t = self.trainer
        models = [t.model]
        ref = getattr(t, "ref_model", None)
        if isinstance(ref, torch.nn.Module):
            models.append(t.accelerator.unwrap_model(ref))
        return models

    def adopt(self, models: list[torch.nn.Module], where: str) -> None:
        """Shard the scoring forwards of `models`; refuse what is not exact on scored rows under CP."""
        t = self.trainer
        if t.linear_ce:
            raise ValueError(f"linear_ce=True is for the Trainer's own loss: {type(t).__name__} scores rows through "
                             "TRL's fused LM head (no logits held) and needs entropies, which the linear cross-entropy "
                             "cannot give; leave linear_ce off")
        for model in models:
            self.session.install(model)
        if t.cp_size > 1 and getattr(t, "aux_loss_enabled", False):
            raise ValueError("the MoE load-balancing loss (output_router_logits) is not additive over CP shards of a "
                             "scored row; turn it off or train without CP")
        if t.whole_batch:
            refuse_scoring_trainers()

    # -- the Trainer's hooks -------------------------------------------------------------

    def prefetch(self, samples: list[dict[str, Any]]) -> None:
        """Nothing planned ahead: the scoring forwards are sharded as they come (Note [Scoring forwards under CP])."""

    def step_inputs(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """The inputs pass unchanged: the forwards are sharded as they come (Note [Scoring forwards under CP])."""
        return self.session, inputs

    def compute_loss(self, parent: Callable, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool,
                     num_items_in_batch: Any) -> Any:
        """`parent` (TRL's loss and metrics), per replica (Note [Trainer code runs per replica, the model per CP
        rank])."""
        with self.session(), self.per_replica():
            return parent(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def prediction_step(self, parent: Callable, model: torch.nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: Optional[list[str]]) -> Any:
        """`parent` (TRL's prediction step), per replica, its forwards under CP."""
        with self.session(), self.per_replica():
            return parent(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def train(self, parent: Callable, *args: Any, **kwargs: Any) -> Any:
        """`parent` (the trainer's training), as it is."""
        return parent(*args, **kwargs)

    def prepare_inputs(self, parent: Callable, inputs: Any) -> Any:
        """`parent` (the trainer's input preparation), as it is."""
        return parent(inputs)

    @contextlib.contextmanager
    def per_replica(self) -> Iterator[None]:
        """The trainer's ``accelerator`` as this rank's dp replica sees it, for the block (Note in hf/replica.py)."""
        t = self.trainer
        real = t.accelerator
        if t.cp_size == 1 or isinstance(real, ReplicaAccelerator):
            yield
            return
        t.accelerator = ReplicaAccelerator(real, t.dp_group, t.dp_size, t.dp_rank)
        try:
            yield
        finally:
            t.accelerator = real


class GeneratingStrategy(ScoringStrategy):
    """TRL's ``GRPOTrainer`` under the mixin: a scoring trainer that also generates its rows per replica.

    Its generation batch is sized per replica (`generation_batch_per_replica`); each replica's
    process is seeded as without CP; generation, rewards and the old and reference log-probs
    (``_prepare_inputs``) run per replica, with CP rank 0's completions on every CP rank (the
    mixin's ``_generate``, Note in hf/replica.py).
    """

    kind: ClassVar[str] = "generating"

    @staticmethod
    def prepare_args(training_args: Any, cp_size: int) -> None:
        generation_batch_per_replica(training_args, cp_size)

    def adopt(self, models: list[torch.nn.Module], where: str) -> None:
        super().adopt(models, where)
        t = self.trainer
        if t.cp_size > 1:
            from accelerate.utils import set_seed

            set_seed(t.args.seed + t.dp_rank)  # as the replica's process is seeded without CP (seed + its index)

    def prepare_inputs(self, parent: Callable, inputs: Any) -> Any:
        """`parent` (generation, rewards, the old and reference log-probs) per replica, its scoring forwards
        under CP."""
        with self.per_replica():
            return parent(inputs)


def generation_batch_per_replica(training_args: Any, cp: int) -> None:
    """TRL sized the generation batch for every process (``per_device x world x steps_per_generation``);
    under CP the ``cp`` ranks of a replica share one batch, so it is ``per_device x dp x steps``, as
    without CP (``steps_per_generation`` is kept: set that one, not ``generation_batch_size``)."""
    steps = getattr(training_args, "steps_per_generation", None)
    if cp == 1 or training_args is None or not steps:
        return
    dp = training_args.world_size // cp
    size = training_args.per_device_train_batch_size * dp * steps
    generations = getattr(training_args, "num_generations", 1) or 1
    if size % generations:
        raise ValueError(f"the generation batch of a replica step, per_device_train_batch_size x dp x "
                         f"steps_per_generation = {size}, must be divisible by num_generations={generations}")
    if training_args.generation_batch_size != size:
        logger.warning("blockdiag-cp: generation_batch_size %s -> %d (per_device_train_batch_size x dp=%d x "
                       "steps_per_generation=%d: the CP ranks of a replica share its batch)",
                       training_args.generation_batch_size, size, dp, steps)
    training_args.generation_batch_size = size
