"""One torchtitan run for tests/stacks/test_torchtitan.py, launched by torchrun on CPU gloo ranks.

    torchrun --nproc-per-node W tests/stacks/torchtitan_run.py OUT.pt PROBE_DATA --module CFG --config FN [--k V ...]
    (PROBE_DATA "-": no probe, e.g. a run resumed from a checkpoint)

The run is torchtitan's own: its ConfigManager parses the config_registry function and the CLI overrides, its
``config.build()`` makes the `BlockDiagCPTrainer`, ``trainer.train()`` trains. Around it this script records,
for the test only: each step's logged loss and grad norm at full precision (the console prints 5 digits), the
gradients' own norm in float64, n_tokens_seen, each validation's eval loss, the per-token losses of the first
micro-batch at the initial weights, of the run's dataset and of PROBE_DATA (the leak probe: the rows read by a
fresh copy of the trainer's own dataloader, sharded by the trainer's own ``post_dataloading_process``, the model
run in its step, the shard's losses gathered to the row), each step's expert loads of a MoE model (the tokens
routed to each expert, summed over the data ranks) and the final parameters and expert biases, gathered whole.
Under torchtitan's pipeline (no probe: its stages are on other ranks) each rank records its stages' parameters,
expert loads and biases, and the losses come from a rank holding the last stage. Rank 0 merges and saves them.

The initial weights are set here, the same full tensors at every world size (`same_initial_weights`): on CPU,
DTensor's random initialization is not single-device consistent (each rank draws its shard from the same local
stream), so torchtitan's own init differs between one rank and two.
"""

import dataclasses
import sys
import zlib

from blockdiag_cp.integrations.torchtitan_cpu import use_cpu_device

use_cpu_device()  # before torchtitan's trainer is imported (it copies the device choice when it loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

from blockdiag_cp import gather_sequence  # noqa: E402


