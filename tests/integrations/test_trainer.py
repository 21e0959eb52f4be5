"""transformers' Trainer, TRL's SFTTrainer and FSDP2 under block-diagonal CP, each against the run without CP.

The CP runs are real `torchrun` launches on gloo (the examples, as users run them);
the runs without CP are the same stack in this process, on the batches of every dp
replica (a single process sees exactly what the replicas see together).
"""

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from blockdiag_cp.testing import hang_timeout

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from examples_module import EXAMPLES, ROOT, example  # noqa: E402



def torchrun(nproc, script, *args, timeout=300, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(EXAMPLES / script), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_timeout(timeout), cwd=ROOT)
    if not check:
        return result
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{\"")]


def logged_run(lines, params_path):
    """What `run` returns, from the JSON lines and files a torchrun of an example wrote."""
    steps = [e for e in lines if "step" in e]
    evals = [e["eval_loss"] for e in lines if "eval_loss" in e]
    predictions = pathlib.Path(f"{params_path}.predictions")
    return {"loss": [e["loss"] for e in steps], "grad_norm": [e["grad_norm"] for e in steps],
            "tokens_seen": [e.get("tokens_seen") for e in steps], "num_tokens": [e.get("num_tokens") for e in steps],
            "eval_loss": evals[0] if evals else None, "params": torch.load(params_path),
            "total_flos": next((e["total_flos"] for e in lines if "total_flos" in e), None),
            "predictions": torch.load(predictions) if predictions.exists() else None}


def assert_same_predictions(got, want, lengths):
    """Row i holds eval document i (``lengths[i]`` tokens): equal there; after it, CP's -100 fill."""
    assert got.shape == want.shape, (got.shape, want.shape)
    for i, n in enumerate(lengths[: got.shape[0]]):
        torch.testing.assert_close(got[i, :n], want[i, :n], rtol=1e-4, atol=1e-4)
        assert bool((got[i, n:] == -100).all()), f"row {i}: padding positions are not filled with -100"


def assert_same_run(cp_lines, reference, params_path, loss_tol, param_tol, eval_lengths=None):
    """The CP run's logged steps, counts, evaluation, predictions and parameters against `reference`
    (whose rows must be padded as the CP run pads them: the Trainer's FLOP count reads padded sizes)."""
    got = logged_run(cp_lines, params_path)
    assert len(got["loss"]) == len(reference["loss"]) >= 4, (got["loss"], reference["loss"])
    for a, b in zip(got["loss"], reference["loss"]):
        assert abs(a - b) <= loss_tol * abs(b), (got["loss"], reference["loss"])
    for a, b in zip(got["grad_norm"], reference["grad_norm"]):
        assert abs(a - b) <= 50 * loss_tol * abs(b), (got["grad_norm"], reference["grad_norm"])
    for key in ("tokens_seen", "num_tokens"):  # counted once per replica: real tokens, not CP's row padding
        if reference.get(key) is not None and any(v is not None for v in reference[key]):
            assert got[key] == reference[key], (key, got[key], reference[key])
    if reference.get("total_flos") is not None:  # each replica's FLOPs counted once, not once per CP rank
        assert got["total_flos"] == pytest.approx(reference["total_flos"], rel=1e-6), (got["total_flos"], reference["total_flos"])
    if reference.get("eval_loss") is not None:
        assert got["eval_loss"] is not None and abs(got["eval_loss"] - reference["eval_loss"]) <= loss_tol * reference["eval_loss"]
    if reference.get("predictions") is not None:
        if eval_lengths is None:
            torch.testing.assert_close(got["predictions"], reference["predictions"], rtol=1e-4, atol=1e-4)
        else:
            assert_same_predictions(got["predictions"], reference["predictions"], eval_lengths)
    relative = float((got["params"] - reference["params"]).norm() / reference["params"].norm())
    assert relative <= param_tol, relative


