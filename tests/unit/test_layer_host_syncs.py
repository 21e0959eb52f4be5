"""Per layer, only the math: no host synchronisation in a layer call after the first.

On CPU a host sync is invisible, so the tests count the conversions that would be one
on a GPU (`.item()`, `.tolist()`, `bool()` of a tensor, `.cpu()`, `nonzero`, ...),
through a torch-function mode, during every layer's forward and backward after the
first layer's. tests/gpu/test_cuda_kernels.py runs the same on CUDA under
``torch.cuda.set_sync_debug_mode("error")``.
"""

import pytest
import torch

from blockdiag_cp import CPConfig, HeadsConfig, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from blockdiag_cp.testing import count_host_syncs, doc_ids_from_lengths

SEGMENTS = (9, 3, -2, 17, 1, 6, 5, -3, 11)
LAYERS = 4


def layer_inputs(S, layers, H=4, Hk=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, S, (H + 2 * Hk) * D, generator=g, dtype=torch.float64) for _ in range(layers)]


def split_heads(x, H=4, Hk=2, D=8):
    q, k, v = x.split([H * D, Hk * D, Hk * D], dim=-1)
    return tuple(t.reshape(1, t.shape[1], -1, D).transpose(1, 2) for t in (q, k, v))


def run_layers(mesh, exchange, kernel, layout, ulysses=1):
    """Forward and backward of LAYERS attention layers; conversions counted after the first layer's forward."""
    ids = doc_ids_from_lengths(SEGMENTS).unsqueeze(0)
    xs = [x.requires_grad_(True) for x in layer_inputs(ids.shape[1], LAYERS)]
    batch = {"inputs_embeds": torch.cat(xs, dim=-1), "_packed_seq_ids": ids}
    config = CPConfig(kv_exchange=exchange, kernel=kernel, layout=layout, heads=HeadsConfig(ulysses_degree=ulysses))
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, config=config)
    layers = batch["inputs_embeds"].split(xs[0].shape[-1], dim=-1)
    with train_ctx() as state:
        first = cp_blockdiag_sdpa(*split_heads(layers[0]), enable_gqa=True)
        with count_host_syncs() as counter:
            outs = [cp_blockdiag_sdpa(*split_heads(x), enable_gqa=True) for x in layers[1:]]
            (first.sum() + sum(o.square().sum() for o in outs)).backward()
    return counter.calls, state.exchange.name


def layer_worker(rank, world, combos):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    return {combo: run_layers(mesh, *combo) for combo in combos}


COMBOS = [(ex, kernel, layout) for ex in ("allgather", "halo", "a2a", "ring", "auto")
          for kernel in ("sdpa", "dense") for layout in ("contiguous", "balanced")]


def test_counter_sees_every_kind_of_host_sync():
    t = torch.ones(4)
    with count_host_syncs() as counter:
        bool(t[0])
        t.sum().item()
        t.tolist()
        t.cpu()
        int(t[1])
        torch.nonzero(t)
        torch.equal(t, t)
    assert [name for name, _ in counter.calls] == ["__bool__", "item", "tolist", "cpu", "__int__", "nonzero", "equal"]


#: head-parallel (world 4): degree 2 (hybrid) and 4 (pure Ulysses, K/V heads repeated)
HEAD_PARALLEL = [(ex, kernel, layout, u) for u in (2, 4) for ex in ("a2a", "ring", "allgather", "auto")
                 for kernel in ("sdpa", "dense") for layout in ("contiguous", "balanced")]


@pytest.mark.parametrize("world", [1, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_layer_calls_after_the_first_make_no_host_sync(world, rank_pools):
    if world == 1:
        results = [{combo: run_layers(None, *combo) for combo in COMBOS if combo[0] == "auto"}]
    else:
        results = rank_pools(world).run(layer_worker, COMBOS if world == 3 else HEAD_PARALLEL)
    for per_rank in results:
        for combo, (calls, ran) in per_rank.items():
            assert calls == [], (combo, ran, calls[:5])


def test_transformers_plans_once_per_forward_outside_a_step():
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import blockdiag_cp.hf as bhf

    counted = {"layers": 0, "syncs": []}

    def counting_attention(module, *args, **kwargs):
        counted["layers"] += 1
        if counted["layers"] == 1:
            return bhf.blockdiag_cp_attention(module, *args, **kwargs)
        with count_host_syncs() as counter:
            out = bhf.blockdiag_cp_attention(module, *args, **kwargs)
        counted["syncs"] += counter.calls
        return out

    AttentionInterface.register("blockdiag_cp_counted", counting_attention)
    AttentionMaskInterface.register("blockdiag_cp_counted", bhf.blockdiag_cp_mask)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      attn_implementation="blockdiag_cp_counted")
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    lengths = (7, 12, 5, 9)
    ids = torch.randint(0, 50, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model(input_ids=ids, position_ids=pos, use_cache=False).logits.sum().backward()
    assert counted["layers"] == 4
    assert counted["syncs"] == []
