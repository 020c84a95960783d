"""Model, optimizer and loss-scaler specs: small Python objects that become the
proto's ModelSpec, OptimizerConfig and ScalerConfig.

Unset (None) fields stay unset on the wire, so the server fills in the
default (PyTorch's for the optimizer, the policy's for the scaler) and
CreateJob returns the effective config.
"""
from dataclasses import KW_ONLY, dataclass, fields
from typing import Optional, Sequence, Tuple

from ampd.v1 import trainer_pb2 as pb


def _set(message, **values):
    for name, value in values.items():
        if value is not None:
            setattr(message, name, value)
    return message


@dataclass(frozen=True)
class Linear:
    in_features: int
    out_features: int
    bias: Optional[bool] = None  # default True

    def to_proto(self):
        return pb.Layer(linear=_set(pb.Linear(in_features=self.in_features,
                                              out_features=self.out_features), bias=self.bias))


@dataclass(frozen=True)
class ReLU:
    def to_proto(self):
        return pb.Layer(relu=pb.ReLU())


@dataclass(frozen=True)
class GELU:
    """PyTorch's GELU with approximate='none'."""

    def to_proto(self):
        return pb.Layer(gelu=pb.GELU())


@dataclass(frozen=True)
class Tanh:
    def to_proto(self):
        return pb.Layer(tanh=pb.Tanh())


@dataclass(frozen=True)
class LayerNorm:
    normalized_shape: int
    eps: Optional[float] = None  # default 1e-5
    elementwise_affine: Optional[bool] = None  # default True

    def to_proto(self):
        return pb.Layer(layer_norm=_set(pb.LayerNorm(normalized_shape=self.normalized_shape),
                                        eps=self.eps, elementwise_affine=self.elementwise_affine))


@dataclass(frozen=True)
class Embedding:
    """ids (N) -> (N, embedding_dim); only as the first layer."""
    num_embeddings: int
    embedding_dim: int

    def to_proto(self):
        return pb.Layer(embedding=pb.Embedding(num_embeddings=self.num_embeddings,
                                               embedding_dim=self.embedding_dim))


_LOSSES = {"mse": pb.LOSS_MSE, "cross_entropy": pb.LOSS_CROSS_ENTROPY}


@dataclass(frozen=True)
class Model:
    """A stack of layers and a loss ("mse" or "cross_entropy").

    Layer i's parameters are model.{i}.weight / model.{i}.bias in the state
    dict, as index i of the matching torch.nn.Sequential.
    """
    layers: Sequence
    loss: str = "mse"
    loss_multiplier: Optional[float] = None

    def to_proto(self):
        if self.loss not in _LOSSES:
            raise ValueError("loss must be one of %s, not %r" % (sorted(_LOSSES), self.loss))
        return _set(pb.ModelSpec(layers=[layer.to_proto() for layer in self.layers],
                                 loss=_LOSSES[self.loss]), loss_multiplier=self.loss_multiplier)


_LR_SCHEDULES = {"constant": pb.LR_SCHEDULE_CONSTANT,
                 "warmup_cosine": pb.LR_SCHEDULE_WARMUP_COSINE}


def _read_config(config):
    """A config.json's dict: config itself, or the file at that path."""
    if isinstance(config, dict):
        return config
    import json
    with open(config) as f:
        return json.load(f)


