"""make_cp_blockdiag_batch_and_ctx: padding, sharding of every sequence-aligned key, plan agreement."""

import pytest
import torch

from blockdiag_cp import CPConfig, make_cp_batch_and_ctx, make_cp_blockdiag_batch_and_ctx, plan_shards
from blockdiag_cp.testing import doc_ids_from_lengths

SEGMENTS = (5, -2, 9, 1, 3, -1)  # S = 21: not a multiple of 2, 3, 4 or 5


def full_batch(S=21, mrope=False, with_positions=True):
    gen = torch.Generator().manual_seed(0)
    doc = doc_ids_from_lengths(SEGMENTS).unsqueeze(0)
    batch = {
        "input_ids": torch.randint(1, 100, (1, S), generator=gen),
        "labels": torch.randint(1, 100, (1, S), generator=gen),
        "_packed_seq_ids": doc,
        "attention_mask": torch.ones(1, S, dtype=torch.long),
        "cu_seq_lens_q": torch.tensor([0, 5]),
        "max_length_q": 9,
    }
    if with_positions:
        pos = torch.arange(S).unsqueeze(0)
        batch["position_ids"] = torch.stack([pos, pos + 100, pos + 200]) if mrope else pos
    return batch


FILLS = {"input_ids": 7, "labels": -100, "_packed_seq_ids": 0, "loss_mask": 0, "position_ids": 0}


def expected_shard(full, positions, fill, seq_dim=1):
    pad = positions.max().item() + 1 - full.shape[seq_dim]
    if pad > 0:
        shape = list(full.shape)
        shape[seq_dim] = pad
        full = torch.cat([full, torch.full(shape, fill, dtype=full.dtype)], dim=seq_dim)
    return full.index_select(seq_dim, positions)


def shard_worker(rank, world, layout, mrope):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    batch = full_batch(mrope=mrope)
    loss_mask = torch.ones(1, 21, dtype=torch.long)
    _, out = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, loss_mask=loss_mask, padding_token_id=7,
                                             config=CPConfig(layout=layout))
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}, sorted(out)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("world,mrope", [(3, False), (4, True)])
def test_every_rank_gets_exactly_its_planned_positions(world, layout, mrope, rank_pools):
    shards = rank_pools(world).run(shard_worker, layout, mrope)
    full = full_batch(mrope=mrope)
    plan = plan_shards(full["_packed_seq_ids"], world, layout)
    assert plan.padded_len % world == 0 and plan.padded_len - 21 < world
    for rank, (got, keys) in enumerate(shards):
        pos = plan.rank_positions(rank)
        assert "attention_mask" not in keys and "cu_seq_lens_q" not in keys and "max_length_q" not in keys
        for key, fill in FILLS.items():
            source = full[key] if key != "loss_mask" else torch.ones(1, 21, dtype=torch.long)
            dim = 2 if (key == "position_ids" and mrope) else 1
            assert torch.equal(got[key], expected_shard(source, pos, fill, dim)), (rank, key)
        doc = expected_shard(full["_packed_seq_ids"], pos, 0)
        assert torch.equal(got["padding_mask"], doc == 0)


def test_world_one_without_mesh_adds_positions_and_padding_mask():
    batch = full_batch(with_positions=False)
    train_ctx, out = make_cp_blockdiag_batch_and_ctx(None, None, batch)
    assert torch.equal(out["position_ids"], torch.arange(21).unsqueeze(0))
    assert torch.equal(out["padding_mask"], doc_ids_from_lengths(SEGMENTS).unsqueeze(0) == 0)
    state = train_ctx.state  # the planned step (entered, it must serve a model: Note [A step the model never reached])
    assert state.world == 1 and state.exchange.name == "local"


def test_inputs_embeds_slice_is_differentiable_to_the_full_tensor():
    x = torch.randn(1, 21, 6, requires_grad=True)
    batch = {"inputs_embeds": x, "_packed_seq_ids": doc_ids_from_lengths(SEGMENTS).unsqueeze(0)}
    _, out = make_cp_blockdiag_batch_and_ctx(None, None, batch)
    out["inputs_embeds"].sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_generic_entry_honours_model_hook():
    calls = []

    def hook(cp_mesh, tp_mesh, batch, **kw):
        calls.append((cp_mesh, tp_mesh, sorted(batch), kw))
        return "ctx", batch

    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "_cp_make_batch_fn": hook}
    assert make_cp_batch_and_ctx("mesh", "tp", batch, padding_token_id=3)[0] == "ctx"
    assert calls == [("mesh", "tp", ["input_ids"], {"padding_token_id": 3})]


def test_generic_entry_without_hook_runs_block_diagonal_path():
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    train_ctx, out = make_cp_batch_and_ctx(None, None, batch)
    assert train_ctx.state.plan.layout == "contiguous"
    assert "padding_mask" in out


def test_extra_sequence_keys_are_sharded_and_unknown_ones_warned():
    """Gemma 3n-style per-layer inputs shard on the dim seq_dims names; an unknown length-S tensor warns."""
    S = 10
    per_layer = torch.arange(S * 3 * 2, dtype=torch.float32).reshape(1, S, 3, 2)
    batch = {"input_ids": torch.ones(1, S, dtype=torch.long), "_packed_seq_ids": torch.tensor([1] * 6 + [2] * 4),
             "per_layer_inputs": per_layer, "mystery": torch.zeros(4, S)}
    with pytest.warns(UserWarning, match="'mystery'.*seq_dims=\\{'mystery': 1\\}"):
        _, out = make_cp_blockdiag_batch_and_ctx(None, None, batch, seq_dims={"per_layer_inputs": 1})
    assert torch.equal(out["per_layer_inputs"], per_layer)  # world 1: all positions, padded to S
    assert out["_packed_seq_ids"].tolist() == [[1] * 6 + [2] * 4]  # [S] accepted like [1, S]
    with pytest.raises(ValueError, match="seq_dims"):
        make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.ones(1, S, dtype=torch.long),
                                                     "x": torch.zeros(1, 3)}, seq_dims={"x": 1})


def seq_dims_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    per_layer = torch.arange(21 * 3, dtype=torch.float32).reshape(1, 21, 3)
    batch = {"input_ids": torch.ones(1, 21, dtype=torch.long), "per_layer_inputs": per_layer,
             "_packed_seq_ids": doc_ids_from_lengths(SEGMENTS)}
    _, out = make_cp_blockdiag_batch_and_ctx(mesh["cp"], None, batch, seq_dims={"per_layer_inputs": 1},
                                             config=CPConfig(layout="balanced"))
    return out["per_layer_inputs"]


def test_extra_sequence_keys_follow_the_plan_on_every_rank(rank_pools):
    shards = rank_pools(3).run(seq_dims_worker)
    plan = plan_shards(doc_ids_from_lengths(SEGMENTS), 3, "balanced")
    full = torch.cat([torch.arange(21 * 3, dtype=torch.float32).reshape(1, 21, 3), torch.zeros(1, plan.padded_len - 21, 3)], 1)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, full[:, plan.rank_positions(rank)])
