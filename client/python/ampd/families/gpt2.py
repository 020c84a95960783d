"""GPT-2 (GPT2LMHeadModel): learned positions, pre-LayerNorm blocks with
the tanh GELU, spec.GPT. Refused, naming the key: an activation other than
gelu_new, n_inner not a multiple of n_embd, unscaled or layer-scaled
attention, cross-attention. Dropout is a training-time choice ampd does not
make (it trains without). No LoRA: adapters are the decoders'."""
from ampd import spec
from ampd.families import Family

_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
_FIXED = (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
          ("add_cross_attention", False))


def _spec_of_config(config, overrides):
    act = config.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError("activation_function %r: the MLP's GELU is the tanh approximation "
                         "(gelu_new)" % (act,))
    for key, wanted in _FIXED:
        if config.get(key, wanted) != wanted:
            raise ValueError("%s %r: only %r is supported" % (key, config[key], wanted))
    d_model = config["n_embd"]
    inner = config.get("n_inner") or 4 * d_model
    if inner % d_model:
        raise ValueError("n_inner %d: must be a multiple of n_embd %d" % (inner, d_model))
    values = dict(vocab_size=config["vocab_size"], context_length=config["n_positions"],
                  d_model=d_model, n_layer=config["n_layer"], n_head=config["n_head"],
                  mlp_ratio=inner // d_model, layer_norm_eps=config.get("layer_norm_epsilon", 1e-5),
                  tie_embeddings=bool(config.get("tie_word_embeddings", True)))
    values.update(overrides)
    return spec.GPT(**values)


def _config_of_spec(model_spec):
    g = model_spec.gpt
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "vocab_size": g.vocab_size, "n_positions": g.context_length, "n_embd": g.d_model,
            "n_layer": g.n_layer, "n_head": g.n_head, "n_inner": g.mlp_ratio * g.d_model,
            "layer_norm_epsilon": g.layer_norm_eps, "tie_word_embeddings": g.tie_embeddings,
            "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "torch_dtype": "float32"}


FAMILY = Family("gpt2", "GPT2LMHeadModel", _spec_of_config,
                owns=lambda model_spec: model_spec.WhichOneof("architecture") == "gpt",
                config_of_spec=_config_of_spec, lora=False)
