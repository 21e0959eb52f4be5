"""Side by side in verl's FSDP engine: its Ulysses SP against the block-diagonal CP engine, on the same CPU rows.

    python benchmarks/verl_vs_ulysses.py                   # the cases of docs/verl.md (~15 min on 2 shared CPU cores)
    python benchmarks/verl_vs_ulysses.py --heads 4/4,6/3 --sp 2 --tokens 2048 --steps 3

Needs the verl venv (``bash tests/stacks/run.sh verl`` makes ``.venv-verl``). Each case is a tiny Qwen2 (2 layers,
heads of 16, float32, random weights) and one batch of packed sequences (prompt + response rows as verl's rollout
leaves them; ``--tokens`` in all, one micro-batch: verl packs it into one row), run through verl's actor
``TrainingWorker`` on `sp` CPU gloo ranks under the CPU platform of tests/stacks/verl_cpu.py (a test fixture), with:

- **ulysses/sdpa**: verl's own FSDP engine at ``ulysses_sequence_parallel_size=sp`` with ``attn_implementation=
  "sdpa"``, as a verl user runs it where flash attention is not installed: verl's Ulysses patch replaces only
  transformers' flash forward, so each rank attends within its own slice of the row;
- **ulysses/per-doc**: the same with a per-document kernel in place of flash-attn's varlen one (what a GPU with
  flash-attn would run): verl's Ulysses all-to-alls around a CPU kernel that attends per document by
  ``position_ids``, as flash-attn's varlen path does (`per_document_attention`);
- **blockdiag_cp**: the block-diagonal CP engine (``VERL_ENGINE_VENDOR=blockdiag_cp``) at cp = sp.

Per case and method: **exact** = the largest |log-prob - verl's engine at sp 1| over the response tokens (one
process, sdpa: transformers' per-document mask from the restarting ``position_ids``), within 1e-5 relative;
**bytes/layer**: what the busiest rank sends inside the attention calls (the ``wchar`` delta of /proc/self/io,
brackets from benchmarks/vs_ulysses_alst.py) of one training step (forward and backward), per layer; **step ms**:
the median wall time of ``train_batch`` over the steps after the first, slowest rank (**CPU ms**: the same of the
rank's CPU time, less moved by other work on the machine); a head count verl's Ulysses refuses is ``refused``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STACKS = os.path.join(HERE, os.pardir, "tests", "stacks")
LAYERS, HEAD_DIM, VOCAB = 2, 16, 257
METHODS = ("ulysses/sdpa", "ulysses/per-doc", "blockdiag_cp")
PER_DOC = "cpu_per_document_varlen"  # the attention name the per-document stand-in for flash-attn registers


def per_document_attention(query, key, value, attention_mask, query_length, *args, position_ids=None,
                           softmax_scale=None, **kwargs):
    """flash-attn's varlen forward on CPU: ``[1, S, H, D]`` q and ``[1, S, Hk, D]`` k, v, causal per document, the
    documents where ``position_ids`` restart at 0 (transformers' rule for packed rows); ``[1, S, H, D]`` out."""
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist() + [query.shape[1]]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                         scale=softmax_scale, enable_gqa=True)
        for a, b in zip(starts[:-1], starts[1:]) if b > a], dim=2)
    return out.transpose(1, 2)


def install_per_document_kernel() -> None:
    """``attn_implementation=PER_DOC``: transformers' flash forward (which verl's Ulysses patch wraps in its
    all-to-alls) with `per_document_attention` as its kernel, and no mask built."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    import verl.models.transformers.monkey_patch as verl_patch

    AttentionInterface.register(PER_DOC, flash_attention_forward)
    AttentionMaskInterface.register(PER_DOC, flash_attention_mask)
    verl_patch._flash_attention_forward = per_document_attention  # the kernel verl's Ulysses forward calls


def case_model(root: str, heads: int, kv_heads: int) -> str:
    import transformers

    sys.path.insert(0, STACKS)
    from verl_runs import byte_tokenizer

    path = os.path.join(root, f"qwen2_{heads}_{kv_heads}")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=heads * HEAD_DIM, intermediate_size=4 * HEAD_DIM,
                                          num_hidden_layers=LAYERS, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, max_position_embeddings=8192,
                                          tie_word_embeddings=False, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1)
        transformers.Qwen2ForCausalLM(config).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
    return path


def batch(tokens: int, seed: int = 0):
    """Sequences of 64 to 512 tokens (prompt a quarter), `tokens` in all, as verl's driver hands them over."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(64, 513, (1,), generator=g)), tokens - sum(lengths)))
    lengths = [n for n in lengths if n >= 8]
    P, R = max(n // 4 for n in lengths), max(n - n // 4 for n in lengths)
    ids = torch.full((len(lengths), P + R), VOCAB - 1)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        p = n // 4
        ids[i, P - p:P + n - p] = torch.randint(1, VOCAB - 1, (n,), generator=g)
        mask[i, P - p:P + n - p] = 1
    data = DataProto.from_single_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "prompts": ids[:, :P], "responses": ids[:, P:], "response_mask": mask[:, P:],
        "advantages": torch.randn(len(lengths), R, generator=g), "old_log_probs": torch.zeros(len(lengths), R),
        "ref_log_prob": torch.zeros(len(lengths), R)},
        meta_info={"temperature": 1.0, "global_token_num": mask.sum(-1).tolist()})
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=len(lengths), calculate_entropy=False)
    return td, mask[:, P:].bool()


