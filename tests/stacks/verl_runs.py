"""verl runs for tests/stacks/test_verl.py: a few PPO / GRPO steps through verl's own workers and engines on CPU gloo
ranks, with verl's engine at sp 1 or the block-diagonal CP engine, from verl's own trainer config.

What runs is verl's code from its config down: verl's ``ppo_trainer.yaml`` composed with the recipe's overrides
(docs/verl.md), its ``ActorRolloutRefWorker`` (roles ``actor`` and ``ref``) and its critic ``TrainingWorker``, their
``compute_log_prob`` / ``compute_ref_log_prob`` / ``infer_batch`` / ``update_actor`` / ``train_mini_batch``, and the
driver's own steps between them as verl's ``RayPPOTrainer`` takes them (padding to no-padding, ``compute_advantage``,
the mini-batch keys). Two things stand in for what a CPU cannot run: Ray's dispatch (each rank takes its dp
replica's chunk of the batch, as verl's nd dispatch hands it out, and the collect ranks' outputs are gathered) and
the rollout (the responses are seeded random tokens of random lengths, their rewards a fixed function of the tokens).
The CPU platform is tests/stacks/verl_cpu.py (a test fixture).

Nothing is downloaded: the models have random weights, the tokenizer is bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import random
from typing import Any, Optional

import torch

VOCAB = 257  # 256 bytes and <eos> (also the padding)
ENGINE = "blockdiag_cp.integrations.verl"
#: environment of every rank: offline, one thread per process (2 shared cores)
ENV = {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "RAY_DEDUP_LOGS": "0", "VERL_LOGGING_LEVEL": "ERROR"}

#: tiny models, float32, random weights. qwen2_6h: 6 query heads over 3 key/value heads, which verl's Ulysses refuses
#: at sp 2 (3 KV heads) and sp 4 (6 heads); llama: a second family, GQA 4 / 2; qwen3_5: a hybrid (Gated DeltaNet and
#: attention layers, text-only ``Qwen3_5ForCausalLM``)
MODELS = {
    "qwen2_6h": ("Qwen2Config", dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                                     num_key_value_heads=3, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                          linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                                          tie_word_embeddings=False)),
}


def byte_tokenizer():
    import tokenizers
    import transformers

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<eos>": VOCAB - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def model_paths(root: pathlib.Path, family: str) -> tuple[str, str]:
    """Where `write_model` puts the family's causal LM and value model."""
    return str(root / f"{family}_lm"), str(root / f"{family}_value")


def write_model(root: pathlib.Path, family: str, value: bool = True) -> tuple[str, str]:
    """The family's causal LM (actor / reference) and, with `value`, a value model of the same shape (critic,
    ``num_labels=1``), each with the tokenizer, under `root` (once); returns their paths. Not thread-safe (torch's
    global seed): write a family before launches that share it run side by side."""
    import transformers

    config_name, sizes = MODELS[family]
    common = dict(vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=None, eos_token_id=VOCAB - 1,
                  pad_token_id=VOCAB - 1)
    kinds = (("lm", transformers.AutoModelForCausalLM), ("value", transformers.AutoModelForTokenClassification))
    for kind, auto in kinds[:2 if value else 1]:
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**common, **sizes, **({"num_labels": 1} if kind == "value" else {}))
        path = pathlib.Path(model_paths(root, family)[kind == "value"])
        if not (path / "config.json").exists():
            auto.from_config(config).to(torch.float32).save_pretrained(path)
            byte_tokenizer().save_pretrained(path)
    return model_paths(root, family)


