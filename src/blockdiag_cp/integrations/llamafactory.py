"""LLaMA-Factory's SFT workflow with ``neat_packing``, its trainer swapped for one under `BlockDiagCPMixin`.

    torchrun --nproc-per-node 2 -m blockdiag_cp.integrations.llamafactory cfg.yaml [key=value ...]

``cfg.yaml`` is a LLaMA-Factory training config plus one key of this entry, ``blockdiag_cp_size`` (ranks per
CP group; it must divide the world size; 1 = data parallel with per-document attention). The command line is
read by LLaMA-Factory's own ``read_args``, as ``llamafactory-cli train`` reads it: ``cfg.yaml key=value ...``
(OmegaConf's overrides) or ``--key value ...`` (``--blockdiag_cp_size N`` then). The key is taken out before
LLaMA-Factory parses the rest, so its own parser never sees it.

Note [LLaMA-Factory's SFT under the mixin]
------------------------------------------
The entry runs LLaMA-Factory's own `run_exp` (its argument parsing, tokenizer, template,
dataset packing, model loading with its patches, callbacks, saving and evaluation), with one
name changed for the call: ``llamafactory.train.sft.workflow.CustomSeq2SeqTrainer``, which
`run_sft` builds its trainer from, is `LlamaFactoryCPTrainer` (``BlockDiagCPMixin`` in front of
LLaMA-Factory's own class) for the duration of the run. Everything the mixin guarantees then
holds for LLaMA-Factory's trainer: losses, grad norms, parameters and evaluation equal the run
without CP (docs/llamafactory.md has the measured numbers).

The documents are the ones ``neat_packing`` packed: LLaMA-Factory marks the tokens of the k-th
conversation of a packed row with ``attention_mask == k`` (1-based; padding 0) and restarts
``position_ids`` at 0 for each. Its collator turns that into a dense ``[B, 1, S, S]`` mask for
its own attention; under the mixin the collator keeps the ``[B, S]`` indices instead (no
``S x S`` mask per row), and `neat_packing_documents` hands them to the mixin as
``_packed_seq_ids``, after checking that every document is one run of positions 0, 1, 2, ...
The prompt tokens keep LLaMA-Factory's ``-100`` labels; the mixin shifts the labels of each
unsharded row as the model's loss does. The collator pads a packed row past ``cutoff_len`` to a
multiple of 8 everywhere but in ``position_ids``; `padded_positions` pads those too (0, as the
packing pads them), so any ``cutoff_len`` runs. LoRA and freeze models (PEFT's or LLaMA-Factory's
own) and LLaMA-Factory's DeepSpeed configs go through the mixin as they come.

Options whose result under CP would differ from LLaMA-Factory without it, or that no test here
compares, are refused by name before the model loads (`refusals`), as are the Trainer's
options the mixin has not verified (hf/options.py).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import sys
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import transformers

from ..step.slot import current_step
from ..trainer import BlockDiagCPMixin

logger = logging.getLogger(__name__)

#: the YAML key this entry adds to LLaMA-Factory's config
CP_SIZE_KEY = "blockdiag_cp_size"


def neat_packing_documents(attention_mask_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, S]`` (int64, 0 = padding) of rows packed by LLaMA-Factory's ``neat_packing``.

    Args:
        attention_mask_BS: ``[B, S]`` the packed sequence's 1-based index per token, 0 on padding.
        position_ids_BS: ``[B, S]`` positions restarting at 0 in each packed sequence.

    Every document must be one contiguous run whose positions are 0, 1, 2, ...; anything else
    (a 0/1 mask from ``packing`` without ``neat_packing``, a dense 4-D mask, an index that comes
    back later in the row) is a `ValueError`: its documents cannot be read exactly.
    """
    if not isinstance(attention_mask_BS, torch.Tensor) or attention_mask_BS.dim() != 2:
        shape = tuple(attention_mask_BS.shape) if isinstance(attention_mask_BS, torch.Tensor) else None
        raise ValueError(f"neat_packing rows carry a [B, S] attention_mask of document indices, got shape {shape}")
    if not isinstance(position_ids_BS, torch.Tensor) or position_ids_BS.shape != attention_mask_BS.shape:
        raise ValueError("neat_packing rows carry position_ids [B, S] restarting at 0 per document; got "
                         f"{None if position_ids_BS is None else tuple(position_ids_BS.shape)}")
    ids, pos = attention_mask_BS.to(torch.long), position_ids_BS.to(torch.long)
    real = ids != 0
    starts = real.clone()
    starts[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    continues = torch.zeros_like(real)
    continues[:, 1:] = pos[:, 1:] == pos[:, :-1] + 1
    if bool((starts & (pos != 0)).any()) or bool((real & ~starts & ~continues).any()):
        raise ValueError("the attention_mask indices and position_ids of a packed row disagree (a document that does "
                         "not start at position 0, or positions restarting inside one index): set neat_packing: true "
                         "in the LLaMA-Factory config")
    if bool((starts.sum(dim=1) != ids.amax(dim=1)).any()):
        raise ValueError("a neat_packing document index comes back later in its row: its tokens are not one run")
    return ids


@dataclasses.dataclass
class NeatPackedDocuments:
    """LLaMA-Factory's SFT collator, keeping the ``[B, S]`` document indices and adding ``_packed_seq_ids``.

    Attributes:
        collator: LLaMA-Factory's ``SFTDataCollatorWith4DAttentionMask`` (a copy with ``block_diag_attn`` off
            is called: the mixin attends per document itself, no dense mask is built).
    """

    collator: Any

    def __post_init__(self) -> None:
        self.collator = copy.copy(self.collator)
        self.collator.block_diag_attn = False

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(features)
        batch["position_ids"] = padded_positions(batch.get("position_ids"), batch.get("attention_mask"))
        batch["_packed_seq_ids"] = neat_packing_documents(batch.get("attention_mask"), batch.get("position_ids"))
        return batch


def padded_positions(position_ids_BP: Any, attention_mask_BS: Any) -> Any:
    """``position_ids`` ``[B, P]`` padded with 0 to the collator's length ``S >= P`` where the columns added are padding.

    LLaMA-Factory's SFT collator pads ``input_ids``, ``attention_mask`` and ``labels`` of a packed row (``cutoff_len``
    tokens, padding included) to a multiple of 8 but leaves ``position_ids`` at ``cutoff_len``: with a ``cutoff_len``
    that is not a multiple of 8, LLaMA-Factory's own run stops on the mismatch in the model. Here the added columns
    get position 0, as LLaMA-Factory's packing gives its own padding; they belong to no document (index 0, labels
    -100), so no loss or gradient reads them. Anything else passes unchanged (`neat_packing_documents` checks it).
    """
    if not (isinstance(position_ids_BP, torch.Tensor) and isinstance(attention_mask_BS, torch.Tensor)
            and position_ids_BP.dim() == attention_mask_BS.dim() == 2
            and position_ids_BP.shape[0] == attention_mask_BS.shape[0]):
        return position_ids_BP
    added = attention_mask_BS.shape[1] - position_ids_BP.shape[1]
    if added <= 0 or bool(attention_mask_BS[:, -added:].any()):
        return position_ids_BP
    return torch.nn.functional.pad(position_ids_BP, (0, added), value=0)


def _lf_trainer_class() -> type:
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer

    return CustomSeq2SeqTrainer


class LlamaFactoryCPTrainer(BlockDiagCPMixin, _lf_trainer_class()):
    """LLaMA-Factory's ``CustomSeq2SeqTrainer`` under `BlockDiagCPMixin`, its collator's documents as ids.

    Args:
        cp_size, cp_config: the mixin's (`BlockDiagCPMixin`).
        data_collator: LLaMA-Factory's SFT collator; wrapped in `NeatPackedDocuments`.
        *args, **kwargs: LLaMA-Factory's trainer's, unchanged.
    """

    #: whether transformers' token count divides itself by ``get_cp_size()`` (as the mixin's Note [The loss under
    #: CP equals the loss without CP] reads it): later transformers do; 5.6, the newest LLaMA-Factory 0.9.5 allows,
    #: divides only by an accelerate ParallelismConfig's size
    count_divides_by_cp: ClassVar[bool] = "get_cp_size" in inspect.getsource(transformers.Trainer._get_num_items_in_batch)

    def __init__(self, *args: Any, data_collator: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, data_collator=NeatPackedDocuments(data_collator), **kwargs)
        window = sliding_window(getattr(self.model, "config", None))
        if window is not None:
            logger.warning(
                "blockdiag-cp: the model attends within a sliding window of %d tokens, and so does each packed document "
                "under CP (as the model, and LLaMA-Factory's FlashAttention-2 path, define it); LLaMA-Factory's own "
                "sdpa/eager run with neat_packing replaces the window by its dense block-diagonal mask, so a document "
                "longer than %d tokens trains differently there (docs/llamafactory.md)", window, window)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """The Trainer's token count of a step, divided by ``cp_size`` where transformers does not (the ``cp`` ranks
        of a replica each count its whole batch)."""
        count = super()._get_num_items_in_batch(batch_samples, device)
        if self.count_divides_by_cp or not torch.is_tensor(count):
            return count
        return count / self.cp_size

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch: Any = None):
        """The mixin's loss; an evaluation loss outside a CP step runs inside one. transformers 5.6 (the newest
        LLaMA-Factory 0.9.5 allows) computes ``prediction_step``'s loss without the Trainer's CP hook, which later
        transformers call there (its token count taken first, from the unsharded rows, as they do)."""
        if model.training or current_step() is not None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        train_ctx, inputs = self._prepare_context_parallel_inputs(model, inputs)
        with train_ctx():
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)