#: whole epochs over sets that do not divide into batches: short last train and eval batches, with the
#: Trainer's defaults (dataloader_drop_last=False, accelerate's even_batches=True)
PARTIAL = ["--train-docs", "30", "--batch", "4", "--accum", "2", "--eval-docs", "7", "--eval-batch", "3",
           "--evaluate", "--predict"]


@pytest.mark.slow
def test_partial_last_batches_at_dp1_compiled_equal_the_run_without_cp(tmp_path):
    """dp=1 x cp=2, a stream of padding-free rows, activation checkpointing, TrainingArguments(
    torch_compile=True): without CP (and without compile) one process reads every batch as it comes,
    the short last one too (no samples repeated from the start); eval loss and predicted logits are
    the unsharded run's, through the compiled model (one opaque attention op per layer)."""
    trainer_example = example("train_trainer")
    common = [*PARTIAL, "--iterable", "--steps", "6", "--checkpointing"]  # a stream has no length: steps cross the epoch's end
    cp_lines = torchrun(2, "train_trainer.py", "--cp", "2", "--compile", "aot_eager", "--save", str(tmp_path / "p.pt"),
                        *common)
    reference = trainer_example.run(trainer_example.parse_args(["--cp", "0", *common]))
    assert_same_run(cp_lines, reference, tmp_path / "p.pt", loss_tol=2e-6, param_tol=1e-6)


@pytest.mark.slow
def test_a_hybrid_model_under_cp_trains_as_transformers_trainer_without_cp(tmp_path):
    """A tiny Nemotron-H (Mamba2 + attention) at cp=2, packed rows, checkpointing, against transformers'
    Trainer on padded rows (one document per row: its own layers are exact there). Float32: the
    two scans round differently (a state hand-off off by one token moves the parameters by 4e-5)."""
    trainer_example = example("train_trainer")
    common = ["--model", "nemotron_h", "--train-docs", "24", "--batch", "3", "--accum", "2", "--steps", "4",
              "--evaluate"]
    cp_lines = torchrun(2, "train_trainer.py", "--cp", "2", "--checkpointing", "--save", str(tmp_path / "p.pt"), *common)
    reference = trainer_example.run(trainer_example.parse_args(["--cp", "0", "--collator", "pad", *common]))
    reference["total_flos"] = None  # the padded rows' FLOP count is not the packed rows'
    assert_same_run(cp_lines, reference, tmp_path / "p.pt", loss_tol=1e-6, param_tol=2e-6)  # observed 9e-8, 4e-7


@pytest.mark.slow
def test_partial_last_batches_at_dp2_equal_plain_ddp(tmp_path):
    """dp=2 x cp=2 against plain DDP on 2 processes (accelerate completes the short last batches the
    same way in both), padded B > 1 rows, the contiguous layout, activation checkpointing: train, eval
    loss and the gathered, unsharded predictions."""
    common = [*PARTIAL, "--epochs", "2", "--collator", "pad", "--layout", "contiguous", "--checkpointing"]
    cp_lines = torchrun(4, "train_trainer.py", "--cp", "2", "--save", str(tmp_path / "p.pt"), *common)
    ddp_lines = torchrun(2, "train_trainer.py", "--cp", "0", "--save", str(tmp_path / "ddp.pt"), *common)
    reference = logged_run(ddp_lines, tmp_path / "ddp.pt")
    lengths = [len(d["input_ids"]) for d in example("train_trainer").documents(7, seed=1)]
    assert_same_run(cp_lines, reference, tmp_path / "p.pt", loss_tol=2e-6, param_tol=1e-6, eval_lengths=lengths)


