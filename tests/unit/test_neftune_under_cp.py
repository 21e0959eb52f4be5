"""NEFTune under CP: every rank adds, at each of its positions, the noise the run without CP adds to that
token (Note [NEFTune under CP] in hf/neftune.py): same values, same scale, on every layout, and the
generator ends where the run without CP leaves it."""

import pytest
import torch

from blockdiag_cp import plan_shards
from blockdiag_cp.hf.neftune import NeftuneUnderCP, NoiseRows


class Embedding(torch.nn.Module):
    """Stands in for the model's input embeddings: the hook only reads `training` and the output."""

    training = True


def without_cp(rows, E, alpha, seed):
    """transformers' hook on the collator's ``[B, S, E]`` embeddings (zeros: the output is the noise)."""
    torch.manual_seed(seed)
    B, S = rows
    noise = NeftuneUnderCP(alpha, lambda: None)(Embedding(), (), torch.zeros(B, S, E, dtype=torch.float64))
    return noise, torch.get_rng_state()


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("world, rows", [(2, (3, 7)), (3, (1, 20)), (4, (2, 9))])
def test_each_rank_adds_the_noise_of_its_tokens_without_cp(layout, world, rows):
    B, S, E, alpha = *rows, 4, 5.0
    want, rng_after = without_cp(rows, E, alpha, seed=7)
    doc_ids = torch.repeat_interleave(torch.arange(1, B + 1), S)[None]  # each collator row its own document
    plan = plan_shards(doc_ids, world, layout)
    got = torch.full((plan.padded_len, E), float("nan"), dtype=torch.float64)
    for rank in range(world):
        torch.manual_seed(7)
        positions = plan.rank_positions(rank)
        where = NoiseRows(rows, positions, plan.padded_len)
        local = NeftuneUnderCP(alpha, lambda: where)(Embedding(), (), torch.zeros(1, plan.local_len, E,
                                                                                  dtype=torch.float64))
        got[positions] = local[0]
        assert torch.equal(torch.get_rng_state(), rng_after), "the generator must end where it does without CP"
    torch.testing.assert_close(got[: B * S], want.reshape(B * S, E), rtol=0, atol=0)
    assert bool((got[B * S:] == 0).all()), "the CP row's padding gets no noise"
    bound = alpha / (S * E) ** 0.5
    assert float(want.abs().max()) <= bound and float(want.abs().max()) > 0.5 * bound  # the scale of the rows


def test_no_noise_in_evaluation():
    embedding = Embedding()
    embedding.training = False
    out = torch.zeros(1, 5, 3)
    assert NeftuneUnderCP(5.0, lambda: None)(embedding, (), out) is out