def sliding_window(config: Any) -> Optional[int]:
    """The sliding window a model config makes some of its layers attend within, or None (no layer has one)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", None) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or "sliding_attention" in layer_types else None


# -- options ----------------------------------------------------------------------------------------------------

def _value(value: Any) -> Any:
    return getattr(value, "value", value)


#: ``(option, is it refused (value -> bool), why and what to do)``: LLaMA-Factory's own options under CP
_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("stage", lambda v: v != "sft", "only the SFT workflow (stage: sft) is verified under CP"),
    ("neat_packing", lambda v: v is not True, "packing: true without neat_packing lets the documents of a row attend "
     "to each other, and unpacked rows are not verified under CP: set neat_packing: true"),
    ("finetuning_type", lambda v: v not in ("lora", "freeze", "full"), "OFT is not verified under CP through this "
     "entry: use lora (LLaMA-Factory's default), freeze or full"),
    ("flash_attn", lambda v: _value(v) not in ("auto", "sdpa", "disabled"), "under the mixin the model attends with "
     "blockdiag-cp's per-document kernel (chosen by CPConfig), and LLaMA-Factory's FlashAttention path unpads the "
     "rows itself: leave flash_attn at auto, sdpa or disabled"),
    ("shift_attn", bool, "LongLoRA's shifted short attention mixes heads across groups of tokens, not documents: "
     "turn it off"),
    ("use_unsloth", bool, "unsloth replaces the model's attention and loss: turn it off"),
    ("use_unsloth_gc", bool, "unsloth's gradient checkpointing is not verified under CP: turn it off"),
    ("enable_liger_kernel", bool, "Liger kernels replace the loss forward, which would shift labels inside each "
     "shard: turn them off"),
    ("use_v1_kernels", bool, "LLaMA-Factory's v1 kernels replace model modules: turn them off"),
    ("use_kt", bool, "KTransformers replaces the model's modules: turn it off"),
    ("mixture_of_depths", lambda v: v is not None, "mixture-of-depths routes tokens across the row: leave it unset"),
    ("rope_scaling", lambda v: v is not None, "RoPE scaling is not verified under CP (dynamic scaling reads the "
     "longest position of the forward's input, a shard's under CP): leave it unset"),
    ("quantization_bit", lambda v: v is not None, "quantized training is not verified under CP: leave "
     "quantization_bit unset"),
    ("use_dft_loss", bool, "LLaMA-Factory's DFT loss is not verified under CP: turn it off"),
    ("use_eaft_loss", bool, "LLaMA-Factory's EAFT loss is not verified under CP: turn it off"),
    ("use_asft_loss", bool, "ASFT runs a reference model on the unsharded rows with their dense mask: turn it off"),
    ("use_galore", bool, "GaLore is not verified under CP (its layer-wise mode updates inside backward): use the "
     "Trainer's optimizers"),
    ("use_apollo", bool, "APOLLO is not verified under CP: use the Trainer's optimizers"),
    ("use_badam", bool, "BAdam patches gradient clipping and is not verified under CP"),
    ("use_adam_mini", bool, "Adam-mini is not verified under CP: use the Trainer's optimizers"),
    ("use_muon", bool, "Muon is not verified under CP: use the Trainer's optimizers"),
    ("use_mca", bool, "mcore_adapter trains with Megatron's own parallelism, not this Trainer: turn it off"),
    ("use_hyper_parallel", bool, "hyper_parallel's workflow has its own parallelism and trainer: turn it off"),
    ("compute_accuracy", bool, "the token accuracy metric is not verified through this entry: turn it off (eval_loss "
     "is)"),
    ("streaming", bool, "streamed datasets are not verified under CP through this entry: turn streaming off"),
    ("predict_with_generate", bool, "generation from packed CP rows is not supported: evaluate the loss, generate "
     "without CP"),
    ("fp8", bool, "FP8 training is not verified under CP: turn it off"),
)


def _defaults() -> dict[str, Any]:
    """LLaMA-Factory's default of every option `_REFUSED` names (its argument dataclasses' defaults)."""
    from llamafactory.hparams import DataArguments, FinetuningArguments, ModelArguments, TrainingArguments

    out = {}
    for cls in (ModelArguments, DataArguments, FinetuningArguments, TrainingArguments):
        out.update({f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING})
    return out


def refusals(config: dict[str, Any]) -> list[str]:
    """``"option=value: why"`` for each option of LLaMA-Factory config `config` refused under CP (a missing option
    has LLaMA-Factory's default)."""
    values = {**_defaults(), **config}
    return [f"{name}={_value(values.get(name))!r}: {why}" for name, refused, why in _REFUSED
            if refused(values.get(name))]


def check_config(args: Any) -> None:
    """`ValueError` naming every refused option of LLaMA-Factory config `args` (a dict or ``--key value`` strings,
    without `CP_SIZE_KEY`), read by LLaMA-Factory's own parser (its checks run as in ``llamafactory-cli``); Ray
    launches are refused too (the entry is started by torchrun)."""
    from llamafactory.extras.misc import use_ray

    if use_ray():
        raise ValueError("USE_RAY: the entry runs under torchrun, not Ray: unset USE_RAY")
    if isinstance(args, dict):  # named before LLaMA-Factory's own checks, which may ask to install what is refused
        refuse_yaml_booleans(args)
        _raise_refusals(refusals(args))
    _raise_refusals(refusals(parsed_options(args)))


def _raise_refusals(found: list[str]) -> None:
    if found:
        raise ValueError("LLaMA-Factory under blockdiag-cp refuses options that would differ from the run without CP "
                         "or that are not verified:\n  " + "\n  ".join(found))


def parsed_options(args: Any) -> dict[str, Any]:
    """Every option of LLaMA-Factory config `args` (a dict or ``--key value`` strings) as LLaMA-Factory's own
    ``get_train_args`` reads it (defaults filled in, its checks run), by name."""
    from llamafactory.hparams import get_train_args

    parsed = get_train_args(copy.deepcopy(args))
    return {f.name: getattr(group, f.name) for group in parsed for f in dataclasses.fields(group)}


def refuse_yaml_booleans(args: Any) -> None:
    """`ValueError` naming each option that YAML read as a boolean where LLaMA-Factory's field takes a string or an
    enum: an unquoted ``no`` / ``off`` / ``yes`` / ``on`` (``eval_strategy=no`` on the command line or
    ``eval_strategy: no`` in the file) is ``False`` / ``True`` to OmegaConf, as ``llamafactory-cli`` reads it too
    (it then fails inside ``TrainingArguments`` without naming the option)."""
    if not isinstance(args, dict):
        return  # --key value strings: HfArgumentParser reads each value as its field's type
    types = _field_types()
    found = [f"{name}={value!r}" for name, value in args.items()
             if isinstance(value, bool) and name in types and not types[name]]
    if found:
        raise ValueError(f"{', '.join(found)}: YAML reads an unquoted no, off, yes or on as a boolean, and these options "
                         "take a string: quote the value (key: 'no' in the YAML file, key=\"'no'\" on the command line), "
                         "as llamafactory-cli needs it too")


def _field_types() -> dict[str, bool]:
    """Whether each option of LLaMA-Factory's training config accepts a bool (by name)."""
    import typing

    from llamafactory.hparams import (DataArguments, FinetuningArguments, GeneratingArguments, ModelArguments,
                                      TrainingArguments)

    out = {}
    for cls in (ModelArguments, DataArguments, TrainingArguments, FinetuningArguments, GeneratingArguments):
        hints = typing.get_type_hints(cls)
        out.update({f.name: _accepts_bool(hints.get(f.name, Any)) for f in dataclasses.fields(cls)})
    return out


def _accepts_bool(hint: Any) -> bool:
    """Whether a field typed `hint` takes a bool (anything but strings, enums and their optional unions)."""
    import enum
    import typing

    args = typing.get_args(hint) or (hint,)
    return not all(a is str or a is type(None) or (isinstance(a, type) and issubclass(a, enum.Enum)) for a in args)


def split_config(config: Any) -> tuple[Any, int]:
    """``(LLaMA-Factory's config, cp_size)``: `CP_SIZE_KEY` taken out of `config` (a dict from a YAML or JSON file, or
    ``--key value`` strings, as LLaMA-Factory's ``read_args`` returns them; a new object) and checked."""
    if isinstance(config, dict):
        if CP_SIZE_KEY not in config:
            raise ValueError(f"set {CP_SIZE_KEY}: N in the config (ranks per CP group, dividing the world size)")
        rest, cp_size = {k: v for k, v in config.items() if k != CP_SIZE_KEY}, config[CP_SIZE_KEY]
    else:
        rest, cp_size = _split_flags([str(a) for a in config])
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"{CP_SIZE_KEY} must be an int >= 1, got {cp_size!r}")
    return rest, cp_size