@dataclass(frozen=True)
class GPT:
    """A GPT-2-style decoder-only transformer (the fields of GPT2Config).

    Learned positions, pre-LayerNorm blocks (causal multi-head
    self-attention; MLP of mlp_ratio * d_model with tanh-approximated GELU),
    a final LayerNorm and the LM head (tied to the token embedding unless
    tie_embeddings=False). Batches are (B, T) int32/int64 token ids with
    T <= context_length, and (B, T) targets where -100 is ignored; the loss
    is the mean token cross-entropy. The state dict uses Hugging Face
    GPT-2's names and layouts (transformer.wte.weight,
    transformer.h.{i}.attn.c_attn.weight as (in, out), ...).
    Unset (None) fields take the server's defaults (4, 1e-5, True).
    """
    vocab_size: int
    context_length: int
    d_model: int
    n_layer: int
    n_head: int
    mlp_ratio: Optional[int] = None
    layer_norm_eps: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    loss_multiplier: Optional[float] = None

    @classmethod
    def from_hf_config(cls, config, **overrides):
        """The spec of a Hugging Face GPT-2 config.json (a path, or its dict):
        n_positions, n_embd, n_layer, n_head, n_inner, layer_norm_epsilon,
        tie_word_embeddings. Refused, naming the key: an activation other
        than gelu_new (the tanh GELU), n_inner not a multiple of n_embd,
        unscaled or layer-scaled attention, cross-attention. Dropout is a
        training-time choice ampd does not make (it trains without)."""
        config = _read_config(config)
        if config.get("model_type") != "gpt2":
            raise ValueError("model_type must be gpt2, not %r" % (config.get("model_type"),))
        act = config.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError("activation_function %r: the MLP's GELU is the tanh approximation "
                             "(gelu_new)" % (act,))
        for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("add_cross_attention", False)):
            if config.get(key, wanted) != wanted:
                raise ValueError("%s %r: only %r is supported" % (key, config[key], wanted))
        d_model = config["n_embd"]
        inner = config.get("n_inner") or 4 * d_model
        if inner % d_model:
            raise ValueError("n_inner %d: must be a multiple of n_embd %d" % (inner, d_model))
        values = dict(vocab_size=config["vocab_size"], context_length=config["n_positions"],
                      d_model=d_model, n_layer=config["n_layer"], n_head=config["n_head"],
                      mlp_ratio=inner // d_model,
                      layer_norm_eps=config.get("layer_norm_epsilon", 1e-5),
                      tie_embeddings=bool(config.get("tie_word_embeddings", True)))
        values.update(overrides)
        return cls(**values)

    def to_proto(self):
        gpt = _set(pb.Gpt(vocab_size=self.vocab_size, context_length=self.context_length,
                          d_model=self.d_model, n_layer=self.n_layer, n_head=self.n_head),
                   mlp_ratio=self.mlp_ratio, layer_norm_eps=self.layer_norm_eps,
                   tie_embeddings=self.tie_embeddings)
        return _set(pb.ModelSpec(gpt=gpt), loss_multiplier=self.loss_multiplier)


@dataclass(frozen=True)
class LoRA:
    """LoRA adapters on a Decoder's projections (PEFT's LoraConfig): each
    target W (out, in) is frozen and gains (alpha / rank) x A^T B^T with
    trainable A (rank, in) and B (out, rank). target_modules: of q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; None: the
    attention's four. PEFT's forms are taken too: a dotted suffix
    (self_attn.q_proj, mlp.down_proj) or "all-linear" (all seven; a string
    is one entry). Passed as Decoder(lora=...): it belongs to the decoder
    (its limits are the decoder's widths)."""
    rank: int
    alpha: float
    target_modules: Optional[Sequence[str]] = None

    def to_proto(self):
        modules = self.target_modules or ()
        if isinstance(modules, str):
            modules = (modules,)
        return pb.LoRA(rank=self.rank, alpha=self.alpha, target_modules=list(modules))


_ROPE_TYPES = {"default": pb.ROPE_TYPE_DEFAULT, "linear": pb.ROPE_TYPE_LINEAR,
               "llama3": pb.ROPE_TYPE_LLAMA3}
_LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE's frequency scaling, as transformers' rope_scaling (4.x) or
    rope_parameters (5.x) give it: rope_type "linear" (every frequency /
    factor) or "llama3" (Llama 3.1: low frequencies / factor, high ones kept,
    a blend between, with low_freq_factor, high_freq_factor and
    original_max_position_embeddings); "default" is no scaling."""
    rope_type: str
    factor: Optional[float] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    original_max_position_embeddings: Optional[int] = None

    def to_proto(self):
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError("rope_type: one of %s, not %r" % (sorted(_ROPE_TYPES), self.rope_type))
        return _set(pb.RopeScaling(rope_type=_ROPE_TYPES[self.rope_type]), factor=self.factor,
                    low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                    original_max_position_embeddings=self.original_max_position_embeddings)


def _rope_of_hf_config(config):
    """(rope_theta or None, RopeScaling or None) of a Hugging Face config in
    either style: transformers 4.x's rope_theta + rope_scaling, or 5.x's
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
    return theta, RopeScaling(rope_type, **values)


