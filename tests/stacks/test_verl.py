"""verl's FSDP engine with per-document CP (issue #53): verl's own workers, from verl's own trainer config, run a few
PPO and GRPO steps on CPU gloo ranks with the block-diagonal CP engine (``VERL_ENGINE_VENDOR=blockdiag_cp``) and with
verl's engine at sp 1, on the same rows; every per-token output (old log-probs, entropy, reference log-probs, values,
advantages), every logged loss and grad norm, and the final parameters of actor and critic agree.

Launches (each shared by several comparisons; tests/stacks/verl_runs.py): one process (verl's engine at sp 1: the
references), two (cp 2), four (dp 2 x cp 2, and cp 4). Needs verl (``pip install -e ".[verl]"``, docs/verl.md);
skipped without it.
"""

import concurrent.futures
import contextlib
import copy
import dataclasses
import os
import types

import pytest
import torch

pytest.importorskip("verl")

import verl_cpu  # noqa: E402  (the CPU platform fixture: selected before anything resolves verl's platform)

verl_cpu.use_cpu_platform()

from verl.workers.config import FSDPEngineConfig, HFModelConfig  # noqa: E402
from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead  # noqa: E402
from verl_runs import Run, launch, write_model  # noqa: E402

from blockdiag_cp.errors import InvariantError  # noqa: E402
from blockdiag_cp.integrations.verl import (  # noqa: E402
    VENDOR, BlockDiagCPEngineWithLMHead, BlockDiagCPEngineWithValueHead, MicroBatchSteps, attend_per_document, refusal)

#: float32: per-token values to 1e-5 relative to their largest (observed 1e-6 on log-probs of about 6), logged losses
#: and grad norms to 1e-5 relative (observed up to 8e-6 on the KL loss; below 1e-6 in absolute value a loss is
#: rounding noise: the first step's policy loss), parameters to 1e-4 absolute (observed 4e-6 after AdamW at lr 1e-3)
TOKEN_TOL, LOSS_TOL, LOSS_FLOOR, PARAM_TOL = 1e-5, 1e-5, 1e-6, 1e-4
#: the logged values compared (per step); per micro-batch lists (vpred_mean, kl_coef) follow the micro-batching,
#: which dynamic batch size sizes by tokens per rank
LOGGED = ("loss", "grad_norm", "actor/pg_loss", "actor/entropy_loss", "actor/ppo_kl", "actor/pg_clipfrac", "kl_loss",
          "critic/vf_loss")
PER_TOKEN = ("old_log_probs", "entropys", "ref_log_prob", "values", "advantages")

