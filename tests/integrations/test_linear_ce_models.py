"""`hf.linear_ce` on tiny float64 transformers models: the linear-CE loss (never the logits) against the
model's own plain loss and an all-float64 computation from its logits, gradients of every parameter
included, with label smoothing and -100 targets; Cohere's logit scale and Granite's logits scaling folded
into the hidden states; tied heads and a head bias; a VLM; what is not linear refused by name; and at cp 2
on real gloo ranks, each rank's loss equal to the mixin's plain path on the same shard and the ranks'
losses and gradients summed equal to the unsharded run's; and every causal LM of the installed transformers
exact or refused by name (about 10 s).

The model's own loss (transformers' ``ForCausalLMLoss``) and ``LabelSmoother`` compute in float32 even
from float64 logits, so they are met to 1e-6; the float64 computation from the same model's logits to 1e-10.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")

from blockdiag_cp.errors import ModelRefusal  # noqa: E402
from blockdiag_cp.hf.linear_ce import causal_lm_ce_sum, causal_lm_log_probs, linear_ce_loss, linear_head  # noqa: E402
from blockdiag_cp.loss import IGNORE_INDEX, token_log_probs  # noqa: E402

VOCAB = 97


class ScaledBiasedHead(transformers.LlamaForCausalLM):
    """Cohere's forward (``logits * self.logit_scale``) with a head bias: the scale must reach the bias too."""

    def __init__(self, config):
        super().__init__(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.logit_scale = 0.29
        self.post_init()

    def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits * self.logit_scale
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


KW = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=256)
#: name -> (model class, config)
MODELS = {
    "llama": ("LlamaForCausalLM", lambda: transformers.LlamaConfig(**KW)),
    "llama tied": ("LlamaForCausalLM", lambda: transformers.LlamaConfig(**KW, tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", lambda: transformers.Qwen2Config(**KW)),
    "qwen3": ("Qwen3ForCausalLM", lambda: transformers.Qwen3Config(**KW, head_dim=4)),
    "cohere": ("CohereForCausalLM", lambda: transformers.CohereConfig(**KW, logit_scale=0.37)),
    "granite": ("GraniteForCausalLM", lambda: transformers.GraniteConfig(**KW, logits_scaling=3.0)),
    "gemma2 unsoftcapped": ("Gemma2ForCausalLM", lambda: transformers.Gemma2Config(**KW, head_dim=4,
                                                                                   final_logit_softcapping=None)),
    "phi (head bias)": ("PhiForCausalLM", lambda: transformers.PhiConfig(**{**KW, "num_key_value_heads": 4})),
    "scaled biased head": (ScaledBiasedHead, lambda: transformers.LlamaConfig(**KW)),
}
TOL_EXACT, TOL_PLAIN = 1e-10, 1e-6


def build(name: str, attn: str = "eager") -> torch.nn.Module:
    class_name, config = MODELS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_class = getattr(transformers, class_name) if isinstance(class_name, str) else class_name
        model = model_class._from_config(config(), attn_implementation=attn, dtype=torch.float64)
    with torch.no_grad():  # random head biases (transformers starts them at zero)
        bias = model.get_output_embeddings().bias
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(4), dtype=bias.dtype))
    return model


def rows():
    """Two padded rows of a collator: input_ids [2, 13] and labels with prompt and padding positions -100."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (2, 13), generator=g)
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[1, 9:] = IGNORE_INDEX  # padding
    return ids, labels


def exact_sum(logits_NV, targets_N, eps):
    """Every target's ``(1 - eps) * nll + eps * mean_v(-log p_v)`` summed, all in float64."""
    neg_logp = -torch.log_softmax(logits_NV.double(), dim=-1)
    valid = targets_N != IGNORE_INDEX
    nll = neg_logp[valid].gather(1, targets_N[valid].unsqueeze(1)).sum()
    return (1 - eps) * nll + eps * neg_logp[valid].sum() / logits_NV.shape[-1]


