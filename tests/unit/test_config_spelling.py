"""One spelling per knob (Note [One spelling per knob] in config.py): the component configs nested in `CPConfig`
and taken by `plan_shards`; the flat keywords of 0.10 still work, each with a `DeprecationWarning` naming the new
spelling, and mean exactly what the new spelling means."""

import dataclasses
import pickle

import pytest
import torch

from blockdiag_cp import CPConfig, HeadsConfig, PlanOptions, StepCosts, plan_shards
from blockdiag_cp.config import MOVED
from blockdiag_cp.testing import doc_ids_from_lengths

COSTS = StepCosts(token_seconds=4.0, pair_seconds=1.0)
#: a value for each flat keyword of 0.10, and the component config it belongs in
OLD = {"balance_window": 64, "ranks_per_node": 2, "token_cap": 1.5, "step_costs": COSTS, "ulysses_degree": 2,
       "attention_heads": (8, 2)}


def test_the_nested_spelling_holds_every_knob():
    config = CPConfig(layout="balanced", plan=PlanOptions(window=64, ranks_per_node=2, token_cap=1.5, costs=COSTS),
                      heads=HeadsConfig(ulysses_degree=2, attention_heads=(8, 2)))
    assert config.plan.window == 64 and config.plan.costs is COSTS and config.heads.ulysses_degree == 2
    assert CPConfig().plan == PlanOptions() and CPConfig().heads == HeadsConfig()
    assert pickle.loads(pickle.dumps(config)) == config
    assert dataclasses.replace(config, layout="contiguous").plan == config.plan
    assert [f.name for f in dataclasses.fields(CPConfig)] == ["kv_exchange", "kernel", "layout", "check_ranks_agree",
                                                             "plan", "heads"]


@pytest.mark.parametrize("old", sorted(OLD))
def test_each_flat_keyword_still_works_warns_and_names_its_new_spelling(old):
    component, knob = MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"CPConfig\({old}=\.\.\.\).*write CPConfig\({component}=\w+\({knob}="):
        config = CPConfig(layout="balanced", **{old: OLD[old]})
    new = {"plan": PlanOptions, "heads": HeadsConfig}[component]
    assert config == CPConfig(layout="balanced", **{component: new(**{knob: OLD[old]})})
    with pytest.warns(DeprecationWarning, match=rf"CPConfig\.{old} .*write CPConfig\.{component}\.{knob}"):
        assert getattr(config, old) == OLD[old]


def test_the_old_reader_of_the_plan_knobs_warns():
    config = CPConfig(plan=PlanOptions(token_cap=2.0))
    with pytest.warns(DeprecationWarning, match="CPConfig.plan_options"):
        assert config.plan_options() is config.plan


def test_a_knob_given_both_ways_or_a_wrong_component_is_refused():
    with pytest.raises(ValueError, match="both plan= and the deprecated token_cap="):
        CPConfig(plan=PlanOptions(), token_cap=2.0)
    with pytest.raises(ValueError, match="heads must be a HeadsConfig"):
        CPConfig(heads=PlanOptions())
    with pytest.raises(TypeError, match="unexpected keyword argument.*windows"):
        CPConfig(windows=3)
    with pytest.raises(ValueError, match="grouped layout gives ranks different lengths"):
        CPConfig(layout="grouped", heads=HeadsConfig(ulysses_degree=2))
    with pytest.raises(ValueError, match="not divisible by 3"):
        HeadsConfig(ulysses_degree=3, attention_heads=(8, 2))


@pytest.mark.parametrize("old, value", [("window", 4), ("ranks_per_node", 2), ("token_cap", 1.0), ("costs", COSTS)])
def test_plan_shards_keywords_still_work_and_warn(old, value):
    ids = doc_ids_from_lengths((30, 7, 1, 45, 9, 12))
    with pytest.warns(DeprecationWarning, match=rf"plan_shards\({old}=\.\.\.\).*options=PlanOptions\({old}="):
        before = plan_shards(ids, 3, "grouped", **{old: value})
    after = plan_shards(ids, 3, "grouped", options=PlanOptions(**{old: value}))
    assert torch.equal(before.positions, after.positions) and before.local_lens == after.local_lens
    with pytest.raises(ValueError, match="both options= and the deprecated"):
        plan_shards(ids, 3, "grouped", options=PlanOptions(), **{old: value})