QWEN = Run("qwen2_6h")  # PPO (GAE, critic), dynamic batch size, gradient checkpointing; 6 heads over 3 KV heads
#: GRPO, LoRA, 2 sequences per micro-batch, a sampling temperature per sequence
LLAMA = Run("llama", estimator="grpo", dynamic_bsz=False, lora_rank=8, sample_temperatures=True)
HYBRID = Run("qwen3_5", estimator="grpo")  # Gated DeltaNet + attention
CP = dict(engine=True)
#: where the fixture saves every run's results when set (a path)
DUMP = "BLOCKDIAG_CP_VERL_DUMP"
RUNS = {
    1: {"qwen": QWEN, "llama": LLAMA,
        "hybrid_alone": dataclasses.replace(HYBRID, dynamic_bsz=False, micro_batch=1),  # nothing packed: the oracle
        "hybrid_packed": dataclasses.replace(HYBRID, dynamic_bsz=False),  # verl's engine on packed micro-batches
        "hybrid_cp1": dataclasses.replace(HYBRID, **CP)},  # the engine without CP: per document all the same
    2: {"qwen_cp2": dataclasses.replace(QWEN, world=2, cp=2, probe=True, **CP),
        "qwen_ulysses2": dataclasses.replace(QWEN, world=2, cp=2, refused=True),  # verl's Ulysses
        "llama_cp2": dataclasses.replace(LLAMA, world=2, cp=2, **CP),
        "hybrid_cp2": dataclasses.replace(HYBRID, world=2, cp=2, **CP)},
    4: {"qwen_dp2_cp2": dataclasses.replace(QWEN, world=4, cp=2, **CP),
        "qwen_cp4": dataclasses.replace(QWEN, world=4, cp=4, **CP)},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of `RUNS`: one launch per world size, side by side."""
    root = tmp_path_factory.mktemp("verl")
    for run in (run for named in RUNS.values() for run in named.values()):
        write_model(root, run.family, value=run.critic)  # here, once: the launches' threads then only read them
    with concurrent.futures.ThreadPoolExecutor(len(RUNS)) as pool:
        launched = {world: pool.submit(launch, tuple(named.values()), root) for world, named in RUNS.items()}
        out = {}
        for world, future in launched.items():
            out.update(zip(RUNS[world], future.result()))
    if os.environ.get(DUMP):  # docs/verl.md's numbers come from here
        torch.save(out, os.environ[DUMP])
    return out


def assert_close_logged(got: dict, want: dict, where: str) -> None:
    for key in LOGGED:
        if key not in want:
            continue
        g, w = (v if isinstance(v, list) else [v] for v in (got[key], want[key]))
        assert len(g) == len(w), (where, key, g, w)
        for a, b in zip(g, w):
            assert abs(float(a) - float(b)) <= LOSS_TOL * abs(float(b)) + LOSS_FLOOR, (where, key, float(a), float(b))


def assert_params_close(got: dict, want: dict, tol: float, where: str) -> None:
    assert got.keys() == want.keys(), where
    moved = {n: float((got[n] - want[n]).abs().max()) for n in want}
    worst = max(moved, key=moved.get)
    assert moved[worst] <= tol, (where, worst, moved[worst])


def assert_same_training(got: dict, want: dict) -> None:
    """Per-token outputs, logged values and the parameters after every step of two runs of the same steps agree."""
    assert len(got["steps"]) == len(want["steps"])
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        for key in PER_TOKEN:
            if key in w:
                diff = float((g[key] - w[key]).abs().max())
                assert diff <= TOKEN_TOL * max(1.0, float(w[key].abs().max())), (step, key, diff)
        for role in ("actor", "critic"):
            if role in w:
                assert_close_logged(g[role], w[role], f"step {step} {role}")
        assert_params_close(g["actor_params"], w["actor_params"], PARAM_TOL, f"actor after step {step}")
    if "critic_params" in want:
        assert_params_close(got["critic_params"], want["critic_params"], PARAM_TOL, "critic")
    assert want["actor_moved"] > 10 * PARAM_TOL, want["actor_moved"]  # the steps trained the actor


@pytest.mark.slow
def test_verls_workers_build_the_block_diagonal_engines_from_the_config(runs):
    assert runs["qwen"]["engines"] == {"actor": "FSDPEngineWithLMHead", "ref": "FSDPEngineWithLMHead",
                                       "critic": "FSDPEngineWithValueHead"}
    for name in ("qwen_cp2", "qwen_dp2_cp2", "qwen_cp4"):
        assert runs[name]["engines"] == {"actor": "BlockDiagCPEngineWithLMHead", "ref": "BlockDiagCPEngineWithLMHead",
                                         "critic": "BlockDiagCPEngineWithValueHead"}, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen_cp2", "qwen_dp2_cp2", "qwen_cp4"])
def test_ppo_with_a_critic_equals_verls_engine_at_sp1(runs, name):
    """6 query heads over 3 KV heads: verl's Ulysses refuses them at sp 2 and 4 (next test); dynamic batch size and
    gradient checkpointing on; GAE with the critic's values; KL loss to the reference; temperature 0.7."""
    assert_same_training(runs[name], runs["qwen"])


@pytest.mark.slow
@pytest.mark.parametrize("name, cp", [("qwen_cp2", 2), ("qwen_dp2_cp2", 2), ("qwen_cp4", 4), ("llama_cp2", 2),
                                      ("hybrid_cp2", 2)])
def test_every_micro_batch_is_sharded_over_the_cp_group(runs, name, cp):
    """CP that silently does nothing (each rank on the whole row) would pass every comparison: each rank holds its
    share of every micro-batch's row (plus the plan's padding to a multiple of cp)."""
    shards = runs[name]["shards"]
    assert len(shards) >= 4, shards  # log-probs, reference, (values), updates: every micro-batch of both steps
    for world, local, row in shards:
        assert world == cp and local == -(-row // cp), (world, local, row)


@pytest.mark.slow
def test_verls_ulysses_refuses_the_head_count_the_engine_trains(runs):
    assert "num_key_value_heads 3 must be divisible by ulysses_sp_size 2" in runs["qwen_ulysses2"]["refused"]


@pytest.mark.slow
def test_grpo_with_lora_equals_verls_engine_at_sp1(runs):
    """A second family (Llama, 4 heads over 2), GRPO, LoRA rank 8 (reference log-probs: the actor with its adapters
    disabled, as verl's driver computes them), two sequences per micro-batch, each sequence its own temperature."""
    got, want = runs["llama_cp2"], runs["llama"]
    assert got["engines"] == {"actor": "BlockDiagCPEngineWithLMHead"}
    assert all("lora" in name for name in want["actor_params"]), sorted(want["actor_params"])[:3]
    assert_same_training(got, want)


@pytest.mark.slow
def test_a_hybrid_equals_each_sequence_run_alone(runs):
    """Qwen3.5 (Gated DeltaNet and attention layers) at cp 2 and 1, micro-batches of several sequences, against verl's own
    engine with each sequence alone in its micro-batch (nothing packed, so nothing can leak); verl's engine on the same
    packed micro-batches lets one sequence's recurrent state reach the next (transformers' torch path of the layer
    takes no document boundaries), which the comparison's last line shows."""
    got, alone, packed = runs["hybrid_cp2"], runs["hybrid_alone"], runs["hybrid_packed"]
    assert_same_training(got, alone)
    assert_same_training(runs["hybrid_cp1"], alone)  # the engine at cp 1 (one rank): packed, per document
    leak = float((packed["steps"][0]["old_log_probs"] - alone["steps"][0]["old_log_probs"]).abs().max())
    assert leak > 1e-3, leak  # observed 3.3e-3 on the first step's old log-probs


@pytest.mark.slow
def test_a_changed_token_moves_only_its_own_sequence_from_the_change_on(runs):
    probe = runs["qwen_cp2"]["probe"]
    assert probe["elsewhere"] == 0.0 and probe["before_change"] == 0.0, probe  # bit for bit
    assert probe["from_change"] > 1e-3, probe


# ------------------------------------------------------------------------------------------ without a launch


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    lm, _ = write_model(tmp_path_factory.mktemp("verl_model"), "llama", value=False)
    return HFModelConfig(path=lm, use_remove_padding=True)


def test_verls_registry_hands_out_the_engines_under_the_vendor(monkeypatch):
    for backend in ("fsdp", "fsdp2"):
        monkeypatch.setenv("VERL_ENGINE_VENDOR", VENDOR)
        assert EngineRegistry.get_engine_cls("language_model", backend) is BlockDiagCPEngineWithLMHead
        assert EngineRegistry.get_engine_cls("value_model", backend) is BlockDiagCPEngineWithValueHead
        monkeypatch.delenv("VERL_ENGINE_VENDOR")
        assert EngineRegistry.get_engine_cls("language_model", backend) is FSDPEngineWithLMHead
        assert EngineRegistry.get_engine_cls("value_model", backend) is FSDPEngineWithValueHead


@pytest.mark.parametrize("engine, model, named", [
    (dict(strategy="fsdp"), {}, "strategy"),
    (dict(pad_to_length=True), {}, "pad_to_length"),
    ({}, dict(use_remove_padding=False), "use_remove_padding"),
    ({}, dict(use_fused_kernels=True), "use_fused_kernels"),
    ({}, dict(use_liger=True), "use_liger"),
    ({}, dict(enable_activation_offload=True), "enable_activation_offload"),
])
def test_what_the_engine_has_not_verified_is_refused_by_name_before_anything_is_built(model_config, engine, model,
                                                                                       named):
    engine_config = FSDPEngineConfig(**{"strategy": "fsdp2", **engine})
    changed = dataclasses.replace(model_config, **model) if model else model_config
    assert refusal(FSDPEngineConfig(strategy="fsdp2"), model_config) is None
    assert f"{named} is refused" in refusal(engine_config, changed)
    with pytest.raises(ValueError, match=f"{named} is refused"):  # no process group: raised before verl's __init__
        BlockDiagCPEngineWithLMHead(model_config=changed, engine_config=engine_config, optimizer_config=None,
                                    checkpoint_config=None)


def test_vision_language_models_are_refused(model_config):
    vlm = copy.copy(model_config)
    object.__setattr__(vlm, "hf_config", types.SimpleNamespace(vision_config=object()))
    assert "vision_config is refused" in refusal(FSDPEngineConfig(strategy="fsdp2"), vlm)


class _Step:
    """A stand-in for a step's ``train_ctx`` that records when it is entered and left (and with what error)."""

    def __init__(self):
        self.events = []

    def __call__(self):
        @contextlib.contextmanager
        def ctx():
            self.events.append("enter")
            try:
                yield self
            except BaseException as exc:
                self.events.append(f"left by {type(exc).__name__}")
                raise
            self.events.append("left")
        return ctx()


def test_a_training_micro_batchs_step_spans_its_backward_and_a_forward_only_one_its_forward():
    steps = MicroBatchSteps()
    training = _Step()
    with steps.training_micro_batch():
        with steps.forward(training=True):
            steps.enter(training)
        assert training.events == ["enter"]  # forward done: the backward still runs in the step
    assert training.events == ["enter", "left"]
    inference = _Step()
    with steps.forward(training=False):
        steps.enter(inference)
    assert inference.events == ["enter", "left"]
    failing = _Step()
    with pytest.raises(KeyError):
        with steps.training_micro_batch():
            with steps.forward(training=True):
                steps.enter(failing)
            raise KeyError("backward failed")
    assert failing.events == ["enter", "left by KeyError"]


def test_micro_batch_steps_outside_verls_loop_are_invariant_errors():
    steps = MicroBatchSteps()
    with pytest.raises(InvariantError, match="outside _gradient_sync_context"):
        with steps.forward(training=True):
            pass
    with pytest.raises(InvariantError, match="outside a forward_step"):
        steps.enter(_Step())
    with pytest.raises(InvariantError, match="still open"):
        with steps.training_micro_batch():
            with steps.forward(training=False):
                pass


def test_a_loaded_model_attends_per_document_and_trls_value_head_is_refused(model_config):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_config.local_path, attn_implementation="sdpa")
    assert attend_per_document(model).config._attn_implementation == "blockdiag_cp"  # verl's critic: loaded with FA2
    with pytest.raises(ValueError, match="Sequential is refused"):
        attend_per_document(torch.nn.Sequential(model))  # a wrapper (trl's value head) reaches no attention of ours