@dataclasses.dataclass(frozen=True)
class Run:
    """One verl run: the model, the engine and its CP size, the algorithm and the options the recipe sets.

    Attributes:
        family: a key of `MODELS`.
        world: processes (dp = world / cp).
        cp: verl's ``ulysses_sequence_parallel_size``: the CP size under the engine, verl's Ulysses without it.
        engine: the block-diagonal CP engine (``VERL_ENGINE_VENDOR=blockdiag_cp``); else verl's own FSDP engine.
        estimator: ``gae`` (PPO with the critic) or ``grpo`` (no critic).
        steps: training steps, each a rollout batch of ``prompts x n`` sequences.
        dynamic_bsz: verl's ``use_dynamic_bsz`` (token-budget micro-batches), else 2 sequences per micro-batch.
        checkpointing: the models' gradient checkpointing.
        mini_batches: PPO mini-batches per step (optimizer steps per training step).
        lora_rank: the actor's LoRA rank (0: full fine-tuning; else verl computes the reference log-probs with the
            actor's adapters disabled).
        micro_batch: sequences per micro-batch without dynamic batch size (1: each sequence alone in its micro-batch,
            unpacked: the per-document oracle of a hybrid under verl's own engine).
        probe: the leak probe after the steps (one response token changed: which log-probs move).
        refused: the run is expected to be refused while verl's workers are built; the error's text is returned.
        sample_temperatures: each sequence its own sampling temperature (a ``temperature`` tensor in the batch, which
            verl's engine spreads over the sequence's tokens), else 0.7 for all (verl's ``rollout.temperature``).
    """

    family: str
    world: int = 1
    cp: int = 1
    engine: bool = False
    estimator: str = "gae"
    steps: int = 2
    dynamic_bsz: bool = True
    checkpointing: bool = True
    mini_batches: int = 1
    lora_rank: int = 0
    micro_batch: int = 2
    probe: bool = False
    refused: bool = False
    sample_temperatures: bool = False
    prompts: int = 4
    n: int = 2

    @property
    def critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def ref_in_actor(self) -> bool:
        return self.lora_rank > 0


def overrides(run: Run, lm: str, value: str) -> list[str]:
    """verl's config overrides of `run`: what a user sets on verl's command line (docs/verl.md's recipe)."""
    fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    batch = run.prompts * run.n
    out = [
        f"actor_rollout_ref.model.path={lm}", f"critic.model.path={value}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "+critic.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={run.checkpointing}",
        f"critic.model.enable_gradient_checkpointing={run.checkpointing}",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2", "critic.strategy=fsdp2",
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={run.cp}",
        f"critic.fsdp.ulysses_sequence_parallel_size={run.cp}",
        f"actor_rollout_ref.rollout.n={run.n}", f"data.train_batch_size={run.prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={run.prompts // run.mini_batches}",
        f"critic.ppo_mini_batch_size={run.prompts // run.mini_batches}",
        f"actor_rollout_ref.actor.use_dynamic_bsz={run.dynamic_bsz}",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=48", "critic.ppo_max_token_len_per_gpu=48",
        *(f"{key}={run.micro_batch}" for key in (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
            "critic.forward_micro_batch_size_per_gpu")),
        "critic.shuffle=false",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.actor.optim.lr=0.001", "critic.optim.lr=0.001",
        f"actor_rollout_ref.actor.optim.total_training_steps={run.steps}", f"critic.optim.total_training_steps={run.steps}",
        f"algorithm.adv_estimator={run.estimator}",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=false", "critic.fsdp.use_torch_compile=false",
        f"++actor_rollout_ref.actor.fsdp_config.mixed_precision={fp32}",
        f"++actor_rollout_ref.ref.fsdp_config.mixed_precision={fp32}", f"++critic.fsdp.mixed_precision={fp32}",
        "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
    ]
    if run.lora_rank:
        out += [f"actor_rollout_ref.model.lora_rank={run.lora_rank}", "actor_rollout_ref.model.lora_alpha=16",
                "actor_rollout_ref.model.target_modules=all-linear"]
    if run.engine:
        out += [f"actor_rollout_ref.model.external_lib={ENGINE}", f"critic.model.external_lib={ENGINE}"]
    return out


