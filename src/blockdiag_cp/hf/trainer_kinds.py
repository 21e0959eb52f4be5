"""What the Trainer mixin does differently per trainer kind: the strategy interface, and the one choice of it.

`BlockDiagCPMixin` (trainer.py) holds what every trainer shares: construction, the
``(dp, cp)`` mesh, the data loaders sharded over dp only, evaluation's gather over the
replicas, FLOPs and token counts. Everything that depends on what the trainer trains is a
`TrainerStrategy`, chosen once per trainer class by `strategy_for` (the only code that looks
at the trainer's kind):

    kind          strategy                                 the trainers
    rows          RowsStrategy (hf/trainer_rows.py)        transformers' Trainer (and Seq2SeqTrainer without
                                                           generation), TRL's base trainer
                  SFTRowsStrategy                          TRL's SFTTrainer (its fused head's loss and metrics)
    scoring       ScoringStrategy (hf/trainer_scoring.py)  TRL's DPOTrainer
    generating    GeneratingStrategy                       TRL's GRPOTrainer

Trainers of rows flatten and shard each batch when it enters; scoring trainers shard each
scoring forward as it comes and run their own code per replica (Note [Scoring forwards under
CP] in hf/scoring.py, Note [Trainer code runs per replica, the model per CP rank] in hf/replica.py).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol

import torch

from .trainer_rows import RowsStrategy, SFTRowsStrategy
from .trainer_scoring import GeneratingStrategy, ScoringStrategy


class TrainerStrategy(Protocol):
    """One trainer kind under the mixin; made once per trainer, after the Trainer's own ``__init__``.

    The mixin's hooks call it with the Trainer's (or TRL's) own method as `parent`, so a strategy
    runs that method around what the kind needs; it reads and sets the trainer's attributes.
    """

    #: the kind's name in the options tables (hf/options.py: ``rows``, ``scoring`` or ``generating``)
    kind: ClassVar[str]

    def __init__(self, trainer: Any) -> None: ...

    @staticmethod
    def prepare_args(training_args: Any, cp_size: int) -> None:
        """Before the Trainer is built: adjust or refuse its arguments for this kind."""

    def scored_models(self) -> list[torch.nn.Module]:
        """The models the mixin prepares (per-document attention, supported mixers, refusals)."""

    def adopt(self, models: list[torch.nn.Module], where: str) -> None:
        """After the models are prepared: install this kind's hooks and loss paths, refuse what it cannot train."""

    def prefetch(self, samples: list[dict[str, Any]]) -> None:
        """The Trainer's ``get_batch_samples``: the micro-batches of an optimizer step, as soon as they are fetched
        (a kind that plans ahead submits them here; the others do nothing)."""

    def step_inputs(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        """The Trainer's ``_prepare_context_parallel_inputs``: ``(train_ctx, inputs)``."""

    def compute_loss(self, parent: Callable, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool,
                     num_items_in_batch: Any) -> Any:
        """The loss of `parent` (``compute_loss``), as the run without CP computes it."""

    def prediction_step(self, parent: Callable, model: torch.nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: Optional[list[str]]) -> Any:
        """`parent`'s ``(loss, logits, labels)`` as the run without CP's replica holds them."""

    def train(self, parent: Callable, *args: Any, **kwargs: Any) -> Any:
        """`parent` (``train``) with what this kind changes for the whole run."""

    def prepare_inputs(self, parent: Callable, inputs: Any) -> Any:
        """`parent` (``_prepare_inputs``) where this kind runs it."""


#: (module, class) of each transformers / TRL trainer the mixin supports -> its strategy
STRATEGIES: Mapping[tuple[str, str], type[TrainerStrategy]] = MappingProxyType({
    ("transformers.trainer", "Trainer"): RowsStrategy,
    ("transformers.trainer_seq2seq", "Seq2SeqTrainer"): RowsStrategy,  # its generation (predict_with_generate) refused
    ("trl.trainer.base_trainer", "_BaseTrainer"): RowsStrategy,
    ("trl.trainer.sft_trainer", "SFTTrainer"): SFTRowsStrategy,
    ("trl.trainer.dpo_trainer", "DPOTrainer"): ScoringStrategy,
    ("trl.trainer.grpo_trainer", "GRPOTrainer"): GeneratingStrategy,
})


def strategy_for(cls: type) -> type[TrainerStrategy]:
    """The strategy of trainer class `cls`: that of its most specific transformers / TRL base (`STRATEGIES`);
    a `ValueError` if one of them is not supported."""
    found = []
    for base in cls.__mro__:
        if base.__module__.split(".")[0] not in ("transformers", "trl"):
            continue
        strategy = STRATEGIES.get((base.__module__, base.__qualname__))
        if strategy is None:
            raise ValueError(
                f"BlockDiagCPMixin does not support {base.__qualname__} ({base.__module__}): it is neither a trainer of "
                "language-model rows (token ids with per-token labels) nor one of the scoring trainers whose forwards "
                "the mixin shards, so sharding its batches would be wrong or crash inside the trainer. Supported: "
                "transformers.Trainer, transformers.Seq2SeqTrainer (without generation), trl.SFTTrainer, trl.DPOTrainer "
                "and trl.GRPOTrainer (and your own subclasses of them); train this one without the mixin."
            )
        found.append(strategy)
    return found[0] if found else RowsStrategy