def grads(model):
    out = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def worst(got: dict, want: dict) -> float:
    """The largest gradient difference over the model's largest gradient (its scale: Cohere's layer norm, for
    one, computes in float32 whatever the model's dtype, so a tiny gradient is not float64-exact of itself)."""
    scale = max(float(w.abs().max()) for w in want.values() if w.numel())
    return max(float((got[n] - w).abs().max()) for n, w in want.items() if w.numel()) / scale


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_loss_and_every_gradient_equal_the_plain_loss(name, eps):
    model = build(name)
    ids, labels = rows()
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    count = int((targets != IGNORE_INDEX).sum())
    # the plain loss as the Trainer computes it: the model's own (mean), or LabelSmoother on its logits
    out = model(input_ids=ids, labels=None if eps else labels)
    plain = out.loss if not eps else transformers.trainer_pt_utils.LabelSmoother(eps)(out, labels, shift_labels=True)
    plain.backward()
    plain_grads = grads(model)
    exact = exact_sum(model(input_ids=ids).logits.reshape(-1, VOCAB), targets.reshape(-1), eps) / count
    exact.backward()
    exact_grads = grads(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it leaves its chunked path
        got = linear_ce_loss(model, {"input_ids": ids, "labels": labels}, label_smoothing=eps)
    got.backward()
    got_grads = grads(model)
    assert abs(float(got - exact)) <= TOL_EXACT * float(exact), (got.item(), exact.item())
    assert worst(got_grads, exact_grads) <= TOL_EXACT
    assert abs(float(got - plain)) <= TOL_PLAIN * float(plain), (got.item(), plain.item())
    assert worst(got_grads, plain_grads) <= TOL_PLAIN


def test_a_count_divides_the_sum_and_shift_labels_are_taken_as_they_are():
    model = build("granite")
    ids, labels = rows()
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    targets[0, 6] = IGNORE_INDEX  # a target only shift_labels drop: they are used as given, not recomputed
    loss_sum, count, outputs = causal_lm_ce_sum(model, {"input_ids": ids, "shift_labels": targets})
    assert int(count) == int((targets != IGNORE_INDEX).sum()) and outputs.logits.shape == (2, 0, VOCAB)
    assert outputs.loss is None  # the model computed no loss of its own
    want = exact_sum(model(input_ids=ids).logits.reshape(-1, VOCAB), targets.reshape(-1), 0.0)
    assert abs(float(loss_sum - want)) <= TOL_EXACT * float(want)
    divided = linear_ce_loss(model, {"input_ids": ids, "shift_labels": targets, "num_items_in_batch": 1},
                             num_items_in_batch=torch.tensor(7.0))
    assert abs(float(divided - want / 7)) <= TOL_EXACT * float(want / 7)


class Wrapper(torch.nn.Module):
    """A wrapper as DDP is one (``.module``): the model inside is read, the wrapper is called."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.module(**kwargs)


def test_a_wrapped_model_is_read_inside_and_called_outside():
    model = build("granite")
    ids, labels = rows()
    wrapper = Wrapper(model)
    got = linear_ce_loss(wrapper, {"input_ids": ids, "labels": labels})
    assert wrapper.calls == 1
    assert abs(float(got - linear_ce_loss(model, {"input_ids": ids, "labels": labels}))) <= TOL_EXACT * float(got)


@pytest.mark.parametrize("name", ["cohere", "scaled biased head"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_token_log_probs_on_the_logits(name, temperature):
    model = build(name)
    ids, labels = rows()
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    got, outputs = causal_lm_log_probs(model, {"input_ids": ids, "shift_labels": targets}, temperature=temperature)
    assert got.shape == targets.shape and outputs.logits.shape == (2, 0, VOCAB)
    weights = torch.linspace(-1, 2, targets.numel(), dtype=torch.float64).reshape(targets.shape)  # DPO-style weights
    (got * weights).sum().backward()
    got_grads = grads(model)
    want = torch.cat([token_log_probs(row[None], t[None], temperature=temperature)[0]
                      for row, t in zip(model(input_ids=ids).logits, targets)])
    (want * weights).sum().backward()
    assert float((got - want).abs().max()) <= TOL_EXACT * float(want.abs().max())
    assert worst(got_grads, grads(model)) <= TOL_EXACT


def test_the_head_and_its_scale_are_read_from_the_forward():
    assert linear_head(build("cohere")).scale == pytest.approx(0.37)
    assert linear_head(build("granite")).scale == pytest.approx(1 / 3)
    tied = build("llama tied")
    assert linear_head(tied).module.weight is tied.get_input_embeddings().weight
    assert linear_head(build("llama")).scale == 1.0


class AddsToLogits(transformers.LlamaForCausalLM):
    """A model that changes its logits after the head in a way the linear-CE loss does not know."""

    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits + 0.5
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)


class SkipsItsHead(transformers.LlamaForCausalLM):
    """A forward that returns before its head when asked to."""

    def forward(self, input_ids=None, skip_head=False, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        if skip_head:
            return transformers.modeling_outputs.CausalLMOutputWithPast(logits=hidden_states)
        logits = self.lm_head(hidden_states)
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)


class LoraLikeHead(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_what_is_not_linear_is_refused_by_name():
    ids, labels = rows()
    inputs = {"input_ids": ids, "labels": labels}
    softcapped = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**KW, head_dim=4))
    with pytest.raises(ModelRefusal, match=r"Gemma2ForCausalLM.*final_logit_softcapping=30\.0"):
        linear_ce_loss(softcapped, inputs)
    custom = AddsToLogits(transformers.LlamaConfig(**KW))
    with pytest.raises(ModelRefusal, match=r"AddsToLogits.*logits = logits \+ 0\.5"):
        linear_ce_loss(custom, inputs)
    skips = SkipsItsHead(transformers.LlamaConfig(**KW))
    assert float(linear_ce_loss(skips, inputs)) > 0  # its head is read and called
    with pytest.raises(ModelRefusal, match="SkipsItsHead.*never called its output embeddings"):
        linear_ce_loss(skips, {**inputs, "skip_head": True})
    model = build("llama")
    model.lm_head = LoraLikeHead(16, VOCAB, bias=False)
    with pytest.raises(ModelRefusal, match="LoraLikeHead, not a plain nn.Linear"):
        linear_ce_loss(model, inputs)
    model = build("llama")
    with pytest.raises(ModelRefusal, match="router load-balancing loss"):
        linear_ce_loss(model, {**inputs, "output_router_logits": True})
    model.config.output_router_logits = True
    with pytest.raises(ModelRefusal, match="router load-balancing loss"):
        linear_ce_loss(model, inputs)
    model.config.output_router_logits = False
    for keep in (1, torch.tensor([2, 3])):
        with pytest.raises(ValueError, match="logits_to_keep"):
            linear_ce_loss(model, {**inputs, "logits_to_keep": keep})
    with pytest.raises(ValueError, match="shift_labels"):
        linear_ce_loss(model, {"input_ids": ids})


def test_a_vlm_with_an_image_is_exact():
    from test_vlm import IMAGE, samples, tiny_vlm, visual_kwargs

    model = tiny_vlm("qwen2_5_vl", "sdpa")
    ids, visuals = samples("qwen2_5_vl")[0]
    ids = torch.tensor([ids])
    labels = ids.masked_fill(ids == IMAGE, IGNORE_INDEX)
    kw = {**visual_kwargs("qwen2_5_vl", visuals), "mm_token_type_ids": (ids == IMAGE).int(), "use_cache": False}
    plain = model(input_ids=ids, labels=labels, **kw).loss
    plain.backward()
    plain_grads = grads(model)
    got = linear_ce_loss(model, {"input_ids": ids, "labels": labels, **kw})
    got.backward()
    got_grads = grads(model)
    assert abs(float(got - plain)) <= TOL_PLAIN * float(plain)
    assert worst(got_grads, plain_grads) <= TOL_PLAIN
    assert any(float(g.abs().max()) > 0 for n, g in got_grads.items() if ".visual." in n)  # the image was trained


# -- under CP ---------------------------------------------------------------------------------------------------

#: documents of the packed row (the last one straddles the ranks at cp 2), then padding
LENGTHS, PADDING = (5, 1, 9, 3, 7), 3
CP_CASES = (("llama", 0.0), ("cohere", 0.1), ("granite", 0.1), ("phi (head bias)", 0.0), ("scaled biased head", 0.1))


def packed_batch():
    """One packed row: input_ids, position_ids, labels (a few -100), _packed_seq_ids, shift_labels."""
    from blockdiag_cp.loss import add_shift_labels

    S = sum(LENGTHS) + PADDING
    ids = torch.randint(1, VOCAB, (1, S), generator=torch.Generator().manual_seed(6))
    doc = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(LENGTHS)] + [torch.zeros(PADDING, dtype=torch.long)])
    positions = torch.cat([torch.arange(n) for n in LENGTHS] + [torch.zeros(PADDING, dtype=torch.long)])
    labels = ids.clone()
    labels[0, [3, 8, 9]] = IGNORE_INDEX
    labels[0, -PADDING:] = IGNORE_INDEX
    return add_shift_labels({"input_ids": ids, "position_ids": positions[None], "labels": labels,
                             "_packed_seq_ids": doc[None]})


def step_inputs(batch):
    """What the mixin hands the model of a step: the sharded ids, positions, labels and shift_labels."""
    return {k: batch[k] for k in ("input_ids", "position_ids", "labels", "shift_labels")}


def unsharded(name, eps, count):
    """The plain loss of the whole row in one process (documents masked, world 1), float64 and the model's own."""
    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.hf.losses import smoothing_sums

    model = build(name, "blockdiag_cp")
    train_ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, packed_batch())
    with train_ctx():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        nll, smoothed = smoothing_sums(logits, batch["shift_labels"])  # the mixin's plain path (float32 inside)
        plain = ((1 - eps) * nll / count + eps * smoothed / (count * VOCAB)).item()
        exact = exact_sum(logits[0], batch["shift_labels"][0], eps) / count
        exact.backward()
    return exact.item(), plain, grads(model)


