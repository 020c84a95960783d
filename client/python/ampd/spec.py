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


_MLP_ACTIVATIONS = {"silu": pb.MLP_ACTIVATION_SILU, "gelu_tanh": pb.MLP_ACTIVATION_GELU_TANH}


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


@dataclass(frozen=True)
class Decoder:
    """A Llama/Qwen2/Qwen3-family decoder-only transformer (the fields of
    Hugging Face's LlamaConfig / Qwen2Config / Qwen3Config), as parts.

    Token embeddings, pre-RMSNorm blocks (causal self-attention with rotary
    position embeddings and num_key_value_heads K/V heads shared by the
    query heads; a SwiGLU MLP down(silu(gate(x)) * up(x))), a final RMSNorm
    and the LM head (tied to the embedding with tie_word_embeddings).
    Batches as a GPT's: (B, T) token ids, T <= max_position_embeddings,
    targets -100 ignored. The state dict uses Hugging Face's names
    (model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight,
    ...). Biases: qkv_bias on q/k/v_proj (Qwen2 always; Llama's and
    Qwen3's attention_bias), o_bias on o_proj (Llama's and Qwen3's
    attention_bias). qk_norm: each q and k head RMSNorm-ed before RoPE
    (Qwen3's q_norm, k_norm; model.layers.{i}.self_attn.q_norm.weight and
    k_norm.weight of head_dim each). Gemma 3's parts: norm_unit_offset
    (every RMSNorm scales by 1 + w), mlp_activation "gelu_tanh" (GeGLU;
    default "silu"), sandwich_norms (post_attention_layernorm on the
    attention's output, pre_ and post_feedforward_layernorm around the MLP),
    scale_embeddings (x_0 times sqrt(hidden_size)), query_pre_attn_scalar
    (the attention scale's), sliding_layers (one bool per layer: it sees its
    last sliding_window keys, with RoPE base rope_local_theta). lora: a
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
    qk_norm: Optional[bool] = None
    norm_unit_offset: Optional[bool] = None
    mlp_activation: Optional[str] = None  # "silu" (default) or "gelu_tanh"
    sandwich_norms: Optional[bool] = None
    scale_embeddings: Optional[bool] = None
    query_pre_attn_scalar: Optional[float] = None
    sliding_layers: Optional[tuple] = None  # of bool, one per layer
    sliding_window: Optional[int] = None
    rope_local_theta: Optional[float] = None

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
                       o_bias=self.o_bias, qk_norm=self.qk_norm,
                       norm_unit_offset=self.norm_unit_offset,
                       sandwich_norms=self.sandwich_norms, scale_embeddings=self.scale_embeddings,
                       query_pre_attn_scalar=self.query_pre_attn_scalar,
                       sliding_window=self.sliding_window, rope_local_theta=self.rope_local_theta)
        if self.mlp_activation is not None:
            if self.mlp_activation not in _MLP_ACTIVATIONS:
                raise ValueError("mlp_activation %r: one of %s"
                                 % (self.mlp_activation, ", ".join(sorted(_MLP_ACTIVATIONS))))
            decoder.mlp_activation = _MLP_ACTIVATIONS[self.mlp_activation]
        if self.sliding_layers is not None:
            decoder.sliding_layers.extend(bool(v) for v in self.sliding_layers)
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
