"""What the decoder families (llama, qwen2, qwen3) share: the config.json keys
every one of them maps onto spec.Decoder as they are, RoPE in transformers
4.x's keys (rope_theta, rope_scaling) and 5.x's (rope_parameters), the
refusals common to them, and the config.json fields an export writes. A
family module gives only what is its own: the parts its keys set, the keys
it refuses, and the keys its export adds."""
from typing import Callable, NamedTuple

from ampd import spec
from ampd.families import Family
from ampd.v1 import trainer_pb2 as pb

# config.json keys taken by spec.Decoder under their own names.
_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "max_position_embeddings", "num_key_value_heads", "head_dim",
         "rms_norm_eps", "tie_word_embeddings", "initializer_range")


class Refused(NamedTuple):
    """A config key whose value ampd would compute differently: `ok(value)`
    false (the key absent is None) is refused as "KEY VALUE: why"."""
    key: str
    ok: Callable
    why: str


HIDDEN_ACT = Refused("hidden_act", lambda v: v in (None, "silu"), "the MLP is SwiGLU (silu)")
MLP_BIAS = Refused("mlp_bias", lambda v: not v, "the MLP's projections have no biases here")
SLIDING_WINDOW = Refused("use_sliding_window", lambda v: not v,
                         "sliding-window attention is not supported")
# transformers 5.x's per-layer attention kinds: every layer full attention.
LAYER_TYPES = Refused("layer_types", lambda v: all(t == "full_attention" for t in v or ()),
                      "every layer must be full_attention (no sliding window)")
COMMON = (HIDDEN_ACT,)


_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_of_config(config):
    """(rope_theta or None, spec.RopeScaling or None) of a Hugging Face config
    in either style: transformers 4.x's rope_theta + rope_scaling, or 5.x's
    rope_parameters (which holds rope_theta). What ampd would compute
    differently is refused, naming the key."""
    if config.get("rope_parameters") is not None:
        key, params = "rope_parameters", dict(config["rope_parameters"])
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("rope_parameters: one set for every layer is supported, not one per "
                             "layer type (%s)" % sorted(params))
        theta = params.pop("rope_theta", config.get("rope_theta"))
    else:
        key, params = "rope_scaling", dict(config.get("rope_scaling") or {})
        theta = config.get("rope_theta")
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError("partial_rotary_factor %r: RoPE rotates the whole head here" % (partial,))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in _ROPE_TYPES:
        raise ValueError("%s.rope_type %r: ampd computes default, linear and llama3 RoPE"
                         % (key, rope_type))
    known = {"default": (), "linear": ("factor",), "llama3": ("factor",) + _LLAMA3_KEYS}[rope_type]
    for name in sorted(params):
        if name not in known and params[name] is not None:
            raise ValueError("%s.%s: not read by rope_type %s, and ampd would compute without it"
                             % (key, name, rope_type))
    if rope_type == "default":
        return theta, None
    values = {name: params.get(name) for name in known}
    if rope_type == "llama3" and values["original_max_position_embeddings"] is None:
        # transformers' own fallback (standardize_rope_params).
        values["original_max_position_embeddings"] = config.get("max_position_embeddings")
    for name, value in values.items():
        if value is None:
            raise ValueError("%s.%s: rope_type %s needs it" % (key, name, rope_type))
    return theta, spec.RopeScaling(rope_type, **values)


def _rope_config(d):
    """RoPE in 4.x's keys (rope_theta, rope_scaling), which 5.x reads too."""
    config = {"rope_theta": d.rope_theta}
    if d.HasField("rope_scaling") and d.rope_scaling.rope_type != pb.ROPE_TYPE_DEFAULT:
        r = d.rope_scaling
        if r.rope_type == pb.ROPE_TYPE_LINEAR:
            config["rope_scaling"] = {"rope_type": "linear", "factor": r.factor}
        else:
            config["rope_scaling"] = {
                "rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings": r.original_max_position_embeddings}
    return config


def has_gemma_parts(d):
    """Whether a pb.Decoder has one of Gemma 3's parts (families/gemma3.py
    owns those; the Llama-style families none of them)."""
    return (d.norm_unit_offset or d.sandwich_norms or d.scale_embeddings
            or d.mlp_activation != pb.MLP_ACTIVATION_SILU or len(d.sliding_layers) > 0
            or d.HasField("query_pre_attn_scalar"))


def family(model_type, architecture, parts, owns, exported, refused=()):
    """A decoder Family. parts(config): the spec.Decoder fields the family's
    own keys set (biases, qk_norm); owns(decoder): whether a pb.Decoder has
    exactly its parts; exported(decoder): the config.json keys of its own
    (attention_bias...); refused: its Refused keys beyond COMMON."""
    refusals = COMMON + tuple(refused)

    def spec_of_config(config, overrides):
        for r in refusals:
            if not r.ok(config.get(r.key)):
                raise ValueError("%s %r: %s" % (r.key, config.get(r.key), r.why))
        rope_theta, rope_scaling = rope_of_config(config)
        values = {key: config[key] for key in _KEYS if config.get(key) is not None}
        if rope_theta is not None:
            values["rope_theta"] = rope_theta
        if rope_scaling is not None:
            values["rope_scaling"] = rope_scaling
        values.update(parts(config))
        values.update(overrides)
        return spec.Decoder(**values)

    def config_of_spec(model_spec):
        d = model_spec.decoder
        config = {"model_type": model_type, "architectures": [architecture],
                  "vocab_size": d.vocab_size, "hidden_size": d.hidden_size,
                  "intermediate_size": d.intermediate_size,
                  "num_hidden_layers": d.num_hidden_layers,
                  "num_attention_heads": d.num_attention_heads,
                  "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
                  "rms_norm_eps": d.rms_norm_eps,
                  "max_position_embeddings": d.max_position_embeddings,
                  "tie_word_embeddings": d.tie_word_embeddings,
                  "initializer_range": d.initializer_range, "hidden_act": "silu",
                  "torch_dtype": "float32"}
        config.update(_rope_config(d))
        config.update(exported(d))
        return config

    def owns_spec(model_spec):
        return (model_spec.WhichOneof("architecture") == "decoder"
                and not has_gemma_parts(model_spec.decoder) and owns(model_spec.decoder))

    return Family(model_type, architecture, spec_of_config, owns_spec, config_of_spec)