def cp_worker(rank, world, cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import blockdiag_cp.hf  # noqa: F401  registers the attention
    from blockdiag_cp import make_cp_blockdiag_batch_and_ctx
    from blockdiag_cp.hf.losses import RowsStep, ShardLabelSmoother

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    group = mesh.get_group()
    out = {}
    for name, eps in cases:
        row = packed_batch()
        count = int((row["shift_labels"] != IGNORE_INDEX).sum())  # the Trainer's num_items_in_batch (one replica)
        exact, plain, want = unsharded(name, eps, count)
        model = build(name, "blockdiag_cp")
        train_ctx, batch = make_cp_blockdiag_batch_and_ctx(mesh, None, row)
        step = RowsStep(train_ctx, tuple(row["input_ids"].shape), batch["padding_mask"], batch["shift_labels"],
                        torch.tensor(count))
        with train_ctx():
            loss = linear_ce_loss(model, step_inputs(batch), num_items_in_batch=step.replica_divisor(count),
                                  label_smoothing=eps)
            loss.backward()
            with torch.no_grad():  # the mixin's plain path on the same shard: the model's own loss, or the smoother
                if eps:
                    output = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
                    mine = ShardLabelSmoother(eps, lambda: step)(output, None, num_items_in_batch=count)
                else:
                    mine = model(**step_inputs(batch), num_items_in_batch=count).loss
        got = grads(model)
        for g in got.values():
            dist.all_reduce(g, group=group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        out[(name, eps)] = {"rank vs the plain path": abs(float(loss) - float(mine)) / max(abs(float(mine)), 1e-12),
                            "loss vs float64": abs(float(total) - exact) / exact,
                            "loss vs unsharded plain": abs(float(total) - plain) / plain,
                            "grads vs float64": worst(got, want)}
    return out


def test_under_cp_each_rank_is_the_mixins_plain_path_and_the_sum_is_the_unsharded_loss(rank_pools):
    per_rank = rank_pools(2).run(cp_worker, CP_CASES)
    print({case: {k: f"{max(r[case][k] for r in per_rank):.1e}" for k in per_rank[0][case]} for case in CP_CASES})
    for case in CP_CASES:
        for errors in (r[case] for r in per_rank):
            assert errors["rank vs the plain path"] <= TOL_PLAIN, (case, errors)
            assert errors["loss vs unsharded plain"] <= TOL_PLAIN, (case, errors)
            assert errors["loss vs float64"] <= TOL_EXACT, (case, errors)
            # Cohere's layer norm computes in float32: its gradients summed over shards differ at 5e-9 of the scale
            assert errors["grads vs float64"] <= (1e-8 if case[0] == "cohere" else TOL_EXACT), (case, errors)


def vlm_cp_worker(rank, world):
    """Qwen2.5-VL's packed row of images and text at cp 2 with the linear-CE loss, against each sample alone."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from test_vlm import packed_row, reference, samples, tiny_vlm

    from blockdiag_cp.hf import make_cp_vlm_batch_and_ctx, vlm_model_inputs
    from blockdiag_cp.loss import add_shift_labels

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    _, want_loss, want_grads = reference("qwen2_5_vl")
    model = tiny_vlm("qwen2_5_vl", "blockdiag_cp")
    train_ctx, batch = make_cp_vlm_batch_and_ctx(mesh, model, add_shift_labels(packed_row("qwen2_5_vl")))
    count = sum(len(ids) - 1 for ids, _ in samples("qwen2_5_vl"))
    with train_ctx():
        inputs = {**vlm_model_inputs(batch), "shift_labels": batch["shift_labels"], "use_cache": False}
        loss = linear_ce_loss(model, inputs, num_items_in_batch=count)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    got = grads(model)
    for g in got.values():
        dist.all_reduce(g, group=mesh.get_group())
    return abs(float(total) - want_loss) / want_loss, worst(got, {n: want_grads.get(n, torch.zeros_like(g))
                                                                 for n, g in got.items()})


def test_a_vlm_row_under_cp_equals_each_sample_alone(rank_pools):
    for loss_error, grad_error in rank_pools(2).run(vlm_cp_worker):
        print(f"Qwen2.5-VL at cp 2: loss {loss_error:.1e}, gradients {grad_error:.1e}")
        assert loss_error <= TOL_EXACT and grad_error <= 1e-9, (loss_error, grad_error)


# -- every causal LM of transformers ----------------------------------------------------------------------------

def sweep_case(model_type: str):
    """``(verdict, detail)`` of one causal-LM type's tiny float64 model: "exact" (relative error of the loss, 1e-6
    at most, against float64 cross-entropy on its logits), "refused" (a `ValueError`: the reason), "skipped"
    (its tiny config or its own forward does not run in float64), else "wrong" / "crashed"."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from blockdiag_cp.testing.zoo_configs import MAX_PARAMETERS, tiny_config

    try:
        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        config = tiny_config(model_type, model_class)
        with torch.device("meta"):
            size = sum(p.numel() for p in model_class._from_config(config, attn_implementation="eager").parameters())
        if size > MAX_PARAMETERS:
            return "skipped", "too big"
        torch.manual_seed(0)
        model = model_class._from_config(config, attn_implementation="eager", dtype=torch.float64,
                                         experts_implementation="eager").eval()
        ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(1))
        labels = ids.masked_fill(torch.arange(9) < 2, IGNORE_INDEX)
        logits = model(input_ids=ids, use_cache=False).logits
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        want = exact_sum(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), 0.1).item()
    except Exception as exc:  # noqa: BLE001  the type does not run as built here
        return "skipped", f"{type(exc).__name__}: {exc}"[:120]
    try:
        got = linear_ce_sum_of(model, ids, labels)
    except ValueError as exc:
        return "refused", getattr(exc, "reason", str(exc))
    except Exception as exc:  # noqa: BLE001
        return "crashed", f"{type(exc).__name__}: {exc}"[:200]
    error = abs(got - want) / abs(want)
    return ("exact" if error <= TOL_PLAIN else "wrong"), f"{error:.1e}"


