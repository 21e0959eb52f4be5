"""Several LLaMA-Factory runs in one torchrun launch (tests/stacks/test_llamafactory.py), one config after another.

    torchrun --nproc-per-node W tests/stacks/llamafactory_runs.py plain a.yaml b.yaml ...
    torchrun --nproc-per-node W tests/stacks/llamafactory_runs.py cp a.yaml b.yaml ...

``plain``: LLaMA-Factory's own run of each config, without CP: its ``run_exp()`` reading the command line
``a.yaml`` with its own ``read_args``, as ``FORCE_TORCHRUN=1 llamafactory-cli train a.yaml`` runs it (its launcher
starts ``torchrun launcher.py a.yaml``, which calls ``run_exp()``). A config whose ``cutoff_len`` is not a multiple
of 8 cannot run there as LLaMA-Factory ships (its collator pads ``input_ids`` to a multiple of 8 and not
``position_ids``, and the model stops on the mismatch): for those, and only those, the collator's ``position_ids``
are padded with 0 here, as its packing pads them (`pad_positions_as_packing_does`).

``cp``: the entry (`blockdiag_cp.integrations.llamafactory.main`) on each config, with `ProbeTrainer`: LLaMA-Factory's
own SFT workflow trains, saves and evaluates as usual; between training and saving, the probe takes the first
packed row of the evaluation data (LLaMA-Factory's neat packing, through the entry's collator), changes the tokens
of its first document, and writes every target's loss before and after, computed under CP and gathered, to
``<output_dir>/leak_probe.json`` (rank 0).

Between configs: LLaMA-Factory ends each run by destroying the process group; here it is kept until the last
config ends, so the next one runs in the same processes (each config's ``TrainingArguments`` resets accelerate's
state; the environment, where accelerate marks a DeepSpeed run, and transformers' ZeRO-3 flag are restored after
each run).
"""

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import yaml

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


def pad_positions_as_packing_does(collator_class: type) -> type:
    """`collator_class` whose ``position_ids`` are right-padded with 0 to the length of its ``input_ids``."""

    class PaddedPositions(collator_class):
        def __call__(self, features):
            batch = super().__call__(features)
            missing = batch["input_ids"].shape[-1] - batch["position_ids"].shape[-1]
            batch["position_ids"] = torch.nn.functional.pad(batch["position_ids"], (0, missing), value=0)
            return batch

    return PaddedPositions


def run_plain(path: str) -> None:
    """LLaMA-Factory's own ``run_exp()`` on the command line ``path`` (module docstring)."""
    from llamafactory.train import tuner
    from llamafactory.train.sft import workflow

    own_collator = workflow.SFTDataCollatorWith4DAttentionMask
    if yaml.safe_load(open(path))["cutoff_len"] % 8:
        workflow.SFTDataCollatorWith4DAttentionMask = pad_positions_as_packing_does(own_collator)
    own_argv, sys.argv = sys.argv, ["launcher.py", path]
    try:
        tuner.run_exp()
    finally:
        sys.argv, workflow.SFTDataCollatorWith4DAttentionMask = own_argv, own_collator


def cpu_map_location(load):
    """`torch.load` reading ``map_location=torch.device("cpu", 0)`` as ``"cpu"``: on CPU, accelerate gives every
    process of a multi-process launch the device ``cpu:0``, the Trainer loads a checkpoint's optimizer state with
    ``map_location=args.device`` when the world is larger than 1, and torch cannot restore to ``cpu:0`` (a resume on
    CPU fails there with or without CP; on GPUs the device is ``cuda:N``)."""

    def load_on_cpu(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    return load_on_cpu


def run_all(mode: str, paths: list[str]) -> None:
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    destroy, load = dist.destroy_process_group, torch.load
    dist.destroy_process_group = lambda *args, **kwargs: None  # LLaMA-Factory's, at the end of each run
    torch.load = cpu_map_location(load)
    try:
        for path in paths:
            started, environment = time.perf_counter(), dict(os.environ)
            if mode == "plain":
                run_plain(path)
            else:
                main([path], trainer_class=ProbeTrainer)
            os.environ.clear()  # accelerate sets ACCELERATE_USE_DEEPSPEED for the process when a run uses DeepSpeed
            os.environ.update(environment)
            unset_hf_deepspeed_config()
            gc.collect()
            print(f"llamafactory_runs: {mode} {os.path.basename(path)}: {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
    finally:
        dist.destroy_process_group, torch.load = destroy, load
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("plain", "cp"):
        raise SystemExit("usage: torchrun ... llamafactory_runs.py plain|cp a.yaml [b.yaml ...]")
    run_all(sys.argv[1], sys.argv[2:])
