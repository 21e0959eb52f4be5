"""One torchtitan run for tests/stacks/test_torchtitan.py, launched by torchrun on CPU gloo ranks.

    torchrun --nproc-per-node W tests/stacks/torchtitan_run.py OUT.pt PROBE_DATA --module CFG --config FN [--k V ...]

The run is torchtitan's own: its ConfigManager parses the config_registry function and the CLI overrides, its
``config.build()`` makes the `BlockDiagCPTrainer`, ``trainer.train()`` trains. Around it this script records,
for the test only: each step's logged loss and grad norm at full precision (the console prints 5 digits), the
per-token losses of the first packed row at the initial weights, of the run's dataset and of PROBE_DATA (the leak
probe: the row read by a fresh copy of the trainer's own dataloader, sharded by the trainer's own
``post_dataloading_process``, the model run in its step, the shard's losses gathered to the row), and the final
parameters, gathered whole. Rank 0 saves them.

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


def record_logged(trainer, record: dict) -> None:
    """Append each logged step's loss and grad norm, at full precision, to ``record["losses"]`` and
    ``record["grad_norms"]`` (the console prints 5 digits)."""
    log = trainer.metrics_processor.log

    def recording_log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs):
        record["losses"].append(float(global_avg_loss))
        record["grad_norms"].append(float(grad_norm))
        return log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs)

    trainer.metrics_processor.log = recording_log


def probe_row_nll(trainer, data_path: str) -> dict:
    """Per-token losses ``[S]`` of the first row of `data_path` at the current weights, its doc ids and labels."""
    config = trainer.config
    rows_config = dataclasses.replace(config.dataloader, rows=dataclasses.replace(config.dataloader.rows,
                                                                                 dataset_path=data_path))
    rows = rows_config.build(dp_world_size=dist.get_world_size(), dp_rank=dist.get_rank(),
                                   tokenizer=trainer.tokenizer, seq_len=config.training.seq_len,
                                   local_batch_size=config.training.local_batch_size)
    input_dict, labels = next(iter(rows))
    from blockdiag_cp.integrations.torchtitan import doc_ids_from_positions

    doc_ids = doc_ids_from_positions(input_dict["positions"])[0]
    on_device = {k: v.to(trainer.device) for k, v in input_dict.items()}  # as torchtitan's train_step moves them
    inputs, local_labels, kwargs = trainer.post_dataloading_process(on_device, labels.to(trainer.device))
    step, trainer.cp_step = trainer.cp_step, None
    model = trainer.model_parts[0]
    with torch.no_grad(), step():
        out = model(inputs, **kwargs)
        logits = model.lm_head(out) if model._skip_lm_head else out
        nll_L = F.cross_entropy(logits[0].float(), local_labels[0], ignore_index=-100, reduction="none")
        nll_S = gather_sequence(nll_L[None], seq_dim=1)[0]
    return {"nll": nll_S.cpu(), "doc_ids": doc_ids, "labels": labels[0], "inputs": input_dict["input"][0]}


def main() -> None:
    out_path, probe_data, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    config = ConfigManager().parse_args(argv)
    trainer = config.build()
    same_initial_weights(trainer.model_parts[0])
    record = {"losses": [], "grad_norms": []}
    if hasattr(trainer, "cp_step"):  # a BlockDiagCPTrainer (torchtitan's own Trainer has no step to probe in)
        record["probe"] = probe_row_nll(trainer, config.dataloader.dataset_path)
        record["probe_other"] = probe_row_nll(trainer, probe_data)
    record_logged(trainer, record)
    trainer.train()
    params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
              for name, p in trainer.model_parts[0].named_parameters()}
    record["params"] = params
    record["world"] = dist.get_world_size()
    record["cp_degree"] = getattr(trainer, "cp_degree", None)
    if dist.get_rank() == 0:
        torch.save(record, out_path)
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