def same_initial_weights(model: torch.nn.Module) -> None:
    """Every parameter from a generator seeded by its name: norms 1, the rest N(0, 0.02^2), whatever the sharding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            if "norm" in name:
                full = torch.ones(p.shape)
            else:
                full = torch.randn(p.shape, generator=g) * 0.02
            full = full.to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements)
            p.copy_(full)


def probe_row_nll(trainer, data_path: str) -> dict:
    """Per-token losses ``[S]`` of the first micro-batch of `data_path` (its rows laid end to end, as the trainer
    lays them) at the current weights, its doc ids, labels and inputs."""
    from blockdiag_cp.integrations.torchtitan_rows import one_packed_row

    config = trainer.config
    rows_config = dataclasses.replace(config.dataloader, rows=dataclasses.replace(config.dataloader.rows,
                                                                                 dataset_path=data_path))
    dims = trainer.parallel_dims  # torchtitan's data ranks, as its trainer builds the dataloader
    ranks, rank = (dims.get_mesh("batch").size(), dims.get_mesh("batch").get_local_rank()) if dims.dp_enabled else (1, 0)
    rows = rows_config.build(dp_world_size=ranks, dp_rank=rank,
                             tokenizer=trainer.tokenizer, seq_len=config.training.seq_len,
                             local_batch_size=config.training.local_batch_size)
    input_dict, labels = next(iter(rows))
    row = one_packed_row(input_dict, labels)
    on_device = {k: v.to(trainer.device) for k, v in input_dict.items()}  # as torchtitan's train_step moves them
    inputs, local_labels, kwargs = trainer.post_dataloading_process(on_device, labels.to(trainer.device))
    step, trainer.cp_step = trainer.cp_step, None
    model = trainer.model_parts[0]
    with torch.no_grad(), trainer.train_context(), step():
        out = model(inputs, **kwargs)
        logits = model.lm_head(out) if model._skip_lm_head else out
        if isinstance(logits, DTensor):  # TP's loss-parallel logits, sharded over the vocabulary
            logits = logits.full_tensor()
        nll_L = F.cross_entropy(logits[0].float(), local_labels[0], ignore_index=-100, reduction="none")
        nll_S = gather_sequence(nll_L[None], seq_dim=1)[0]
    S = row["input_ids"].shape[1]
    return {"nll": nll_S[:S].cpu(), "doc_ids": row["_packed_seq_ids"][0], "labels": row["labels"][0],
            "inputs": row["input_ids"][0]}


def record_exact_grad_norms(record: dict) -> None:
    """Record each step's gradient norm computed in float64 from the whole gradients (every pipeline stage's),
    before torchtitan clips.

    The test checks the logged norm against it: torch's float32 norm of each rank's shards is off by ~1e-5 on
    CPU, by an amount that depends on how the gradients are sharded (Note [Gradient norms on CPU]).
    """
    import torchtitan.distributed.utils as titan_dist

    clip = titan_dist.clip_grad_norm_

    def clip_recording(parameters, *args, **kwargs):
        parameters = list(parameters)
        squares = torch.tensor(sum(float((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).double()
                                         .pow(2).sum()) for p in parameters if p.grad is not None), dtype=torch.float64)
        if kwargs.get("pp_mesh") is not None:  # this rank's stages: sum over the pipeline
            dist.all_reduce(squares, group=kwargs["pp_mesh"].get_group())
        record["exact_grad_norms"].append(float(squares) ** 0.5)
        return clip(parameters, *args, **kwargs)

    titan_dist.clip_grad_norm_ = clip_recording


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def record_expert_loads(trainer, record: dict) -> None:
    """Record, before each optimizer step (before torchtitan's load-balancing hook reads and zeroes them), every MoE
    layer's ``tokens_per_expert_E`` of this rank's stages, summed over the data ranks as torchtitan sums them:
    ``{layer name: [E]}`` per step (`merged` stacks every stage's, by name)."""
    moes = {name: m for part in trainer.model_parts for name, m in part.named_modules()
            if hasattr(m, "tokens_per_expert_E")}
    if not moes:
        return
    dims, step = trainer.parallel_dims, trainer.optimizers.step

    def recording_step(*args, **kwargs):
        loads = torch.stack([local(m.tokens_per_expert_E) for m in moes.values()]).clone()
        if dims.dp_enabled:
            dist.all_reduce(loads, group=dims.get_mesh("batch").get_group())
        record["expert_loads"].append(dict(zip(moes, loads.cpu())))
        return step(*args, **kwargs)

    trainer.optimizers.step = recording_step


def forget_probe_expert_loads(model: torch.nn.Module) -> None:
    """The probes' forwards ran in training mode: torchtitan's MoE layers counted their tokens."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "tokens_per_expert_E"):
                local(module.tokens_per_expert_E).zero_()


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def merged(records: list[dict]) -> dict:
    """Every rank's record as one: a last pipeline stage's logged values, every stage's parameters, expert loads
    (``[layers, E]`` per step, layers by name) and biases."""
    record = next(r for r in records if r["last_stage"])
    for key in ("params", "expert_biases"):
        record[key] = {name: t for r in records for name, t in r[key].items()}
    loads = [{name: t for r in records if r["expert_loads"] for name, t in r["expert_loads"][i].items()}
             for i in range(max(len(r["expert_loads"]) for r in records))]
    record["expert_loads"] = [torch.stack([step[name] for name in sorted(step)]) for step in loads]
    return record


def main() -> None:
    out_path, probe_data, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    config = ConfigManager().parse_args(argv)
    trainer = config.build()
    for part in trainer.model_parts:
        same_initial_weights(part)
    record = {"losses": [], "grad_norms": [], "exact_grad_norms": [], "tokens_seen": [], "steps": [], "eval_losses": {},
              "expert_loads": []}
    record_exact_grad_norms(record)
    if probe_data != "-" and hasattr(trainer, "cp_step"):  # torchtitan's own Trainer has no step to probe in
        record["probe"] = probe_row_nll(trainer, config.dataloader.dataset_path)
        record["probe_other"] = probe_row_nll(trainer, probe_data)
        trainer.ntokens_seen = 0  # the probes went through the trainer's post_dataloading_process
        forget_probe_expert_loads(trainer.model_parts[0])
    record_expert_loads(trainer, record)
    log, log_validation = trainer.metrics_processor.log, trainer.metrics_processor.log_validation

    def recording_log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs):
        record["steps"].append(step)
        record["losses"].append(float(global_avg_loss))
        record["grad_norms"].append(float(grad_norm))
        record["tokens_seen"].append(int(kwargs["extra_metrics"]["n_tokens_seen"]))
        return log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs)

    def recording_log_validation(loss, step, **kwargs):
        record["eval_losses"][step] = float(loss)
        return log_validation(loss=loss, step=step, **kwargs)

    trainer.metrics_processor.log = recording_log
    trainer.metrics_processor.log_validation = recording_log_validation
    trainer.train()
    record["dynamo"] = {key: dict(value) for key, value in torch._dynamo.utils.counters.items()}
    parts = trainer.model_parts
    record["params"] = {name: whole(p) for part in parts for name, p in part.named_parameters()}
    record["expert_biases"] = {name: whole(b) for part in parts for name, b in part.named_buffers()
                               if name.endswith("expert_bias_E")}
    record["world"] = dist.get_world_size()
    record["cp_degree"] = getattr(trainer, "cp_degree", None)
    dims = trainer.parallel_dims
    record["mesh"] = {"batch": dims.get_mesh("batch").size() if dims.dp_enabled else 1,
                      "fsdp": dims.get_mesh("fsdp").size(), "tp": dims.tp, "pp": dims.pp}
    record["last_stage"] = not dims.pp_enabled or trainer.pp_has_last_stage
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        torch.save(merged(records), out_path)
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
