"""Tiny configs for every causal LM of the installed transformers, from its defaults alone.

Note [Tiny generic configs]
---------------------------
The zoo sweep (zoo.py) builds each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` from
its config class's *defaults*, shrunk by field name, never grown:

- sizes by name (`SHRINK`): vocabularies to 128, hidden sizes to 32, feed-forward sizes
  to 64, head dims to 8, layers to 2, heads to 4 (key/value heads to 2 where the model
  groups them), experts to 4, positions to 256, windows to 4 (shorter than the
  documents: windows are exercised), MLA ranks to 16;
- token ids past the shrunk vocabulary move to its top (120 and up; rows draw their
  tokens from [1, 100));
- per-layer lists (``layer_types``, ``no_rope_layers``, ...: any list as long as the
  default layer count) keep the first layer of each distinct combination, so a hybrid
  keeps one layer of each kind (at least 2 layers);
- sub-configs (a VLM's text and vision configs) are shrunk the same way;
- ``is_decoder`` is set (the BERT family is a causal LM only as a decoder), and a value head
  dim that differs from the query/key one by default still differs (MiMo-V2-Flash).

A few types need one more field to build at all (`ADJUST`, each with its reason). A type
whose tiny config still does not build, or builds more than `MAX_PARAMETERS` parameters
(its sub-configs use field names no rule knows), is skipped by the sweep with the reason.
"""

from __future__ import annotations

import inspect
import re
import types
from typing import Any, Mapping, Optional

#: (pattern on the field name, tiny value): the first match wins; a field is only ever made smaller
SHRINK: tuple[tuple[str, int], ...] = (
    (r"(^|_)vocab_size($|_)|^vocab_size_per_layer_input$", 128),
    (r"token_(id|index)$|^(bos|eos|pad|sep|cls|mask|unk|decoder_start)_token_id$", -1),  # -1: moved to the top
    (r"^(num_hidden_layers|n_layers?|num_layers|decoder_layers|encoder_layers)$", 2),
    (r"^(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num)$", -2),  # -2: 2 if grouped, else 4
    (r"^(num_attention_heads|n_heads?|num_heads|decoder_attention_heads|encoder_attention_heads)$", 4),
    (r"^(qk_nope_head_dim|qk_rope_head_dim|v_head_dim|index_head_dim)$", 8),
    (r"^qk_head_dim$", 16),
    (r"^(q_lora_rank|kv_lora_rank|o_lora_rank)$", 16),
    (r"head_dim$|^dim_head$|^d_kv$|^d_head$|^kv_channels$|^rotary_dim$|^attention_head_size$", 8),
    (r"moe_intermediate_size|expert.*(size|dim)|shared.*intermediate_size", 32),
    (r"intermediate_size|ffn|^d_ff$|^dim_ff$|^n_inner$|^mlp_dim$|^d_inner$|^dff$", 64),
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$", 4),
    (r"^num_experts_per_tok$|^top_k$|^moe_topk$|^moe_k$|^num_experts_per_token$", 2),
    (r"^(n_shared_experts|num_shared_experts|topk_group|n_group|num_group|n_groups|mamba_n_groups)$", 1),
    (r"^(hidden_size|n_embd|n_embed|d_model|dim|embed_dim|emb_dim|embedding_size|hidden_dim|word_embed_proj_dim|"
     r"attention_hidden_size|text_hidden_size|out_hidden_size|projection_dim)$", 32),
    (r"position_embeddings$|^n_positions$|^n_ctx$|^max_(sequence_length|seq_len|source_positions|target_positions)$", 256),
    (r"^(sliding_window|sliding_window_size|attention_window|local_attention|window_size)$", 4),
    (r"^image_size$", 32),
    (r"^patch_size$", 8),
    (r"^(mamba_d_state|ssm_state_size|state_size|d_state)$", 8),
    (r"^(mamba_n_heads|mamba_num_heads)$", 4),
    (r"^(mamba_d_head|mamba_head_dim)$", 16),
    (r"^(mamba_d_ssm)$", 64),
    (r"^(time_step_rank|mamba_dt_rank)$", 8),
    (r"^(linear_num_key_heads)$", 2),
    (r"^(linear_num_value_heads)$", 4),
    (r"^(linear_key_head_dim|linear_value_head_dim)$", 8),
)
#: fields whose default None would not build (the model reads them as numbers): their tiny value
WHEN_NONE: Mapping[str, int] = types.MappingProxyType({
    "head_dim": 8, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1})
#: the tiny vocabulary: token ids past it move to its top; rows draw their tokens below `ROW_TOKENS`
TINY_VOCAB, ROW_TOKENS = 128, 100
#: a tiny config must build fewer parameters than this, else the type is skipped (sub-configs no rule shrinks)
MAX_PARAMETERS = 2_000_000
#: per model type, what its tiny config needs beyond the rules to build, and why
ADJUST: Mapping[str, tuple[dict, str]] = types.MappingProxyType({
    "reformer": (dict(is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=[16, 16],
                      axial_pos_embds_dim=[16, 16]), "ReformerModelWithLMHead needs is_decoder"),
    "xmod": (dict(default_language="en_XX"), "X-MOD needs a default language adapter"),
    "lfm2_moe": (dict(layer_types=["conv", "full_attention"]), "its default has no layer kinds to build"),
    "mamba2": (dict(num_heads=8), "Mamba2 needs num_heads x head_dim = expand x hidden_size"),
    "gemma4_assistant": (dict(hidden_size_per_layer_input=0), "its own validator wants 0 (its default is not)"),
})


