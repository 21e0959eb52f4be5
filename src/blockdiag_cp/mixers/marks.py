"""The attributes `prepare_model` (routing.py) sets on a model's modules, read by detect.py and verify.py."""

#: attribute set on a routed mixer instance: the layer kinds it serves (``("conv",)``)
ROUTED_KIND = "blockdiag_cp_mixer_kind"
#: attribute set on a prepared model and all its submodules: the layer kinds its mixers route
PREPARED_KINDS = "blockdiag_cp_routed_kinds"
#: the layer kind the size-only detection reports (a config without a layer-type list: Bamba, Falcon-H1)
STATE_SPACE = "state_space"