@pytest.mark.slow
def test_trainer_head_parallel_bf16_on_a_stream_equals_the_run_without_cp(tmp_path):
    """dp=2 x cp=2 with the head all-to-all in pairs (ulysses_degree=2), bf16 autocast, padding-free
    rows of an iterable dataset (sharded over the dp replicas only). (Head-parallel exactness to
    1e-10 is `tests/distributed/test_ulysses.py`; this is the Trainer around it.)"""
    trainer_example = example("train_trainer")
    common = ["--steps", "4", "--accum", "2", "--bf16", "--evaluate", "--iterable", "--collator", "flatten",
              "--ulysses-degree", "2"]
    cp_lines = torchrun(4, "train_trainer.py", "--cp", "2", "--save", str(tmp_path / "p.pt"), *common)
    reference = trainer_example.run(trainer_example.parse_args(["--cp", "0", "--dp", "2", *common]))
    assert_same_run(cp_lines, reference, tmp_path / "p.pt", loss_tol=5e-3, param_tol=5e-3)


@pytest.mark.slow
def test_trl_sft_packing_equals_the_run_without_cp(tmp_path):
    """A whole epoch of packed rows in batches of 5 (a short last batch); TRL's logged num_tokens too."""
    pytest.importorskip("trl")
    sft_example = example("train_trl_sft")
    common = ["--epochs", "1", "--batch", "5", "--accum", "1"]
    cp_lines = torchrun(2, "train_trl_sft.py", "--cp", "2", "--save", str(tmp_path / "p.pt"), *common)
    reference = sft_example.run(sft_example.parse_args(["--cp", "0", *common]))
    assert_same_run(cp_lines, reference, tmp_path / "p.pt", loss_tol=2e-4, param_tol=1e-5)


@pytest.mark.slow
def test_no_token_loss_leaks_across_packed_documents_under_cp():
    """TRL issue 6843's probe: change one packed document's tokens; no other document's per-token loss moves."""
    pytest.importorskip("trl")
    lines = torchrun(2, "../tests/leak_probe.py")
    (report,) = [e for e in lines if "changed_elsewhere" in e]
    assert report["changed_inside"] > 0  # the edited document's own losses did change
    assert report["changed_elsewhere"] == 0, report


