"""The LLaMA-Factory entry under torchrun, with a leak probe after training (tests/stacks/test_llamafactory.py).

    torchrun --nproc-per-node 2 tests/stacks/llamafactory_probe.py cfg.yaml

Runs `blockdiag_cp.integrations.llamafactory.main` with `ProbeTrainer`: LLaMA-Factory's own SFT workflow
trains, saves and evaluates as usual; between training and saving, the probe takes the first packed row of
the evaluation data (LLaMA-Factory's neat packing, through the entry's collator), changes the tokens of its
first document, and writes every target's loss before and after, computed under CP and gathered, to
``<output_dir>/leak_probe.json`` (rank 0).
"""

import json
import os
import sys

import torch

from blockdiag_cp import gather_sequence
from blockdiag_cp.integrations.llamafactory import LlamaFactoryCPTrainer, main
from blockdiag_cp.step.rows import shifted_labels


def row_losses(trainer, row: dict) -> torch.Tensor:
    """``[S]`` loss of every target of one packed row ``[1, S]``, the model run under CP."""
    model = trainer.model
    model.eval()
    train_ctx, inputs = trainer._prepare_context_parallel_inputs(model, dict(row))
    with torch.no_grad(), train_ctx():
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits
        full = gather_sequence(logits)[0]
    model.train()
    targets = shifted_labels(row["labels"])[0]
    return torch.nn.functional.cross_entropy(full.float(), targets, ignore_index=-100, reduction="none")


class ProbeTrainer(LlamaFactoryCPTrainer):
    """The entry's trainer; after training, the leak probe on the first evaluation row."""

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        batch = next(iter(self.get_eval_dataloader()))
        row = {k: v[:1].clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        docs = row["attention_mask"][0]  # neat_packing's own document indices (not what the entry derived from them)
        victim = 1  # the row's first document: a leak would reach the ones after it (causal attention)
        inside = docs == victim
        edited = {k: v.clone() for k, v in row.items()}
        vocab = self.model.config.vocab_size
        edited["input_ids"][0, inside] = (row["input_ids"][0, inside] * 7 + 3) % vocab
        answer = inside & (row["labels"][0] != -100)
        edited["labels"][0, answer] = edited["input_ids"][0, answer]
        before, after = row_losses(self, row), row_losses(self, edited)
        targets = shifted_labels(row["labels"])[0] != -100
        target_in = torch.zeros_like(inside)
        target_in[:-1] = inside[1:] | inside[:-1]  # a target of the victim, or the token predicting its first
        changed = (before != after) & targets
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.path.join(self.args.output_dir, "leak_probe.json"), "w") as f:
                json.dump({"documents": int(docs.max()), "targets": int(targets.sum()),
                           "changed_inside": int((changed & target_in).sum()),
                           "changed_elsewhere": int((changed & ~target_in).sum())}, f)
        return result


if __name__ == "__main__":
    main(sys.argv[1:], trainer_class=ProbeTrainer)
