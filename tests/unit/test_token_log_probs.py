"""`loss.token_log_probs` token by token against an independent computation (a float64 logsumexp per
position, no shared code): the picked log-probability and the entropy where a target exists, exact zeros
(values and gradients) where it is -100, the temperature dividing the logits, float32 from half logits."""

import math

import pytest
import torch

from blockdiag_cp.loss import IGNORE_INDEX, token_log_probs

L, V = 9, 7


def logits_and_targets(dtype=torch.float64):
    g = torch.Generator().manual_seed(11)
    logits = (3 * torch.randn(1, L, V, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, V, (1, L), generator=g)
    targets[0, [0, 4, 5, L - 1]] = IGNORE_INDEX  # ignored positions at both ends and in the middle
    targets[0, 2], targets[0, 3] = 0, V - 1  # the first and last token ids are targets like any other
    return logits, targets


def per_token(logits_LV, targets_L, temperature):
    """``(log_prob, entropy)`` lists, one position at a time in float64 (None where ignored)."""
    logp, entropy = [], []
    for row, target in zip(logits_LV.double().tolist(), targets_L.tolist()):
        z = [x / temperature for x in row]
        top = max(z)
        lse = top + math.log(sum(math.exp(x - top) for x in z))
        if target == IGNORE_INDEX:
            logp.append(None)
            entropy.append(None)
            continue
        logp.append(z[target] - lse)
        entropy.append(-sum(math.exp(x - lse) * (x - lse) for x in z))
    return logp, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropies_per_token_with_exact_zeros_where_ignored(temperature):
    logits, targets = logits_and_targets()
    logits.requires_grad_(True)
    logp, entropy = token_log_probs(logits, targets, temperature=temperature, with_entropy=True)
    want_logp, want_entropy = per_token(logits[0].detach(), targets[0], temperature)
    assert logp.shape == entropy.shape == (1, L) and logp.dtype == entropy.dtype == torch.float64
    for t in range(L):
        if want_logp[t] is None:
            assert logp[0, t].item() == 0.0 and entropy[0, t].item() == 0.0, (t, logp[0, t], entropy[0, t])
        else:
            assert abs(logp[0, t].item() - want_logp[t]) < 1e-12, t
            assert abs(entropy[0, t].item() - want_entropy[t]) < 1e-12, t
    # nothing flows back into an ignored position's logits, from either output
    (logp.sum() + entropy.sum()).backward()
    ignored = targets[0] == IGNORE_INDEX
    assert torch.equal(logits.grad[0, ignored], torch.zeros(int(ignored.sum()), V, dtype=torch.float64))
    assert bool((logits.grad[0, ~ignored].abs().sum(-1) > 0).all())
    # both outputs differentiate as their values do (finite differences), the entropy too
    assert logp.requires_grad and entropy.requires_grad
    assert torch.autograd.gradcheck(
        lambda x: token_log_probs(x, targets, temperature=temperature, with_entropy=True), (logits.detach().requires_grad_(),))
    # without entropy: the same log-probs, and None
    alone, none = token_log_probs(logits.detach(), targets, temperature=temperature)
    assert none is None and torch.equal(alone, logp.detach())


def test_half_precision_logits_are_computed_in_float32():
    logits, targets = logits_and_targets(torch.bfloat16)
    logp, entropy = token_log_probs(logits, targets, with_entropy=True)
    assert logp.dtype == entropy.dtype == torch.float32
    want_logp, want_entropy = per_token(logits[0].float(), targets[0], 1.0)
    for t in range(L):
        if want_logp[t] is not None:
            assert abs(logp[0, t].item() - want_logp[t]) < 1e-5 and abs(entropy[0, t].item() - want_entropy[t]) < 1e-5