@pytest.mark.slow
def test_fsdp2_example_equals_the_single_process_run():
    fsdp2 = example("train_fsdp2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(EXAMPLES / "train_fsdp2.py"), "--dp", "2", "--cp", "2", "--steps", "3", "--seq-len", "256"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_timeout(300), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    logged = [float(x) for x in re.findall(r"step \d+/\d+  loss ([0-9.]+)", result.stdout)]
    reference = fsdp2.single_process_losses(dp=2, steps=3, seq_len=256)
    assert len(logged) == 3
    assert all(abs(a - b) <= 2e-4 * abs(b) for a, b in zip(logged, reference)), (logged, reference)


@pytest.mark.slow
def test_tp_cp_example_equals_the_single_process_run(tmp_path):
    """torchrun dp=1 x cp=2 x tp=2 (float32): losses, last gradients and final parameters."""
    tp_cp = example("train_tp_cp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(EXAMPLES / "train_tp_cp.py"), "--cp", "2", "--tp", "2", "--steps", "2", "--seq-len", "256",
           "--save", str(tmp_path / "run.pt")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_timeout(300), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    got, reference = torch.load(tmp_path / "run.pt"), tp_cp.single_process_run(dp=1, steps=2, seq_len=256)
    assert all(abs(a - b) <= 2e-6 * abs(b) for a, b in zip(got["losses"], reference["losses"])), (got, reference)
    for key, tol in (("grads", 2e-4), ("params", 1e-4)):
        worst = max(float((got[key][n] - t).norm() / t.norm()) for n, t in reference[key].items())
        assert worst <= tol, (key, worst)


def test_bad_settings_are_clear_errors():
    from blockdiag_cp.trainer import BlockDiagCPTrainer

    trainer_example = example("train_trainer")
    args = trainer_example.training_arguments(trainer_example.parse_args([]), "/tmp/blockdiag_cp_test")
    model = trainer_example.tiny_llama()
    with pytest.raises(ValueError, match="must divide the world size"):
        BlockDiagCPTrainer(model=model, args=args, train_dataset=trainer_example.documents(4), cp_size=2)
    with pytest.raises(TypeError, match="cp_size must be an int"):
        BlockDiagCPTrainer(model=model, args=args, cp_size="2")
    with pytest.raises(ValueError, match=">= 1"):
        BlockDiagCPTrainer(model=model, args=args, cp_size=0)
    from accelerate import ParallelismConfig

    args.parallelism_config = ParallelismConfig(cp_size=2)
    with pytest.raises(ValueError, match=r"cp_size=3 differ: set one"):
        BlockDiagCPTrainer(model=model, args=args, cp_size=3)
    args.parallelism_config = ParallelismConfig(cp_size=2, tp_size=2)
    with pytest.raises(ValueError, match=r"tp_size=2\) is not verified"):
        BlockDiagCPTrainer(model=model, args=args, cp_size=1)


def test_autocast_casts_like_sdpa_and_mismatches_still_raise():
    from blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    ids = torch.tensor([[1] * 5 + [2] * 3])
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": torch.zeros_like(ids), "_packed_seq_ids": ids})
    q = torch.randn(1, 2, 8, 4)
    v = torch.randn(1, 2, 8, 4).bfloat16()
    with ctx(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = cp_blockdiag_sdpa(q, q, v)  # RoPE left q/k in float32, v is bfloat16
    assert out.dtype == torch.bfloat16
    q_doc, v_doc = q[:, :, :5].bfloat16(), v[:, :, :5]
    expected = torch.nn.functional.scaled_dot_product_attention(q_doc, q_doc, v_doc, is_causal=True)
    assert torch.allclose(out[:, :, :5].float(), expected.float(), atol=2e-2)
    with ctx(), pytest.raises(ValueError, match="dtypes differ"):
        cp_blockdiag_sdpa(q, q, v)
    q64 = q.double()
    with ctx(), torch.autocast("cpu", dtype=torch.bfloat16):  # float64 stays float64, as SDPA keeps it
        out64 = cp_blockdiag_sdpa(q64, q64, q64)
        sdpa64 = torch.nn.functional.scaled_dot_product_attention(q64[:, :, :5], q64[:, :, :5], q64[:, :, :5],
                                                                  is_causal=True)
    assert out64.dtype == sdpa64.dtype == torch.float64
    assert torch.allclose(out64[:, :, :5], sdpa64, atol=1e-12)


def test_flatten_rows_keeps_documents_inside_rows():
    from blockdiag_cp.step.rows import flatten_rows

    batch = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
             "labels": torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])}
    flat = flatten_rows(batch)
    assert flat["input_ids"].tolist() == [[5, 6, 7, 0, 8, 9, 0, 0]]
    assert flat["_packed_seq_ids"].tolist() == [[1, 1, 1, 0, 2, 2, 0, 0]]
    assert flat["shift_labels"].tolist() == [[6, 7, -100, -100, 9, -100, -100, -100]]  # no target crosses a row
    assert flat["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert "attention_mask" not in flat


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def batches_and_remainder(loader):
    """The index batches a prepared loader yields, and the remainder accelerate computed for it."""
    out, remainder = [], None
    for batch in loader:
        out.append(batch.tolist())
        remainder = loader.remainder
    return out, remainder


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "stream"])
@pytest.mark.parametrize("dp, cp", [(1, 2), (1, 3), (2, 2)])
@pytest.mark.parametrize("even_batches", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [7, 12])
def test_every_cp_rank_reads_what_its_replica_reads_without_cp(iterable, dp, cp, even_batches, drop_last, n):
    """accelerate's loader prepared for dp x cp processes, re-pointed by the mixin, yields exactly the
    batches (and the remainder gather_for_metrics trims to) of the loader prepared for dp processes."""
    from accelerate.data_loader import prepare_data_loader

    from blockdiag_cp.trainer import _shard_over_dp

    def raw():
        data = Stream(n) if iterable else list(range(n))
        return torch.utils.data.DataLoader(data, batch_size=3, drop_last=drop_last)

    for rank in range(dp * cp):
        dp_rank = rank // cp
        ours = _shard_over_dp(prepare_data_loader(raw(), num_processes=dp * cp, process_index=rank,
                                                  even_batches=even_batches), dp, dp_rank, cp)
        without_cp = prepare_data_loader(raw(), num_processes=dp, process_index=dp_rank, even_batches=even_batches)
        assert batches_and_remainder(ours) == batches_and_remainder(without_cp), (rank, dp_rank)


