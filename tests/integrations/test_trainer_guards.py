"""What the Trainer mixin refuses, and how the examples fail: a clear ValueError at construction, one line.

Each refusal stands where the run would otherwise be silently different from the run
without CP, hang, or crash deep inside a trainer.
"""

import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

from blockdiag_cp.testing import hang_timeout

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from examples_module import EXAMPLES, ROOT, example  # noqa: E402

from blockdiag_cp.trainer import BlockDiagCPMixin, BlockDiagCPTrainer, _refuse_uneven_replicas  # noqa: E402



@pytest.fixture(scope="module")
def trainer_example():
    return example("train_trainer")


def arguments(trainer_example, tmp_path, **changes):
    args = trainer_example.training_arguments(trainer_example.parse_args([]), str(tmp_path))
    for name, value in changes.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize("name", ["KTOTrainer", "RewardTrainer", "RLOOTrainer", "DistillationTrainer"])
def test_trainers_the_mixin_cannot_shard_are_refused_by_name(name):
    trl = pytest.importorskip("trl")
    mixed = type(f"CP{name}", (BlockDiagCPMixin, getattr(trl, name)), {})
    with pytest.raises(ValueError, match=f"does not support {name}"):
        mixed(model=None, args=None, cp_size=2)  # refused before the trainer's own __init__ runs


def test_seq2seq_generation_is_refused_and_user_subclasses_are_not(trainer_example, tmp_path):
    """Seq2SeqTrainer trains rows as the Trainer does (LLaMA-Factory's SFT trainer is one: tests/stacks/
    test_llamafactory.py compares it with the run without CP); its generation from packed CP rows is refused."""
    cp_seq2seq = type("CPSeq2Seq", (BlockDiagCPMixin, transformers.Seq2SeqTrainer), {})
    args = transformers.Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, predict_with_generate=True)
    with pytest.raises(ValueError, match="predict_with_generate=True: generation from packed CP rows"):
        cp_seq2seq(model=trainer_example.tiny_llama(), args=args, cp_size=1)
    args.predict_with_generate = False
    assert cp_seq2seq(model=trainer_example.tiny_llama(), args=args, cp_size=1).cp_size == 1
    mine = type("MyTrainer", (BlockDiagCPTrainer,), {"compute_loss": BlockDiagCPTrainer.compute_loss})
    trainer = mine(model=trainer_example.tiny_llama(), args=arguments(trainer_example, tmp_path), cp_size=1)
    assert trainer.cp_size == 1
    mine = type("MyTrainer", (BlockDiagCPTrainer,), {"compute_loss": BlockDiagCPTrainer.compute_loss})
    trainer = mine(model=trainer_example.tiny_llama(), args=arguments(trainer_example, tmp_path), cp_size=1)
    assert trainer.cp_size == 1


def test_grpo_generation_batch_is_sized_per_replica():
    from types import SimpleNamespace

    from blockdiag_cp.hf.trainer_scoring import generation_batch_per_replica

    args = SimpleNamespace(world_size=4, per_device_train_batch_size=3, steps_per_generation=2, num_generations=6,
                           generation_batch_size=24)  # TRL's count over all 4 processes
    generation_batch_per_replica(args, 2)
    assert args.generation_batch_size == 12  # 2 replicas x 3 x 2 steps, as without CP
    args.num_generations = 5
    with pytest.raises(ValueError, match="divisible by num_generations=5"):
        generation_batch_per_replica(args, 2)


def test_each_trainer_kind_gets_its_strategy():
    """The one choice of the mixin's strategy (hf/trainer_kinds.py): the most specific transformers / TRL base."""
    trl = pytest.importorskip("trl")
    from blockdiag_cp.hf.trainer_kinds import strategy_for
    from blockdiag_cp.hf.trainer_rows import RowsStrategy, SFTRowsStrategy
    from blockdiag_cp.hf.trainer_scoring import GeneratingStrategy, ScoringStrategy

    mine = type("MyGRPO", (BlockDiagCPMixin, trl.GRPOTrainer), {})
    chosen = [strategy_for(cls) for cls in (mine, type("D", (trl.DPOTrainer,), {}), BlockDiagCPTrainer,
                                            type("S", (BlockDiagCPMixin, trl.SFTTrainer), {}), BlockDiagCPMixin)]
    assert chosen == [GeneratingStrategy, ScoringStrategy, RowsStrategy, SFTRowsStrategy, RowsStrategy]
    assert [s.kind for s in chosen] == ["generating", "scoring", "rows", "rows", "rows"]  # hf/options.py's kinds