@dataclass(frozen=True)
class Decoder:
    """A Llama/Qwen2-family decoder-only transformer (the fields of Hugging
    Face's LlamaConfig / Qwen2Config).

    Token embeddings, pre-RMSNorm blocks (causal self-attention with rotary
    position embeddings and num_key_value_heads K/V heads shared by the
    query heads; a SwiGLU MLP down(silu(gate(x)) * up(x))), a final RMSNorm
    and the LM head (tied to the embedding with tie_word_embeddings).
    Batches as a GPT's: (B, T) token ids, T <= max_position_embeddings,
    targets -100 ignored. The state dict uses Hugging Face's names
    (model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight,
    ...). Biases: qkv_bias on q/k/v_proj (Qwen2 always; Llama's
    attention_bias), o_bias on o_proj (Llama's attention_bias). lora: a
    LoRA fine-tune (LoRA). Unset (None) fields take the server's defaults
    (Hugging Face's).
    """
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    tie_word_embeddings: Optional[bool] = None
    initializer_range: Optional[float] = None
    qkv_bias: Optional[bool] = None
    o_bias: Optional[bool] = None
    loss_multiplier: Optional[float] = None
    lora: Optional[LoRA] = None
    rope_scaling: Optional[RopeScaling] = None

    # The config.json keys this spec takes (the rest are checked or ignored:
    # see from_hf_config).
    _HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "tie_word_embeddings", "initializer_range")

    @classmethod
    def from_hf_config(cls, config, max_position_embeddings=None, **overrides):
        """The spec of a Hugging Face config.json (a path, or its dict):
        model_type "llama" (attention_bias biases q, k, v and o_proj) or
        "qwen2" (q, k, v biased, o_proj not). RoPE in either key style
        (transformers 4.x's rope_theta and rope_scaling, 5.x's
        rope_parameters), of rope_type default, linear or llama3. What the
        model would compute differently is refused, naming the key: another
        rope_type, partial_rotary_factor, a hidden_act other than silu,
        Llama's mlp_bias, Qwen2's sliding window. max_position_embeddings
        (and any field, by keyword) may be lowered for training on shorter
        sequences."""
        config = _read_config(config)
        model_type = config.get("model_type")
        if model_type not in ("llama", "qwen2"):
            raise ValueError("model_type must be llama or qwen2, not %r" % (model_type,))
        rope_theta, rope_scaling = _rope_of_hf_config(config)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError("hidden_act %r: the MLP is SwiGLU (silu)" % (config["hidden_act"],))
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias: the MLP's projections have no biases here")
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        values = {key: config[key] for key in cls._HF_KEYS if config.get(key) is not None}
        if rope_theta is not None:
            values["rope_theta"] = rope_theta
        if rope_scaling is not None:
            values["rope_scaling"] = rope_scaling
        if model_type == "llama":
            bias = bool(config.get("attention_bias", False))
            values.update(qkv_bias=bias, o_bias=bias)
        else:
            values.update(qkv_bias=True, o_bias=False)
        if max_position_embeddings is not None:
            values["max_position_embeddings"] = max_position_embeddings
        values.update(overrides)
        return cls(**values)

    def to_proto(self):
        decoder = _set(pb.Decoder(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                  intermediate_size=self.intermediate_size,
                                  num_hidden_layers=self.num_hidden_layers,
                                  num_attention_heads=self.num_attention_heads,
                                  max_position_embeddings=self.max_position_embeddings),
                       num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                       rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                       tie_word_embeddings=self.tie_word_embeddings,
                       initializer_range=self.initializer_range, qkv_bias=self.qkv_bias,
                       o_bias=self.o_bias)
        if self.lora is not None:
            decoder.lora.CopyFrom(self.lora.to_proto())
        if self.rope_scaling is not None:
            decoder.rope_scaling.CopyFrom(self.rope_scaling.to_proto())
        return _set(pb.ModelSpec(decoder=decoder), loss_multiplier=self.loss_multiplier)