class RepackedEachEpoch(torch.utils.data.Sampler):
    """A batch sampler whose batches depend on the epoch it is given (axolotl's multipack re-packs per epoch)."""

    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return iter([order[i:i + 3] for i in range(0, self.n, 3)])

    def __len__(self) -> int:
        return -(-self.n // 3)


@pytest.mark.parametrize("cp", [2, 3])
def test_each_epoch_reaches_a_wrapped_batch_sampler_at_dp1(cp):
    """At dp 1 every CP rank reads the batches the single process reads in each epoch, when the batch sampler
    re-packs per epoch: the Trainer's ``set_epoch`` on the prepared loader reaches the sampler accelerate wraps."""
    from accelerate.data_loader import prepare_data_loader

    from blockdiag_cp.trainer import _shard_over_dp

    def raw():
        return torch.utils.data.DataLoader(list(range(10)), batch_sampler=RepackedEachEpoch(10))

    without_cp = prepare_data_loader(raw(), num_processes=1, process_index=0)
    ranks = [_shard_over_dp(prepare_data_loader(raw(), num_processes=cp, process_index=r), 1, 0, cp) for r in range(cp)]
    seen = []
    for epoch in range(3):
        for loader in (without_cp, *ranks):
            loader.set_epoch(epoch)
        want = [b.tolist() for b in without_cp]
        seen.append(want)
        for rank, loader in enumerate(ranks):
            assert [b.tolist() for b in loader] == want, (epoch, rank)
    assert seen[0] != seen[1] != seen[2]  # the sampler did re-pack: the test can tell an epoch that did not arrive


@pytest.mark.slow
def test_the_sharded_recipe_resumes_as_it_would_have_run(tmp_path):
    """The README's recipe flags of `examples/train_trainer.py` on CPU: ZeRO-2 (``--zero``), the linear-CE loss, a
    checkpoint every 2 steps under ``--output-dir``. A job that died after its step-2 checkpoint (its step-4 one
    removed), started again with the same command, resumes there and ends with the parameters of the run that
    never stopped (FSDP2's ``--fsdp2`` is the GPU case)."""
    import shutil

    pytest.importorskip("deepspeed")
    run_dir = tmp_path / "run"
    recipe = ("--cp", "2", "--zero", "2", "--linear-ce", "--batch", "3", "--steps", "4", "--output-dir", str(run_dir),
              "--save-steps", "2")
    once = torchrun(2, "train_trainer.py", *recipe, "--save", str(tmp_path / "once.pt"))
    assert [e["step"] for e in once if "step" in e] == [1, 2, 3, 4]
    shutil.rmtree(run_dir / "checkpoint-4")  # the job died before its last checkpoint
    again = torchrun(2, "train_trainer.py", *recipe, "--save", str(tmp_path / "resumed.pt"))
    assert [e["loss"] for e in again if "step" in e][-2:] == [e["loss"] for e in once if "step" in e][2:]  # 3, 4
    first, resumed = torch.load(tmp_path / "once.pt"), torch.load(tmp_path / "resumed.pt")
    assert first.numel() > 1000 and torch.equal(resumed, first), float((resumed - first).abs().max())