def linear_ce_sum_of(model, ids, labels) -> float:
    loss_sum, _, _ = causal_lm_ce_sum(model, {"input_ids": ids, "labels": labels, "use_cache": False},
                                      label_smoothing=0.1)
    return loss_sum.item()


@pytest.mark.slow  # 25 s of the fast loop; the named families' exactness runs there (test_the_loss_and_every_...)
def test_every_causal_lm_of_transformers_is_exact_or_refused_by_name():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        verdicts = {t: sweep_case(t) for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    counts = {v: sum(1 for verdict, _ in verdicts.values() if verdict == v) for v in ("exact", "refused", "skipped")}
    print(counts, "refused:", {t: d for t, (v, d) in verdicts.items() if v == "refused"})
    bad = {t: d for t, d in verdicts.items() if d[0] not in ("exact", "refused", "skipped")}
    assert not bad, bad
    for model_type in ("llama", "qwen2", "qwen3", "cohere", "granite", "gemma3_text", "mistral", "phi3"):
        assert verdicts[model_type][0] == "exact", (model_type, verdicts[model_type])
    for model_type in ("gemma2", "recurrent_gemma"):  # final logit softcapping (tanh)
        assert verdicts[model_type][0] == "refused", (model_type, verdicts[model_type])
    assert counts["exact"] >= 90, counts