def tiny_config(model_type: str, model_class: Optional[type] = None, overrides: Mapping[str, Any] = {}) -> Any:
    """The config of `model_type` from its class's defaults, shrunk (Note [Tiny generic configs]), with
    `overrides` passed to its constructor; for a `model_class` built from one of its sub-configs
    (``Qwen3_5ForCausalLM`` of ``qwen3_5``), that sub-config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    extra, _ = ADJUST.get(model_type, ({}, ""))
    config = config_class(**{**tiny_kwargs(config_class), **extra, **overrides})
    wanted = getattr(model_class, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for name in getattr(config_class, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, wanted):
            return sub
    return config


def tiny_kwargs(config_class: type) -> dict[str, Any]:
    """The shrunk constructor arguments of `config_class` (its defaults, then `SHRINK`)."""
    default = config_class()
    accepted = set(inspect.signature(config_class.__init__).parameters) | set(vars(default))
    fields = {k: v for k, v in vars(default).items() if not k.startswith("_") and k in accepted}
    kwargs: dict[str, Any] = {}
    for name, value in fields.items():
        shrunk = _shrink(name, value, fields)
        if shrunk:
            kwargs[name] = shrunk[0]
        elif value is None and name in WHEN_NONE:
            kwargs[name] = WHEN_NONE[name]
    kwargs.update(_per_layer_lists(fields, kwargs))
    if "is_decoder" in fields:
        kwargs["is_decoder"] = True  # the BERT family is a causal LM only as a decoder
    if {"head_dim", "v_head_dim"} <= set(fields) and "qk_nope_head_dim" not in fields and fields["head_dim"] != fields[
            "v_head_dim"]:
        kwargs["head_dim"] = 2 * kwargs.get("v_head_dim", fields["v_head_dim"])  # keep the value head dim apart
    for name, sub_class in _sub_config_classes(config_class, default).items():
        kwargs[name] = tiny_kwargs(sub_class)
    _move_token_ids(kwargs, fields)
    return kwargs


def _shrink(name: str, value: Any, fields: Mapping[str, Any]) -> tuple:
    """``(tiny value,)`` for a field `SHRINK` makes smaller, else ``()`` (kept)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return ()
    for pattern, tiny in SHRINK:
        if re.search(pattern, name):
            if tiny == -1:
                return (value if value < TINY_VOCAB else None,)  # a token id: moved by _move_token_ids
            if tiny == -2:  # key/value heads: grouped stays grouped (2 of 4), else as many as the queries
                heads = fields.get("num_attention_heads")
                return (2 if isinstance(heads, int) and value < heads else 4,)
            return (tiny,) if value > tiny else ()
    return ()


def _move_token_ids(kwargs: dict[str, Any], fields: Mapping[str, Any]) -> None:
    """Token ids the shrink marked (None) get distinct ids at the top of the tiny vocabulary."""
    free = iter(range(TINY_VOCAB - 1, ROW_TOKENS, -1))
    for name in sorted(fields):
        if name in kwargs and kwargs[name] is None and isinstance(fields[name], int):
            kwargs[name] = 0 if name == "pad_token_id" else next(free)


def _per_layer_lists(fields: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Per-layer lists cut to one layer of each distinct combination (at least 2 layers), and the layer count."""
    layers_field = next((n for n in ("num_hidden_layers", "n_layer", "n_layers", "num_layers") if n in fields), None)
    if layers_field is None or not isinstance(fields[layers_field], int):
        return {}
    count = fields[layers_field]
    lists = {n: v for n, v in fields.items()
             if isinstance(v, (list, tuple)) and len(v) == count and count > 2 and not _indices(v)}
    if not lists:
        return {}
    keep: list[int] = []
    seen: set = set()
    for i in range(count):
        combination = tuple(repr(v[i]) for v in lists.values())
        if combination not in seen:
            seen.add(combination)
            keep.append(i)
    keep = keep if len(keep) >= 2 else keep + [i for i in range(count) if i not in keep][: 2 - len(keep)]
    cut = {n: type(v)(v[i] for i in keep) for n, v in lists.items()}
    return {**cut, layers_field: len(keep)}


def _indices(values: Any) -> bool:
    """Whether `values` are layer indices (``moe_layers``), not one entry per layer."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values) and all(
        a < b for a, b in zip(values, values[1:]))


def _sub_config_classes(config_class: type, default: Any) -> dict[str, type]:
    """The sub-config fields of `config_class` (``text_config``, ``vision_config``, ...) and their classes."""
    found = {}
    for name in getattr(config_class, "sub_configs", {}) or {}:
        value = getattr(default, name, None)
        if value is not None and hasattr(value, "to_dict"):
            found[name] = type(value)
    return found