def compose(run: Run, lm: str, value: str):
    """verl's ``ppo_trainer`` config with `run`'s overrides (hydra, as ``python -m verl.trainer.main_ppo`` composes)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    import verl

    config_dir = str(pathlib.Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose("ppo_trainer", overrides=overrides(run, lm, value))


# ---------------------------------------------------------------------------------------------- the rollouts


def rollout_batch(run: Run, step: int):
    """The step's sequences as verl's rollout leaves them: ``prompts x n`` rows, prompts left-padded (3 to 12
    tokens), responses right-padded (2 to 14 tokens), positions from the attention mask, a ``uid`` per prompt,
    token-level rewards on each response's last token (the share of its tokens below 128), the sampling
    temperature(s)."""
    import numpy as np
    from verl import DataProto

    rng = random.Random(1000 * step + 7)
    P, R = 12, 14
    rows = []
    for prompt in range(run.prompts):
        prompt_ids = [rng.randrange(1, 256) for _ in range(rng.randint(3, P))]
        for _ in range(run.n):
            rows.append((prompt, prompt_ids, [rng.randrange(1, 256) for _ in range(rng.randint(2, R))]))
    B = len(rows)
    input_ids = torch.full((B, P + R), VOCAB - 1)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    rewards = torch.zeros(B, R)
    for i, (_, prompt_ids, response) in enumerate(rows):
        input_ids[i, P - len(prompt_ids):P] = torch.tensor(prompt_ids)
        input_ids[i, P:P + len(response)] = torch.tensor(response)
        mask[i, P - len(prompt_ids):P + len(response)] = 1
        rewards[i, len(response) - 1] = sum(t < 128 for t in response) / len(response)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    data = DataProto.from_single_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids, "prompts": input_ids[:, :P],
         "responses": input_ids[:, P:], "response_mask": mask[:, P:], "token_level_scores": rewards,
         "token_level_rewards": rewards},
        meta_info={"global_token_num": mask.sum(-1).tolist()},
    )
    if run.sample_temperatures:
        data.batch["temperature"] = 0.5 + 0.1 * (torch.arange(B) % 6)
    else:
        data.meta_info["temperature"] = 0.7
    data.non_tensor_batch["uid"] = np.array([str(prompt) for prompt, *_ in rows], dtype=object)
    return data


# ---------------------------------------------------------------------------------------------- one rank


class Dispatch:
    """verl's nd dispatch without Ray: each rank gets its dp replica's chunk; the collect ranks' outputs come back,
    in dp order, on every rank (`call`)."""

    def __init__(self, engine: Any) -> None:
        self.dp, self.dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
        self.collect = engine.is_mp_src_rank_with_outputs()

    def call(self, method, td, meta: dict[str, Any], read) -> list[Any]:
        """``read(method(chunk), chunk)`` on each collect rank (``td`` chunked as verl's dispatch does, `meta` its
        non-tensor keys), gathered from every collect rank."""
        import torch.distributed as dist
        from verl.utils import tensordict_utils as tu

        chunk = tu.chunk_tensordict(td, self.dp)[self.dp_rank]
        tu.assign_non_tensor(chunk, **meta)
        out = method(chunk)
        mine = read(out, chunk) if self.collect else None
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return [x for x in everyone if x is not None]


def _padded(*keys: str):
    """A `Dispatch.call` read: the per-token outputs `keys` as ``[b, response length]`` (verl's driver's layout)."""
    def read(out, chunk):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        return {key: no_padding_2_padding(tu.get(out, key), chunk).float() for key in keys}
    return read


def _joined(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def _metrics(out, chunk) -> dict[str, Any]:
    from verl.utils import tensordict_utils as tu

    return {k: v for k, v in tu.get(out, "metrics").items() if not k.startswith("perf") and "mfu" not in k}


def build_workers(config, run: Run) -> dict[str, Any]:
    """verl's actor and reference workers (``ActorRolloutRefWorker``, roles ``actor`` and ``ref``) and, for GAE, its
    critic ``TrainingWorker`` with verl's value loss, as verl's trainer builds them."""
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import value_loss

    workers = {}
    for role in ("actor",) if run.ref_in_actor else ("ref", "actor"):
        worker = ActorRolloutRefWorker(config.actor_rollout_ref, role=role)
        worker.init_model()
        workers[role] = worker
    if run.critic:
        critic = omega_conf_to_dataclass(config.critic)
        engine = critic.engine
        engine.infer_max_token_len_per_gpu = critic.ppo_infer_max_token_len_per_gpu
        engine.max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
        engine.use_dynamic_bsz = critic.use_dynamic_bsz
        engine.micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu
        engine.infer_micro_batch_size_per_gpu = critic.forward_micro_batch_size_per_gpu
        worker = TrainingWorker(TrainingWorkerConfig(model_type="value_model", model_config=critic.model,
                                                     engine_config=engine, optimizer_config=critic.optim,
                                                     checkpoint_config=critic.checkpoint))
        worker.reset()
        worker.set_loss_fn(partial(value_loss, config=critic))
        workers["critic"] = worker
    return workers


def advantages(config, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` as verl's driver computes them (``ray_trainer.compute_advantage`` for GAE and GRPO,
    whose module imports verl's rollout servers: their calls, here)."""
    from verl.trainer.ppo import core_algos

    rewards, mask = batch.batch["token_level_rewards"], batch.batch["response_mask"]
    if config.algorithm.adv_estimator == "gae":
        return core_algos.compute_gae_advantage_return(token_level_rewards=rewards, values=batch.batch["values"],
                                                       response_mask=mask, gamma=config.algorithm.gamma,
                                                       lam=config.algorithm.lam)
    return core_algos.compute_grpo_outcome_advantage(token_level_rewards=rewards, response_mask=mask,
                                                     index=batch.non_tensor_batch["uid"],
                                                     norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo)


