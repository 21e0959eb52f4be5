"""The axolotl plugin (issue #48): axolotl's own CLI on a YAML with the plugin at context_parallel_size 2 (gloo ranks)
equals the same YAML without the plugin and without CP in one process (every logged step's loss and grad norm, every
evaluation's loss, the final parameters); a changed document moves no other document's loss; the options the plugin
has not verified are refused by name. Needs axolotl (``pip install -e ".[axolotl]"``, docs/axolotl.md); skipped
without it.
"""

import concurrent.futures

import pytest
import torch
import yaml

pytest.importorskip("axolotl")

from axolotl_runs import PLUGIN, launch, leak_worker, results, with_cp, write_inputs  # noqa: E402

from blockdiag_cp.integrations.axolotl import BlockDiagCPPlugin, refusal  # noqa: E402

#: float32 (axolotl loads the model in float32 on CPU): reduction order alone moved losses and grad norms 2e-7 and the
#: parameters 1.3e-6 (four AdamW steps) here; other batches moved them 1e-3 and the parameters 0.26
LOSS_TOL, PARAM_TOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """axolotl's run without CP (one process) and the plugin's at context_parallel_size 2 (torchrun, gloo), launched
    side by side (each prepares its own copy of the data), then what they left."""
    root = tmp_path_factory.mktemp("axolotl")
    cfg = write_inputs(root)
    plain = {**cfg, "output_dir": str(root / "plain"), "dataset_prepared_path": str(root / "prepared_plain")}
    cp = with_cp({**cfg, "dataset_prepared_path": str(root / "prepared_cp")}, root / "cp")
    for name, run_cfg in (("plain", plain), ("cp", cp)):
        (root / f"{name}.yml").write_text(yaml.safe_dump(run_cfg))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = [pool.submit(launch, root / f"{name}.yml", nproc, root / f"{name}.log") for name, nproc in
                (("plain", 1), ("cp", 2))]
        for future in done:
            future.result()
    out = {"start": results(root / "model", history=False)["params"]}
    for name in ("plain", "cp"):
        out[name] = results(root / name)
        out[name]["log"] = (root / f"{name}.log").read_text()
    return out


@pytest.mark.slow
def test_axolotl_cli_at_cp2_equals_axolotl_without_cp(runs):
    plain, cp = runs["plain"], runs["cp"]
    assert f"Plugin loaded successfully: {PLUGIN}" in cp["log"] and PLUGIN not in plain["log"]
    assert len(cp["steps"]) == len(plain["steps"]) >= 3, (cp["steps"], plain["steps"])  # axolotl sized both runs alike
    for got, want in zip(cp["steps"], plain["steps"]):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= LOSS_TOL * abs(want[key]), (got["step"], key, got[key], want[key])
    assert len(cp["evals"]) == len(plain["evals"]) >= 2
    for got, want in zip(cp["evals"], plain["evals"]):
        assert abs(got["eval_loss"] - want["eval_loss"]) <= LOSS_TOL * want["eval_loss"], (got, want)
    moved = float((cp["params"] - plain["params"]).norm() / plain["params"].norm())
    trained = float((plain["params"] - runs["start"]).norm() / runs["start"].norm())
    assert moved <= PARAM_TOL < trained, (moved, trained)


@pytest.mark.slow
def test_a_changed_document_moves_no_other_documents_loss(tmp_path):
    from blockdiag_cp.testing import spawn

    got = spawn(leak_worker, 2, str(tmp_path), 2, timeout=600)[0]
    assert got["trainer"] == "BlockDiagCPAxolotlTrainer"
    assert "attention_mask" not in got["keys"] and "position_ids" in got["keys"], got["keys"]
    assert got["changed_inside"] > 0 and got["changed_elsewhere"] == 0 and got["max_elsewhere"] == 0.0, got  # bit for bit
    assert got["targets"] > 100, got


def yaml_of(**changes) -> dict:
    base = {"plugins": [PLUGIN], "context_parallel_size": 2, "sample_packing": True, "attn_implementation": "sdpa"}
    return {**base, **changes}


@pytest.mark.parametrize("changes, named", [
    ({"ring_attn_func": "varlen_llama3"}, "ring_attn_func"),
    ({"heads_k_stride": 1}, "heads_k_stride"),
    ({"sample_packing": False}, "sample_packing"),
    ({"eval_sample_packing": False}, "eval_sample_packing"),
    ({"multipack_real_batches": False}, "multipack_real_batches"),
    ({"attn_implementation": "flash_attention_2"}, "attn_implementation"),
    ({"attn_implementation": None}, "attn_implementation"),
    ({"flash_attention": True}, "flash_attention"),
    ({"rl": "dpo"}, "rl"),
    ({"adapter": "lora"}, "adapter"),
    ({"deepspeed": "zero2.json"}, "deepspeed"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"chunked_cross_entropy": True}, "chunked_cross_entropy"),
    ({"gradient_checkpointing": "offload"}, "gradient_checkpointing"),
    ({"plugins": [PLUGIN, "axolotl.integrations.liger.LigerPlugin"]}, "LigerPlugin"),
])
def test_options_the_plugin_has_not_verified_are_refused_by_name(changes, named):
    cfg = yaml_of(**changes)
    assert named in (refusal(cfg) or "")
    with pytest.raises(ValueError, match=named):
        BlockDiagCPPlugin().register(cfg)


def test_context_parallel_size_becomes_the_mixins_cp_size_and_axolotls_own_is_off():
    for key in ("context_parallel_size", "sequence_parallel_degree"):
        cfg = {**yaml_of(context_parallel_size=None), key: 4}
        plugin = BlockDiagCPPlugin()
        plugin.register(cfg)
        assert plugin.cp_size == 4 and cfg["context_parallel_size"] == 1 and "sequence_parallel_degree" not in cfg
    assert refusal(yaml_of(tensor_parallel_size=1, gradient_checkpointing=True)) is None
    with pytest.raises(ValueError, match="context_parallel_size"):
        BlockDiagCPPlugin().register(yaml_of(context_parallel_size=0))


def test_the_trainer_class_is_axolotls_with_the_mixin_and_cp_size_bound():
    from axolotl.core.trainers import AxolotlTrainer

    from blockdiag_cp.trainer import BlockDiagCPMixin

    plugin = BlockDiagCPPlugin()
    plugin.register(yaml_of())
    cls = plugin.get_trainer_cls(None)
    assert issubclass(cls, AxolotlTrainer) and cls.__mro__[1] is BlockDiagCPMixin
    with pytest.raises(ValueError, match="world size equal to context_parallel_size"):
        cls(model=torch.nn.Linear(1, 1))  # one process, cp 2: refused before anything is built
