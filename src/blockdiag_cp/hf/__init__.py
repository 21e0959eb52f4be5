"""transformers integration: importing this package registers ``attn_implementation="blockdiag_cp"``.

    interface.py  the attention and mask functions registered with transformers' public
                  ``AttentionInterface`` / ``AttentionMaskInterface`` (nothing is monkeypatched)
    vlm.py        make_cp_vlm_batch_and_ctx: a packed vision-language row to a sharded CP step
    load.py       from_pretrained / from_config: the implementation set and the model prepared
    scoring.py    ScoringSession: TRL's fused-head scoring forwards on padded rows, as one packed row under CP
    replica.py    a dp replica's view of the accelerator, for DPO / GRPO code under CP
    losses.py     the Trainer's and TRL's loss paths outside the model, on the unsharded rows' targets and count
    linear_ce.py  a causal LM's loss and log-probs from its hidden states and head, never holding the logits
    moe.py        an MoE router's load-balancing loss of the unsharded rows
    neftune.py    NEFTune's noise as the run without CP draws it
    options.py    every TrainingArguments / TRL config option: inert, verified, or refused when set
    model_checks.py  refusals of models the mixin cannot train exactly (PEFT virtual tokens, loss inputs)
    trainer_kinds.py    the mixin's strategy interface, and the one choice of a strategy per trainer kind
    trainer_rows.py     the strategy of trainers of rows (the Trainer, TRL's SFTTrainer)
    trainer_scoring.py  the strategies of scoring trainers (TRL's DPOTrainer, GRPOTrainer)

`prepare_model(model)` (from `blockdiag_cp.mixers`) routes a hybrid model's supported token
mixers per document, on packed rows and inside CP steps, gives Llama 4's temperature-tuned
attention its document positions, and refuses by name a model whose token mixing it cannot
verify to go through the library (Note [Every token mixer verified] in mixers/verify.py).
The Trainer mixin is `blockdiag_cp.trainer`.
"""

from ..mixers import prepare_model
from .interface import ATTN_IMPLEMENTATION, blockdiag_cp_attention, blockdiag_cp_mask, register
from .linear_ce import causal_lm_log_probs, linear_ce_loss
from .load import from_config, from_pretrained
from .scoring import ScoringSession
from .vlm import make_cp_vlm_batch_and_ctx, vlm_model_inputs

register()

__all__ = (
    "ATTN_IMPLEMENTATION",
    "blockdiag_cp_attention",
    "blockdiag_cp_mask",
    "causal_lm_log_probs",
    "from_config",
    "from_pretrained",
    "linear_ce_loss",
    "make_cp_vlm_batch_and_ctx",
    "prepare_model",
    "register",
    "ScoringSession",
    "vlm_model_inputs",
)