def ppo_step(config, run: Run, workers: dict[str, Any], step: int) -> dict[str, Any]:
    """One training step as verl's ``RayPPOTrainer.fit`` takes it: old log-probs and entropy, reference log-probs,
    values, advantages, the critic's update, the actor's update."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    actor = workers["actor"]
    dispatch = Dispatch(actor.actor.engine)
    batch = rollout_batch(run, step)

    def no_padding():
        return left_right_2_no_padding(batch.to_tensordict())

    old = _joined(dispatch.call(actor.compute_log_prob, no_padding(), dict(
        calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False), _padded("log_probs", "entropy")))
    out: dict[str, Any] = {"old_log_probs": old["log_probs"], "entropys": old["entropy"]}
    ref_meta = dict(calculate_entropy=False, compute_loss=False)
    if run.ref_in_actor:  # verl's driver: the actor with its adapters disabled
        ref = _joined(dispatch.call(actor.compute_log_prob, no_padding(), dict(ref_meta, no_lora_adapter=True),
                                    _padded("log_probs")))
    else:
        ref = _joined(dispatch.call(workers["ref"].compute_ref_log_prob, no_padding(), ref_meta, _padded("log_probs")))
    out["ref_log_prob"] = ref["log_probs"]
    fields = {"old_log_probs": out["old_log_probs"], "ref_log_prob": out["ref_log_prob"]}
    if run.critic:
        critic = workers["critic"]
        out["values"] = _joined(Dispatch(critic.engine).call(critic.infer_batch, no_padding(), dict(compute_loss=False),
                                                             _padded("values")))["values"]
        fields["values"] = out["values"]
    batch = batch.union(DataProto.from_single_dict(fields))
    batch.batch["advantages"], batch.batch["returns"] = advantages(config, batch)
    out["advantages"] = batch.batch["advantages"].clone()
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size * run.n
    keys = dict(global_batch_size=mini, mini_batch_size=mini, epochs=1, seed=42, dataloader_kwargs={"shuffle": False})
    if run.critic:
        out["critic"] = Dispatch(critic.engine).call(critic.train_mini_batch, no_padding(), keys, _metrics)[0]
    out["actor"] = dispatch.call(actor.update_actor, no_padding(), dict(
        keys, calculate_entropy=True, distillation_use_topk=False, distillation_only=False, compute_loss=True),
        _metrics)[0]
    return out


def trained_parameters(engine) -> dict[str, torch.Tensor]:
    """Every trained parameter of an engine's model (all of them; LoRA's adapters only), whole, float32 on CPU."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
    return out


def leak_probe(run: Run, actor) -> dict[str, Any]:
    """Log-probs of one batch, then of the same batch with one response token of sequence 1 changed: how much the
    other sequences' log-probs moved (bit for bit: 0), and sequence 1's before and from the change."""
    from verl.workers.utils.padding import left_right_2_no_padding

    dispatch = Dispatch(actor.actor.engine)
    batch = rollout_batch(run, 99)
    meta = dict(calculate_entropy=True, compute_loss=False)
    before = _joined(dispatch.call(actor.compute_log_prob, left_right_2_no_padding(batch.to_tensordict()), meta,
                                   _padded("log_probs")))["log_probs"]
    P = batch.batch["prompts"].shape[1]
    at = 1  # the second response token of sequence 1 (every response has at least 2)
    batch.batch["input_ids"][1, P + at] = (batch.batch["input_ids"][1, P + at] + 1) % 256 or 1
    batch.batch["responses"][1, at] = batch.batch["input_ids"][1, P + at]
    after = _joined(dispatch.call(actor.compute_log_prob, left_right_2_no_padding(batch.to_tensordict()), meta,
                                  _padded("log_probs")))["log_probs"]
    others = torch.ones(before.shape[0], dtype=torch.bool)
    others[1] = False
    mask = batch.batch["response_mask"].bool()
    moved = (after - before).abs()
    return {"elsewhere": float(moved[others][mask[others]].max()), "before_change": float(moved[1, :at].max()),
            "from_change": float(moved[1, at:][mask[1, at:]].max())}


