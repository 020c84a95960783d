"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): the decoder with
Gemma's parts: every RMSNorm scales by 1 + w (norm_unit_offset), four norms
a block (input_layernorm; post_attention_layernorm on the attention's
output and pre_/post_feedforward_layernorm around the MLP: sandwich_norms),
the per-head q_norm and k_norm (qk_norm), a GeGLU MLP (gelu_pytorch_tanh),
the embedding scaled by sqrt(hidden_size), the attention scale
query_pre_attn_scalar^-1/2, and layer_types interleaving sliding_attention
layers (the last sliding_window keys, RoPE base rope_local_base_freq, no
scaling) with full_attention ones (rope_theta with its scaling). RoPE in
transformers 5.x's rope_parameters keyed by layer type, or 4.x's
rope_theta, rope_local_base_freq and rope_scaling; layer_types, or 4.x's
sliding_window_pattern. Refused: attn_logit_softcapping and
final_logit_softcapping when set, use_bidirectional_attention, another
hidden_activation, a layer type other than those two, a RoPE type other
than default on the sliding layers."""
from ampd import spec
from ampd.families import Family, _decoder
from ampd.v1 import trainer_pb2 as pb

# Gemma3TextConfig's defaults where a config.json leaves a key out.
_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
             "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
_GLOBAL_THETA, _LOCAL_THETA = 1000000.0, 10000.0  # Gemma3TextConfig.default_theta
_LAYER_TYPES = ("sliding_attention", "full_attention")

_REFUSED = (
    _decoder.Refused("hidden_activation", lambda v: v in (None, "gelu_pytorch_tanh"),
                     "the MLP is GeGLU with gelu's tanh form (gelu_pytorch_tanh)"),
    _decoder.Refused("attn_logit_softcapping", lambda v: v is None,
                     "attention-score soft-capping is not supported"),
    _decoder.Refused("final_logit_softcapping", lambda v: v is None,
                     "logit soft-capping is not supported"),
    _decoder.Refused("use_bidirectional_attention", lambda v: not v,
                     "attention is causal here"),
)


def _layer_types(config):
    types = config.get("layer_types")
    if types is None:  # transformers 4.x's older key, and the default 6
        pattern = config.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    for t in types:
        if t not in _LAYER_TYPES:
            raise ValueError("layer_types %r: ampd computes %s" % (t, " and ".join(_LAYER_TYPES)))
    return [t == "sliding_attention" for t in types]


def _rope(config):
    """(global theta, its spec.RopeScaling or None, local theta)."""
    params = config.get("rope_parameters")
    if params is not None and any(isinstance(v, dict) for v in params.values()):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", config.get("rope_theta", _GLOBAL_THETA))
        local.setdefault("rope_theta", config.get("rope_local_base_freq", _LOCAL_THETA))
    else:  # 4.x: rope_scaling applies to the full-attention layers
        full = dict(params or config.get("rope_scaling") or {})
        full.setdefault("rope_theta", config.get("rope_theta", _GLOBAL_THETA))
        local = {"rope_theta": config.get("rope_local_base_freq", _LOCAL_THETA)}
    theta, scaling = _decoder.rope_of_config({"rope_parameters": full,
                                              "max_position_embeddings":
                                                  config.get("max_position_embeddings")})
    local_type = local.pop("rope_type", None) or local.pop("type", None) or "default"
    local.pop("type", None)
    if local_type != "default" or set(local) - {"rope_theta"}:
        raise ValueError("rope_parameters.sliding_attention %r: the sliding layers' RoPE is "
                         "the default here" % (dict(local, rope_type=local_type),))
    return theta, scaling, local["rope_theta"]


def _spec_of_config(config, overrides):
    for r in _REFUSED:
        if not r.ok(config.get(r.key)):
            raise ValueError("%s %r: %s" % (r.key, config.get(r.key), r.why))
    config = dict(_DEFAULTS, **{k: v for k, v in config.items() if v is not None})
    values = {key: config[key] for key in _decoder._KEYS if config.get(key) is not None}
    theta, scaling, local_theta = _rope(config)
    values["rope_theta"] = theta
    if scaling is not None:
        values["rope_scaling"] = scaling
    bias = bool(config.get("attention_bias", False))
    values.update(qkv_bias=bias, o_bias=bias, qk_norm=True, norm_unit_offset=True,
                  mlp_activation="gelu_tanh", sandwich_norms=True, scale_embeddings=True,
                  query_pre_attn_scalar=float(config["query_pre_attn_scalar"]),
                  sliding_layers=tuple(_layer_types(config)),
                  sliding_window=int(config["sliding_window"]), rope_local_theta=local_theta)
    values.update(overrides)
    return spec.Decoder(**values)


def _owns(model_spec):
    if model_spec.WhichOneof("architecture") != "decoder":
        return False
    d = model_spec.decoder
    return (d.norm_unit_offset and d.sandwich_norms and d.scale_embeddings and d.qk_norm
            and d.mlp_activation == pb.MLP_ACTIVATION_GELU_TANH and d.qkv_bias == d.o_bias)


def _number(value):
    """An int where the value is one (Gemma3TextConfig's query_pre_attn_scalar
    is typed int, and transformers 5.x checks it)."""
    return int(value) if float(value).is_integer() else float(value)


def _config_of_spec(model_spec):
    d = model_spec.decoder
    full = {"rope_type": "default", "rope_theta": d.rope_theta}
    scaling = _decoder._rope_config(d).get("rope_scaling")
    if scaling is not None:
        full.update(scaling)
    sliding = list(d.sliding_layers) or [False] * d.num_hidden_layers
    head_dim = d.head_dim or d.hidden_size // d.num_attention_heads
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "vocab_size": d.vocab_size, "hidden_size": d.hidden_size,
            "intermediate_size": d.intermediate_size, "num_hidden_layers": d.num_hidden_layers,
            "num_attention_heads": d.num_attention_heads,
            "num_key_value_heads": d.num_key_value_heads, "head_dim": head_dim,
            "rms_norm_eps": d.rms_norm_eps, "max_position_embeddings": d.max_position_embeddings,
            "tie_word_embeddings": d.tie_word_embeddings,
            "initializer_range": d.initializer_range, "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": bool(d.qkv_bias),
            "query_pre_attn_scalar": _number(d.query_pre_attn_scalar or head_dim),
            "sliding_window": d.sliding_window or None,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": d.rope_local_theta}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False, "torch_dtype": "float32"}


FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", _spec_of_config, _owns, _config_of_spec)
