"""Peak memory per rank of a Trainer step under the mixin as the CP world grows: DDP, ZeRO-3, FSDP2; plain loss
against ``linear_ce=True``.

    python benchmarks/trainer_memory.py                     # a row of 8,192 tokens, vocabulary 65,536
    python benchmarks/trainer_memory.py --quick             # 1,024 tokens, vocabulary 8,192 (a smoke run)

One packed row of `--tokens` tokens (4 documents) per optimizer step, sharded over ``cp = world`` ranks (dp 1:
each rank holds ``tokens / cp`` of it), a narrow Llama from its config (hidden 64, 2 layers, the `--vocab`
vocabulary: the logits weigh most), float32, one torch thread per rank, through `BlockDiagCPTrainer`
(transformers' Trainer with the mixin) on fresh gloo processes for each case:

- *ddp*: the Trainer's own data parallelism (no wrapper at world 1);
- *zero3*: DeepSpeed ZeRO-3 (``deepspeed=`` a config dict; under ``linear_ce=True`` the head's weight is whole
  from the start of the forward to the end of the backward: Note [A loss outside the modules under ZeRO-3]);
- *fsdp2*: accelerate's FSDP2 (``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}``), prepared on CPU by
  the stand-in of tests/trainer_runs.py (`CPUStandInForAccelerateFSDP2`: accelerate drops the FSDP plugin on CPU;
  the stand-in puts it back where its GPU path keeps it, and accelerate's own FSDP2 preparation runs).

Per rank, a Trainer callback resets the peak RSS (``VmHWM``, through ``/proc/self/clear_refs``) when a step
begins and reads it when the step ends; the table gives the second step's peak above the RSS at its start (the
first allocates the optimizer's state), the max over ranks, in GiB. The last line is the ratio at world 1 (the
longest shard) against the goal (<= 0.2), and whether linear-CE ever peaks above the plain loss.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

from linear_ce_memory import peak_kib  # the peak RSS, as the one-process benchmark reads it

DOCUMENTS = 4
STACKS = ("ddp", "zero3", "fsdp2")
TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests")


def stack_args(stack: str) -> dict:
    """``TrainingArguments`` options of `stack`, as people write them (the tests' own: tests/trainer_runs.py)."""
    sys.path.insert(0, TESTS)
    from trainer_runs import fsdp2, zero

    return {"zero3": {"deepspeed": zero(3)}, "fsdp2": fsdp2(), "ddp": {}}[stack]


def worker(rank: int, world: int, stack: str, linear_ce: bool, tokens: int, vocab: int) -> dict:
    """One rank of the case: two optimizer steps; the second's peak above its start (GiB), or the refusal."""
    import torch
    import transformers

    from blockdiag_cp.trainer import BlockDiagCPTrainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    options = stack_args(stack)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=tokens)
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    documents = [{"input_ids": ids, "labels": ids} for ids in
                 torch.randint(0, vocab, (2 * DOCUMENTS, tokens // DOCUMENTS), generator=generator).tolist()]
    peaks: list[float] = []

    class Peak(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := the RSS now
            self.base = peak_kib()

        def on_step_end(self, args, state, control, **kwargs):
            peaks.append((peak_kib() - self.base) / 2**20)

    trainer_class = BlockDiagCPTrainer
    if stack == "fsdp2":
        from trainer_runs import CPUStandInForAccelerateFSDP2  # on sys.path: stack_args

        trainer_class = type("CPUFSDP2Trainer", (CPUStandInForAccelerateFSDP2, BlockDiagCPTrainer), {})
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=DOCUMENTS, max_steps=2, learning_rate=1e-4, logging_steps=1,
            save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0, **options)
        try:
            trainer = trainer_class(model=model, args=args, train_dataset=documents, cp_size=world, linear_ce=linear_ce,
                                    data_collator=transformers.DataCollatorWithFlattening(), callbacks=[Peak()])
        except ValueError as refusal:
            return {"refused": str(refusal)}
        trainer.remove_callback(transformers.PrinterCallback)  # the table is the output
        trainer.train()
    return {"peak_gib": peaks[-1], "loss": trainer.state.log_history[-2].get("loss")}


def case(world: int, stack: str, linear_ce: bool, tokens: int, vocab: int) -> dict:
    from blockdiag_cp.testing import spawn

    ranks = spawn(worker, world, stack, linear_ce, tokens, vocab, timeout=1800)
    if "refused" in ranks[0]:
        return ranks[0]
    return {"peak_gib": max(r["peak_gib"] for r in ranks), "loss": ranks[0]["loss"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the packed row (over cp = world ranks)")
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    p.add_argument("--quick", action="store_true", help="1,024 tokens, vocabulary 8,192, worlds 1 and 2")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.worlds = 1024, 8192, [1, 2]
    print(f"Trainer + mixin, one packed row of {args.tokens} tokens over cp = world ranks (dp 1), vocabulary "
          f"{args.vocab}, hidden 64 x 2 layers, float32; peak RSS of the second step above its start, max over ranks")
    print("| stack | world = cp | tokens per rank | logits GiB per rank | plain GiB | linear-CE GiB | ratio |")
    print("|---|---|---|---|---|---|---|")
    worst, at_one = 0.0, None
    for stack in args.stacks:
        for world in args.worlds:
            logits = args.tokens / world * args.vocab * 4 / 2**30
            plain = case(world, stack, False, args.tokens, args.vocab)
            lean = case(world, stack, True, args.tokens, args.vocab)
            if "refused" in lean:
                lean_text, ratio_text = "refused", "-"
            else:
                ratio = lean["peak_gib"] / plain["peak_gib"]
                worst = max(worst, ratio)
                at_one = ratio if world == min(args.worlds) and stack == "ddp" else at_one
                lean_text, ratio_text = f"{lean['peak_gib']:.3f}", f"{ratio:.3f}"
            print(f"| {stack} | {world} | {args.tokens // world} | {logits:.2f} | {plain['peak_gib']:.3f} | {lean_text} "
                  f"| {ratio_text} |", flush=True)
    print(f"linear-CE peak / plain peak, ddp at world {min(args.worlds)}: "
          f"{'-' if at_one is None else f'{at_one:.3f}'} (goal <= 0.2); the largest ratio of any case: {worst:.3f} "
          f"(goal: never above 1)")


if __name__ == "__main__":
    main()
