"""`step.linear_ce` against the plain path on logits, in float64: the cross-entropy sum (with and without
transformers' label smoothing, as `hf.losses.smoothing_sums` computes it for the mixin), the per-token
log-probs (`loss.token_log_probs`), the gradients of the hidden states, the head and its bias; -100 targets
count nowhere; torch's chunked path always (its fallback warns, and warnings are errors here); refusals
by name; and a fresh process's peak memory far below the logits it never builds."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from blockdiag_cp.hf.losses import smoothing_sums
from blockdiag_cp.loss import IGNORE_INDEX, token_log_probs
from blockdiag_cp.step.linear_ce import linear_ce_sum, linear_token_log_probs

L, H, V = 23, 6, 41
TOL = 1e-10


def shard(bias=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, L, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (1, L), generator=g)
    targets[0, [0, 7, 8, L - 1]] = IGNORE_INDEX  # ignored at both ends and in the middle
    targets[0, 1], targets[0, 2] = 0, V - 1
    return hidden, weight, b, targets


def leaves(hidden, weight, b):
    return [t for t in (hidden, weight, b) if t is not None]


def relative(got, want):
    return float((got.detach() - want.detach()).abs().max() / want.detach().abs().max().clamp_min(1e-300))


def plain_smoothed_sum(hidden, weight, b, targets, eps):
    """The mixin's plain path: transformers' LabelSmoother terms on the logits (times its divisor); it sums
    the smoothing term in float32 even from float64 logits."""
    nll, smoothed = smoothing_sums(F.linear(hidden, weight, b), targets)
    return (1 - eps) * nll + eps * smoothed / V


def exact_smoothed_sum(hidden, weight, b, targets, eps):
    """The same terms, every one in float64."""
    neg_logp = -torch.log_softmax(F.linear(hidden, weight, b)[0], dim=-1)
    valid = targets[0] != IGNORE_INDEX
    nll = neg_logp[valid].gather(1, targets[0][valid].unsqueeze(1)).sum()
    return (1 - eps) * nll + eps * neg_logp[valid].sum() / V


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
def test_the_sum_and_its_gradients_equal_the_plain_path(bias, eps):
    hidden, weight, b, targets = shard(bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it leaves its chunked path
        got = linear_ce_sum(hidden, weight, targets, bias_V=b, label_smoothing=eps)
    assert got.dim() == 0 and got.dtype == torch.float64
    grads = torch.autograd.grad(2.5 * got, leaves(hidden, weight, b))
    want = exact_smoothed_sum(hidden, weight, b, targets, eps)
    assert relative(got, plain_smoothed_sum(hidden, weight, b, targets, eps)) < 1e-6  # the mixin's, float32 inside
    if eps == 0.0:  # also the model's own path: cross_entropy(..., reduction="sum")
        plain = F.cross_entropy(F.linear(hidden, weight, b)[0], targets[0], reduction="sum")
        assert relative(want, plain) < TOL
    want_grads = torch.autograd.grad(2.5 * want, leaves(hidden, weight, b))
    assert relative(got, want) < TOL, (float(got), float(want))
    for g, w in zip(grads, want_grads):
        assert relative(g, w) < TOL
    ignored = targets[0] == IGNORE_INDEX  # a token without a target gets no gradient
    assert torch.equal(grads[0][0, ignored], torch.zeros(int(ignored.sum()), H, dtype=torch.float64))


def test_the_chunked_op_runs_in_several_chunks():
    hidden, weight, b, targets = shard()
    options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=4)
    got = linear_ce_sum(hidden, weight, targets, bias_V=b, label_smoothing=0.2, options=options)
    assert "chunked" in type(got.grad_fn.next_functions[0][0]).__name__.lower()
    assert relative(got, exact_smoothed_sum(hidden, weight, b, targets, 0.2)) < TOL


def test_a_shard_without_targets_sums_to_zero_with_zero_gradients():
    hidden, weight, b, targets = shard()
    got = linear_ce_sum(hidden, weight, torch.full_like(targets, IGNORE_INDEX), bias_V=b, label_smoothing=0.1)
    got.backward()
    assert got.item() == 0.0 and all(float(t.grad.abs().max()) == 0.0 for t in leaves(hidden, weight, b))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_token_log_probs_on_the_logits(temperature):
    hidden, weight, b, targets = shard()
    got, none = linear_token_log_probs(hidden, weight, targets, bias_V=b, temperature=temperature)
    want, _ = token_log_probs(F.linear(hidden, weight, b), targets, temperature=temperature)
    assert none is None and got.shape == (1, L)
    assert relative(got, want) < TOL
    assert torch.equal(got[targets == IGNORE_INDEX], torch.zeros(4, dtype=torch.float64))
    upstream = torch.linspace(-1, 2, L, dtype=torch.float64).reshape(1, L)  # a per-token weighting, as DPO/GRPO
    grads = torch.autograd.grad((got * upstream).sum(), leaves(hidden, weight, b))
    for g, w in zip(grads, torch.autograd.grad((want * upstream).sum(), leaves(hidden, weight, b))):
        assert relative(g, w) < TOL


def test_refusals_by_name():
    hidden, weight, b, targets = shard()
    with pytest.raises(ValueError, match="entropies"):
        linear_token_log_probs(hidden, weight, targets, with_entropy=True)
    with pytest.raises(ValueError, match="dtype"):
        linear_ce_sum(hidden.float(), weight, targets)
    with pytest.raises(ValueError, match=r"\[1, L, H\]"):
        linear_ce_sum(hidden[0], weight, targets)
    with pytest.raises(ValueError, match="bias"):
        linear_ce_sum(hidden, weight, targets, bias_V=b[:-1])
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_ce_sum(hidden, weight, targets, label_smoothing=1.5)

    class Wrapped(torch.Tensor):  # a tensor subclass (as DTensor is) would leave the chunked path
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    with pytest.raises(ValueError, match="Wrapped"):
        linear_ce_sum(hidden, weight.detach().as_subclass(Wrapped), targets)


def test_half_precision_sums_in_float32_once_smoothed():
    hidden, weight, b, targets = shard(dtype=torch.bfloat16)
    got = linear_ce_sum(hidden, weight, targets, bias_V=b, label_smoothing=0.1)
    assert got.dtype == torch.float32
    want = exact_smoothed_sum(hidden.double(), weight.double(), b.double(), targets, 0.1)
    assert relative(got.double(), want) < 2e-2  # bfloat16 inputs, torch's op rounds its sum to bfloat16


PEAK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from blockdiag_cp.step.linear_ce import linear_ce_sum
    torch.set_num_threads(1)
    N, H, V = 2048, 32, 32768  # the logits: 256 MB in float32
    hidden = torch.randn(1, N, H, requires_grad=True)
    weight = (0.02 * torch.randn(V, H)).requires_grad_()
    targets = torch.randint(0, V, (1, N))
    def hwm():
        return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) * 1024
    linear_ce_sum(hidden[:, :8], weight[:64], targets[:, :8] % 64).backward()  # first use: torch loads its kernels
    open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
    base = hwm()
    linear_ce_sum(hidden, weight, targets, label_smoothing=0.1).backward()
    print((hwm() - base) / 2**20)
""")


def test_a_fresh_process_never_holds_the_logits():
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, timeout=300, check=True)
    peak_mb = float(out.stdout.strip().splitlines()[-1])
    assert peak_mb < 64, f"{peak_mb:.0f} MB above the baseline; the logits alone would be 256 MB"