def test_uneven_replicas_that_would_hang_are_refused():
    with pytest.raises(ValueError, match="even_batches=True"):
        _refuse_uneven_replicas(even_batches=False, drop_last=False, dp=2)
    _refuse_uneven_replicas(even_batches=False, drop_last=True, dp=2)  # every replica drops the short batch
    _refuse_uneven_replicas(even_batches=False, drop_last=False, dp=1)  # one replica: nothing to wait for
    _refuse_uneven_replicas(even_batches=True, drop_last=False, dp=4)


def test_a_rank_aware_sampler_is_refused_under_cp(trainer_example, tmp_path):
    args = arguments(trainer_example, tmp_path, train_sampling_strategy="batch_rebalance")
    with pytest.raises(ValueError, match="batch_rebalance"):
        BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args, cp_size=2)


def test_an_unsupported_hybrid_model_is_refused_at_construction(trainer_example, tmp_path):
    """Jamba's Mamba (v1) mixer is not routed (supported hybrids are prepared: test_hybrid_models.py)."""
    config = transformers.JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.JambaForCausalLM(config)
    with pytest.raises(ValueError, match="JambaMamba"):
        BlockDiagCPTrainer(model=model, args=arguments(trainer_example, tmp_path), cp_size=1)


def test_seq_dims_reach_the_batch_and_bad_ones_are_refused(trainer_example, tmp_path):
    args = arguments(trainer_example, tmp_path)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "labels": torch.tensor([[5, 6, 7, 8, 9]]),
             "per_layer_inputs": torch.zeros(1, 5, 2, 3)}
    plain = BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args, cp_size=1)
    with pytest.warns(UserWarning, match="seq_dims"):
        plain._prepare_context_parallel_inputs(plain.model, dict(batch))
    told = BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args, cp_size=1, seq_dims={"per_layer_inputs": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, sharded = told._prepare_context_parallel_inputs(told.model, dict(batch))
    assert sharded["per_layer_inputs"].shape == (1, 5, 2, 3)
    with pytest.raises(ValueError, match="non-negative"):
        BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args, cp_size=1, seq_dims={"per_layer_inputs": -1})


@pytest.mark.parametrize("script, argv", [("train_trainer.py", ["--cp", "2"])])  # every example: launch.require_torchrun
@pytest.mark.slow
def test_examples_started_without_torchrun_say_how_in_one_line(script, argv):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *argv], capture_output=True, text=True,
                            timeout=hang_timeout(120), cwd=ROOT, env=env)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "torchrun --standalone --nproc-per-node" in lines[0], lines


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_one_line_from_rank_0():
    """dp=2 (x cp=1) with even_batches=False: every rank refuses at construction, rank 0 says it once."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "train_trainer.py"), "--cp", "1", "--uneven-batches"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_timeout(300), cwd=ROOT)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "even_batches=True" in ours[0], ours
    assert output.count("ValueError") == 1, output[-3000:]  # no rank's traceback, only torchrun's own summary


def test_linear_ce_refuses_what_it_does_not_compute_exactly(trainer_example, tmp_path):
    """``linear_ce=True``: the Trainer's own loss only; a compute_loss_func, whole batches, SFT (whose loss already
    never holds the logits), a softcapped head, and a flag that is no bool are refused at construction, by name."""
    from blockdiag_cp.errors import CPTypeError

    args = arguments(trainer_example, tmp_path)
    accepted = BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args, cp_size=1, linear_ce=True)
    assert accepted.linear_ce and not BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args).linear_ce
    with pytest.raises(CPTypeError, match="linear_ce must be a bool"):
        BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args, linear_ce="yes")
    with pytest.raises(ValueError, match="linear_ce=True is not verified with a compute_loss_func"):
        BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args, linear_ce=True,
                           compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)
    with pytest.raises(ValueError, match="linear_ce=True is not verified with whole_batch=True"):
        BlockDiagCPTrainer(model=trainer_example.tiny_llama(), args=args, linear_ce=True, whole_batch=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="softcap"):
        BlockDiagCPTrainer(model=gemma, args=args, linear_ce=True)
    # the other kinds' strategies refuse it first thing (TRL's trainers already never hold the logits)
    from blockdiag_cp import CPConfig
    from blockdiag_cp.hf.trainer_rows import SFTRowsStrategy
    from blockdiag_cp.hf.trainer_scoring import GeneratingStrategy, ScoringStrategy

    stand_in = types.SimpleNamespace(linear_ce=True, cp_mesh=None, cp_config=CPConfig())
    with pytest.raises(ValueError, match="SFTTrainer's loss .* already never holds the logits"):
        SFTRowsStrategy(stand_in).adopt([], "here")
    for strategy in (ScoringStrategy, GeneratingStrategy):
        with pytest.raises(ValueError, match="scores rows through TRL's fused LM head"):
            strategy(stand_in).adopt([], "here")