def _split_flags(argv: list[str]) -> tuple[list[str], Any]:
    """``(the other flags, the value)`` of ``--blockdiag_cp_size N`` among ``--key value`` strings."""
    import argparse

    flag = "--" + CP_SIZE_KEY
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(flag, flag.replace("_", "-"), dest="cp_size", type=int, default=None)
    try:
        known, rest = parser.parse_known_args(argv)
    except SystemExit as exc:  # argparse exits on a value that is not an int
        raise ValueError(f"{flag} must be an int >= 1, in {argv}") from exc
    if known.cp_size is None:
        raise ValueError(f"set {flag} N (ranks per CP group, dividing the world size)")
    return rest, known.cp_size


def read_config(argv: Sequence[str]) -> Any:
    """The config of ``cfg.yaml [key=value ...]``, ``cfg.json [key=value ...]`` or ``--key value ...``, read by
    LLaMA-Factory's own ``read_args`` exactly as ``llamafactory-cli train`` reads its command line (a dict for a
    file and its overrides, merged by OmegaConf; the strings otherwise)."""
    from llamafactory.hparams import read_args

    if not argv:
        raise ValueError("usage: torchrun ... -m blockdiag_cp.integrations.llamafactory cfg.yaml [key=value ...]")
    own, sys.argv = sys.argv, [sys.argv[0] if sys.argv else "llamafactory", *map(str, argv)]
    try:
        return read_args()
    except AttributeError as exc:  # LLaMA-Factory 0.9.5 passes the JSON file's Path to json.load
        if str(argv[0]).endswith(".json"):
            raise ValueError(f"{argv[0]}: this LLaMA-Factory cannot read a JSON config ({exc}; llamafactory-cli train "
                             "fails on it the same way): write the config as YAML") from exc
        raise
    finally:
        sys.argv = own