@dataclass(frozen=True)
class _Optimizer:
    """lr_schedule (keyword only): "constant" (the default) or "warmup_cosine",
    nanoGPT's get_lr over the applied update count: linear warmup over
    warmup_steps (default 0), cosine decay to min_lr (default lr / 10) at
    decay_steps (required, > warmup_steps), min_lr after."""
    lr: Optional[float] = None
    weight_decay: Optional[float] = None
    max_grad_norm: Optional[float] = None  # clip the unscaled gradients' L2 norm; <= 0 off
    _: KW_ONLY
    lr_schedule: Optional[str] = None
    warmup_steps: Optional[int] = None
    decay_steps: Optional[int] = None
    min_lr: Optional[float] = None

    def _with_schedule(self, message):
        if self.lr_schedule is not None:
            if self.lr_schedule not in _LR_SCHEDULES:
                raise ValueError("lr_schedule: expected one of %s, got %r"
                                 % (", ".join(_LR_SCHEDULES), self.lr_schedule))
            message.lr_schedule = _LR_SCHEDULES[self.lr_schedule]
        return _set(message, warmup_steps=self.warmup_steps, decay_steps=self.decay_steps,
                    min_lr=self.min_lr)


@dataclass(frozen=True)
class SGD(_Optimizer):
    momentum: Optional[float] = None
    dampening: Optional[float] = None
    nesterov: Optional[bool] = None

    def to_proto(self):
        return self._with_schedule(_set(
            pb.OptimizerConfig(kind=pb.OPTIMIZER_SGD), lr=self.lr,
            weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm,
            momentum=self.momentum, dampening=self.dampening, nesterov=self.nesterov))


@dataclass(frozen=True)
class Adam(_Optimizer):
    betas: Optional[Tuple[float, float]] = None
    eps: Optional[float] = None
    _kind = pb.OPTIMIZER_ADAM

    def to_proto(self):
        beta1, beta2 = self.betas if self.betas is not None else (None, None)
        return self._with_schedule(_set(
            pb.OptimizerConfig(kind=self._kind), lr=self.lr, weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm, beta1=beta1, beta2=beta2, eps=self.eps))


@dataclass(frozen=True)
class AdamW(Adam):
    _kind = pb.OPTIMIZER_ADAMW


_POLICIES = {"pytorch": pb.SCALER_POLICY_PYTORCH, "paddle": pb.SCALER_POLICY_PADDLE,
             "deepspeed": pb.SCALER_POLICY_DEEPSPEED, "megatron": pb.SCALER_POLICY_MEGATRON,
             "adaptive": pb.SCALER_POLICY_ADAPTIVE}


@dataclass(frozen=True)
class Scaler:
    """The dynamic loss scaler: a policy and any of its hyperparameters.

    Field names are the proto's; each policy maps them to its own (see the
    proto's ScalerConfig comments).
    """
    policy: str = "pytorch"
    enabled: Optional[bool] = None
    dynamic: Optional[bool] = None
    init_scale: Optional[float] = None
    growth_factor: Optional[float] = None
    backoff_factor: Optional[float] = None
    growth_interval: Optional[int] = None
    hysteresis: Optional[int] = None
    consecutive_hysteresis: Optional[bool] = None
    raise_at_min_scale: Optional[bool] = None
    min_scale: Optional[float] = None
    max_scale: Optional[float] = None
    overflow_margin_log2: Optional[int] = None  # adaptive only
    underflow_threshold: Optional[float] = None  # adaptive only
    per_layer_scales: Optional[bool] = None  # adaptive only: a scale per Linear group or GPT block

    def to_proto(self):
        if self.policy not in _POLICIES:
            raise ValueError("policy must be one of %s, not %r" % (sorted(_POLICIES), self.policy))
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "policy"}
        return _set(pb.ScalerConfig(policy=_POLICIES[self.policy]), **values)


PRECISIONS = {"fp32": pb.PRECISION_FP32, "fp16": pb.PRECISION_FP16, "bf16": pb.PRECISION_BF16}


def precision_proto(precision):
    if precision not in PRECISIONS:
        raise ValueError("precision must be one of %s, not %r" % (sorted(PRECISIONS), precision))
    return PRECISIONS[precision]
