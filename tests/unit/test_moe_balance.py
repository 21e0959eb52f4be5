"""The router's load-balancing loss from per-shard statistics equals each verified family's own loss
on the unsharded rows (Note [The router's load-balancing loss under CP] in hf/moe.py).

Per family: a tiny model's forward on padded rows with ``output_router_logits=True`` gives
transformers' ``aux_loss`` and ``loss``; the statistics of three pieces of the rows (padding
weighted 0), summed, give the same ``aux``, and ``loss`` is the causal-LM loss plus ``coef * aux``
with the settings `balance_settings` reads. On two gloo ranks, the sum over the CP group and its
backward give the value and gradients of the loss on the whole row.
"""

import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from blockdiag_cp.hf.moe import SWITCH_BALANCE, balance_loss, balance_settings, balance_statistics  # noqa: E402
from blockdiag_cp.loss import replicated_sum  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts=4,
             num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.3, aux_loss_coef=0.3,
             max_position_embeddings=128, shared_expert_intermediate_size=16, decoder_sparse_step=1,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny(model_type: str):
    config_class = type(transformers.AutoConfig.for_model(model_type))
    names = set(config_class().to_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**{k: v for k, v in SMALL.items() if k in names})
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def rows():
    """Two right-padded rows: ids [2, 20], attention_mask, labels (-100 on padding)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


#: families checked in the fast loop (each further family imports its modeling module: the slow set)
FAST_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss")


@pytest.mark.parametrize("model_type", [t if t in FAST_FAMILIES else pytest.param(t, marks=pytest.mark.slow)
                                        for t in sorted(SWITCH_BALANCE)])
def test_shard_statistics_give_each_familys_own_loss(model_type):
    model = tiny(model_type)
    experts, top_k, coef = balance_settings(model, "here")
    ids, mask, labels = rows()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True, use_cache=False)
    weights = mask.reshape(-1)
    pieces = [(0, 11), (11, 27), (27, 40)]  # three "shards" of the 40 flattened rows, padding inside the last
    stats = sum(balance_statistics([r[a:b] for r in out.router_logits], weights[a:b], experts, top_k) for a, b in pieces)
    torch.testing.assert_close(balance_loss(stats, experts), out.aux_loss.float(), rtol=1e-6, atol=1e-7)
    from transformers.loss.loss_utils import ForCausalLMLoss

    ce = ForCausalLMLoss(out.logits, labels, model.config.get_text_config().vocab_size)
    torch.testing.assert_close(out.loss, ce + coef * out.aux_loss, rtol=1e-6, atol=1e-7)


def test_an_unverified_family_is_refused_by_name():
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="doge"))
    with pytest.raises(ValueError, match=r"\(doge\) computes a router load-balancing loss.*output_router_logits=False"):
        balance_settings(model, "in the test")


class Wrapper(torch.nn.Module):
    """What a PEFT wrapper looks like to `RouterBalance`: the causal-LM model inside, its forward delegated."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def get_base_model(self):
        return self.inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_the_hooks_replace_the_loss_by_the_rows_and_find_the_model_inside_a_wrapper():
    """One rank (no group), the router loss counted once (share 1), rows without an attention mask (as the
    mixin passes them): the outputs the model gives with the mask, where the padding is left out."""
    from blockdiag_cp.hf.moe import BalanceStep, RouterBalance

    model = tiny("mixtral")
    ids, mask, labels = rows()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    step = BalanceStep(mask.reshape(-1), None, 1.0)
    wrapper = Wrapper(model)
    RouterBalance(wrapper, lambda: step, "here").install()
    unmasked = dict(input_ids=ids, labels=labels, output_router_logits=True)  # as under CP: no attention_mask
    with torch.no_grad():
        got = wrapper(**unmasked)
        alone = model.__class__.forward(model, **unmasked)  # the forward without the hooks
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-7)
    assert abs(float(alone.aux_loss - want.aux_loss)) > 1e-4  # the padding did count without the hooks
    coef = model.router_aux_loss_coef
    torch.testing.assert_close(got.loss - coef * got.aux_loss, alone.loss - coef * alone.aux_loss, rtol=1e-6, atol=1e-6)


def shard_worker(rank, world):
    """Each rank's shard of one row's router logits: the replica's loss and its gradients, under CP."""
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(10, 4, generator=g, dtype=torch.float64) for _ in range(2)]  # 2 layers, 10 rows
    weights = torch.ones(10)
    weights[8:] = 0  # the CP row's padding
    local = [t[rank * 5:(rank + 1) * 5].clone().requires_grad_() for t in logits]
    stats = balance_statistics(local, weights[rank * 5:(rank + 1) * 5], 4, 2)
    aux = balance_loss(replicated_sum(stats, torch.distributed.group.WORLD), 4)  # the CP group: both ranks
    (aux / world).backward()  # each rank's share: the gradients add up to one replica's
    return aux.detach(), [t.grad for t in local]


def test_the_sum_over_the_cp_group_gives_the_unsharded_value_and_gradients(rank_pools):
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(10, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2)]
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    mask = torch.ones(1, 10)
    mask[0, 8:] = 0
    want = load_balancing_loss_func(tuple(full), 4, 2, mask)
    want.backward()
    results = rank_pools(2).run(shard_worker)
    for aux, _ in results:
        torch.testing.assert_close(aux, want.detach(), rtol=1e-6, atol=1e-8)  # float32 sums, as transformers'
    for layer in range(2):
        grad = torch.cat([grads[layer] for _, grads in results])
        torch.testing.assert_close(grad, full[layer].grad, rtol=1e-5, atol=1e-8)