def run(config: Any, callbacks: Optional[list] = None,
        trainer_class: type = LlamaFactoryCPTrainer) -> None:
    """Run LLaMA-Factory's SFT workflow on `config` (its config plus `CP_SIZE_KEY`: a dict, or ``--key value``
    strings) with `trainer_class` (a `LlamaFactoryCPTrainer` subclass) as its trainer, under CP (Note
    [LLaMA-Factory's SFT under the mixin])."""
    from llamafactory.train import tuner
    from llamafactory.train.sft import workflow

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, LlamaFactoryCPTrainer)):
        raise TypeError(f"trainer_class must subclass LlamaFactoryCPTrainer, got {trainer_class!r}")
    args, cp_size = split_config(config)
    check_config(args)
    own = workflow.CustomSeq2SeqTrainer
    workflow.CustomSeq2SeqTrainer = _with_cp_size(trainer_class, cp_size)
    try:
        tuner.run_exp(args=args, callbacks=callbacks)
    finally:
        workflow.CustomSeq2SeqTrainer = own


def _with_cp_size(trainer_class: type, cp_size: int) -> Callable[..., Any]:
    """`trainer_class` built with ``cp_size`` (what `run_sft` calls in place of its own trainer class)."""
    def build(*args: Any, **kwargs: Any) -> Any:
        return trainer_class(*args, cp_size=cp_size, **kwargs)

    return build


def main(argv: Optional[Sequence[str]] = None, trainer_class: type = LlamaFactoryCPTrainer) -> None:
    """``python -m blockdiag_cp.integrations.llamafactory cfg.yaml [key=value ...]`` under torchrun."""
    run(read_config(sys.argv[1:] if argv is None else argv), trainer_class=trainer_class)


if __name__ == "__main__":
    main()
