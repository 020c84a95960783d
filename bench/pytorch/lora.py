"""Hand-written LoRA (as PEFT computes it) over bench/pytorch/decoder.py's Decoder.

The reference ampd's LoRA jobs are checked against, without peft installed.
Each target projection W (out, in) is frozen and wrapped:
    y = x W^T (+ b) + (alpha / r) * (x A^T) B^T
with trainable A (r, in) and B (out, r): PEFT's LoraLayer with
lora_dropout 0 and its default init (A kaiming_uniform_(a=sqrt(5)), B
zeros), so a fresh adapter leaves the model's output unchanged. Every other
parameter is frozen too (PEFT's default: only the adapters train).

Names are PEFT's: the adapter of model.layers.{i}.self_attn.q_proj is
base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight (and
.lora_B.weight); adapter_config() is what PEFT's adapter_config.json holds
of it (r, lora_alpha, target_modules). merged_state_dict() gives the
Hugging Face state dict with W + (alpha / r) B A in place of each target.
"""

import math

import torch
import torch.nn as nn

# The projections a target may name, and where each lives in a Layer.
MODULES = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PEFT_PREFIX = "base_model.model."


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus (alpha / r) x A^T B^T."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        if not 1 <= rank <= min(base.in_features, base.out_features):
            raise ValueError(f"rank {rank} must be >= 1 and <= min(in, out) = "
                             f"{min(base.in_features, base.out_features)}")
        self.base = base
        self.scaling = alpha / rank
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        # PEFT's reset_lora_parameters("default", True).
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A, (out, in)."""
        return self.base.weight + self.scaling * (self.lora_B.weight @ self.lora_A.weight)


def apply_lora(model: nn.Module, rank: int, alpha: float, target_modules=DEFAULT_TARGETS):
    """Freezes every parameter of a decoder.Decoder and wraps each target
    projection of every layer in a LoraLinear (in layer order, then
    target_modules' order, which is also the order their A draws from
    torch's generator). Returns the model."""
    for name in target_modules:
        if name not in MODULES:
            raise ValueError(f"target module {name!r}: one of {', '.join(MODULES)}")
    if len(set(target_modules)) != len(target_modules):
        raise ValueError(f"target_modules {list(target_modules)!r} repeats a name")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for name in target_modules:
            parent = getattr(layer, MODULES[name])
            setattr(parent, name, LoraLinear(getattr(parent, name), rank, alpha))
    model.lora_config = {"r": rank, "lora_alpha": alpha, "target_modules": list(target_modules)}
    return model


def _adapters(model: nn.Module):
    """(Hugging Face module path, LoraLinear) of every adapter, in apply order."""
    for i, layer in enumerate(model.model.layers):
        for name in model.lora_config["target_modules"]:
            path = f"model.layers.{i}.{MODULES[name]}.{name}"
            yield path, getattr(getattr(layer, MODULES[name]), name)


def adapter_state_dict(model: nn.Module) -> dict:
    """The adapters in PEFT's names (lora_A before lora_B, layer order)."""
    out = {}
    for path, lora in _adapters(model):
        out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = lora.lora_A.weight.detach().clone()
        out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = lora.lora_B.weight.detach().clone()
    return out


def load_adapter_state_dict(model: nn.Module, state: dict) -> None:
    """Copies PEFT-named adapters into the model's; every adapter must be
    there, and nothing else."""
    expected = adapter_state_dict(model)
    if set(state) != set(expected):
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        raise KeyError(f"adapter state dict: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for path, lora in _adapters(model):
            for part in ("lora_A", "lora_B"):
                src = torch.as_tensor(state[f"{PEFT_PREFIX}{path}.{part}.weight"])
                getattr(lora, part).weight.copy_(src)


def adapter_config(model: nn.Module) -> dict:
    """What PEFT's adapter_config.json says of these adapters."""
    return dict(model.lora_config)


def merged_state_dict(model: nn.Module) -> dict:
    """The Hugging Face state dict with each target's weight merged
    (W + (alpha / r) B A) and no adapter keys."""
    merged = {path + ".weight": lora.merged_weight().detach() for path, lora in _adapters(model)}
    out = {}
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        name = name.replace(".base.", ".")
        out[name] = merged.get(name, tensor).detach().clone()
    return out
