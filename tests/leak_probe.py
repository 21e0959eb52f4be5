"""Leak probe in the style of TRL issue 6843, run under torchrun by tests/integrations/test_trainer.py.

Packs documents with TRL's padding-free collator, runs the packed row through the CP
trainer's own batch hook and the model under CP, and compares every token's loss before
and after the tokens of one document are changed. Prints one JSON line (rank 0).
"""

import json
import os
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))


def per_token_losses(trainer, features):
    """``[S]`` loss of every target of the packed row, computed under CP and gathered."""
    import trl

    from blockdiag_cp import gather_sequence
    from blockdiag_cp.step.rows import shifted_labels

    batch = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(features)
    targets = shifted_labels(batch["labels"])[0]
    train_ctx, inputs = trainer._prepare_context_parallel_inputs(trainer.model, batch)
    with torch.no_grad(), train_ctx():
        logits = trainer.model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
        full = gather_sequence(logits)[0]
    losses = torch.nn.functional.cross_entropy(full.float(), targets, ignore_index=-100, reduction="none")
    return losses, targets


def main():
    from train_trainer import documents, tiny_llama, training_arguments, parse_args

    from blockdiag_cp.trainer import BlockDiagCPTrainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = BlockDiagCPTrainer(model=tiny_llama().double(), args=training_arguments(parse_args([]), tmp), cp_size=2)
    docs = documents(6, seed=3)
    edited = [dict(d) for d in docs]
    victim = 2
    edited[victim] = {"input_ids": [(t * 7 + 3) % 256 for t in docs[victim]["input_ids"]]}
    edited[victim]["labels"] = edited[victim]["input_ids"]
    before, targets = per_token_losses(trainer, docs)
    after, _ = per_token_losses(trainer, edited)
    lengths = [len(d["input_ids"]) for d in docs]
    start = sum(lengths[:victim])
    inside = torch.zeros_like(before, dtype=torch.bool)
    inside[max(0, start - 1) : start + lengths[victim]] = True  # its targets (and the previous token's, ignored)
    valid = targets != -100
    changed = (before != after) & valid
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"changed_inside": int((changed & inside).sum()), "changed_elsewhere": int((changed & ~inside).sum()),
                          "targets": int(valid.sum())}), flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