def worker(rank: int, world: int, case: dict, method: str, root: str) -> dict:
    """One rank: the actor's engine of `method`, the log-probs of the batch, `steps` metered training steps."""
    from functools import partial

    sys.path.insert(0, STACKS)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                      OMP_NUM_THREADS="1")
    if method == "blockdiag_cp":
        os.environ["VERL_ENGINE_VENDOR"] = "blockdiag_cp"
    import verl_cpu

    verl_cpu.use_cpu_platform()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    sys.path.insert(0, HERE)
    from vs_ulysses_alst import AttentionBytes

    attention = {"ulysses/sdpa": "sdpa", "ulysses/per-doc": PER_DOC, "blockdiag_cp": "sdpa", "reference": "sdpa"}[method]
    if method == "ulysses/per-doc":
        install_per_document_kernel()
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    model = HFModelConfig(path=case["model"], use_remove_padding=True, enable_gradient_checkpointing=False,
                          override_config={"attn_implementation": attention},
                          external_lib="blockdiag_cp.integrations.verl" if method == "blockdiag_cp" else None)
    engine = FSDPEngineConfig(strategy="fsdp2", ulysses_sequence_parallel_size=world, use_dynamic_bsz=True,
                              max_token_len_per_gpu=case["tokens"], infer_max_token_len_per_gpu=case["tokens"],
                              use_torch_compile=False, mixed_precision=fp32)  # one micro-batch: the whole batch
    config = TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                  optimizer_config=FSDPOptimizerConfig(lr=1e-4, total_training_steps=case["steps"]),
                                  checkpoint_config=None)
    try:
        actor = TrainingWorker(config=config)
        actor.reset()
    except AssertionError as exc:  # verl's Ulysses head-count asserts
        return {"refused": str(exc).split(".")[0]}
    actor.set_loss_fn(partial(ppo_loss, config=ActorConfig(strategy="fsdp2", rollout_n=1, use_kl_loss=False,
                                                           use_dynamic_bsz=True)))
    td, response_mask = batch(case["tokens"])
    tu.assign_non_tensor(td, compute_loss=False)
    out = actor.infer_batch(td)
    log_probs = None if out is None else no_padding_2_padding(tu.get(out, "log_probs"), td).float()
    impl = actor.engine.module.config._attn_implementation
    meter = AttentionBytes()
    ALL_ATTENTION_FUNCTIONS[impl] = meter.wrap(ALL_ATTENTION_FUNCTIONS[impl])
    ms, cpu_ms, sent = [], [], []
    for _ in range(case["steps"]):
        td, _ = batch(case["tokens"])
        meter.total, t0, c0 = 0, time.perf_counter(), time.process_time()
        actor.train_batch(td)
        ms.append((time.perf_counter() - t0) * 1e3)
        cpu_ms.append((time.process_time() - c0) * 1e3)
        sent.append(meter.total / LAYERS)
    return {"log_probs": log_probs, "mask": response_mask, "ms": ms, "cpu_ms": cpu_ms, "bytes": sent[-1]}


def run_case(case: dict, method: str, world: int, root: str) -> dict:
    from blockdiag_cp.testing import spawn

    ranks = spawn(worker, world, case, method, root, timeout=3600)
    if "refused" in ranks[0]:
        return ranks[0]
    return {"log_probs": ranks[0]["log_probs"], "mask": ranks[0]["mask"],
            "ms": max(statistics.median(r["ms"][1:] or r["ms"]) for r in ranks),
            "cpu_ms": max(statistics.median(r["cpu_ms"][1:] or r["cpu_ms"]) for r in ranks),
            "bytes": max(r["bytes"] for r in ranks)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", default="4/4,4/2,6/3", help="query/key-value heads of each model")
    parser.add_argument("--sp", default="2,4")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    sys.path.insert(0, STACKS)
    with tempfile.TemporaryDirectory() as root:
        print("| heads | sp | method | exact (max abs log-prob error) | bytes/layer (busiest rank) | step ms | CPU ms |")
        print("|---|---|---|---|---|---|---|")
        for heads in args.heads.split(","):
            h, hk = (int(x) for x in heads.split("/"))
            case = {"model": case_model(root, h, hk), "tokens": args.tokens, "steps": args.steps}
            reference = run_case(case, "reference", 1, root)
            for sp in (int(x) for x in args.sp.split(",")):
                for method in METHODS:
                    got = run_case(case, method, sp, root)
                    if "refused" in got:
                        print(f"| {heads} | {sp} | {method} | refused: {got['refused']} | - | - | - |", flush=True)
                        continue
                    mask = reference["mask"]
                    error = float((got["log_probs"] - reference["log_probs"])[mask].abs().max())
                    scale = float(reference["log_probs"][mask].abs().max())
                    verdict = "yes" if error <= 1e-5 * scale else "**no**"
                    print(f"| {heads} | {sp} | {method} | {verdict} ({error:.2g}) | {got['bytes'] / 1024:.0f} KiB | "
                          f"{got['ms']:.0f} | {got['cpu_ms']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