def one_run(run: Run, root: str) -> dict[str, Any]:
    """`run` on this rank: verl's workers from its config, the steps, the final parameters, the probe."""
    if run.engine:
        os.environ["VERL_ENGINE_VENDOR"] = "blockdiag_cp"
    else:
        os.environ.pop("VERL_ENGINE_VENDOR", None)
    lm, value = model_paths(pathlib.Path(root), run.family)
    config = compose(run, lm, value)
    torch.manual_seed(0)  # what verl draws while it builds (LoRA's adapters): the same in every run
    if run.refused:
        try:
            build_workers(config, run)
        except (AssertionError, ValueError) as exc:
            return {"refused": f"{type(exc).__name__}: {exc}"}
        raise AssertionError(f"{run} was expected to be refused")
    workers = build_workers(config, run)
    with _recorded_shards() if run.engine else contextlib.nullcontext([]) as shards:
        out = _train(config, run, workers)
    if run.engine:
        out["shards"] = shards
    return out


def _train(config, run: Run, workers: dict[str, Any]) -> dict[str, Any]:
    """The steps, the parameters after each, the engines' names, the probe."""
    actor_engine = workers["actor"].actor.engine
    start = trained_parameters(actor_engine)
    out: dict[str, Any] = {"steps": []}
    for step in range(run.steps):
        out["steps"].append(ppo_step(config, run, workers, step))
        out["steps"][-1]["actor_params"] = trained_parameters(actor_engine)
    out["engines"] = {"actor": type(workers["actor"].actor.engine).__name__}
    if "ref" in workers:
        out["engines"]["ref"] = type(workers["ref"].ref.engine).__name__
    out["actor_params"] = out["steps"][-1]["actor_params"]
    out["actor_moved"] = max(float((p - start[name]).abs().max()) for name, p in out["actor_params"].items())
    if run.critic:
        out["engines"]["critic"] = type(workers["critic"].engine).__name__
        out["critic_params"] = trained_parameters(workers["critic"].engine)
    if run.probe:
        out["probe"] = leak_probe(run, workers["actor"])
    return out


@contextlib.contextmanager
def _recorded_shards():
    """``[(CP world, this rank's positions, the row's tokens)]`` of every micro-batch the engine shards in the block
    (its module's `shard_packed_row`, wrapped): CP that silently did nothing would show world 1."""
    import blockdiag_cp.integrations.verl as engine_module

    seen: list[tuple[int, int, int]] = []
    shard = engine_module.shard_packed_row

    def recorded(cp_mesh, cu_seqlens, model_inputs, output_args, config):
        ctx, inputs, args = shard(cp_mesh, cu_seqlens, model_inputs, output_args, config)
        seen.append((ctx.state.world, inputs["input_ids"].shape[1], model_inputs["input_ids"].shape[1]))
        return ctx, inputs, args

    engine_module.shard_packed_row = recorded
    try:
        yield seen
    finally:
        engine_module.shard_packed_row = shard


def worker(rank: int, world: int, runs: tuple[Run, ...], root: str) -> Optional[list[dict[str, Any]]]:
    """`runs` one after the other on this rank (launched by `blockdiag_cp.testing.spawn`: the gloo group is up);
    rank 0 returns what each left."""
    os.environ.update(ENV, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                      LOCAL_RANK="0")
    import verl_cpu

    verl_cpu.use_cpu_platform()
    results = [one_run(run, root) for run in runs]
    return results if rank == 0 else None


def launch(runs: tuple[Run, ...], root: pathlib.Path, timeout: float = 1800.0) -> list[dict[str, Any]]:
    """`runs` (all of one world size) in one launch of fresh gloo processes; rank 0's results, in order."""
    from blockdiag_cp.testing import spawn

    worlds = {run.world for run in runs}
    if len(worlds) != 1:
        raise ValueError(f"one launch runs one world size, got {sorted(worlds)}")
    for run in runs:
        write_model(root, run.family, value=run.critic)
    return spawn(worker, worlds.pop(), runs, str(root), timeout=timeout)[0]
