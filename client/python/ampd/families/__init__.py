"""Model families as data: one small module per Hugging Face model_type
(gpt2.py, llama.py, qwen2.py, qwen3.py), each defining FAMILY, a Family that
maps its config.json onto the parts of an ampd spec (spec.GPT, or
spec.Decoder's biases, per-head q/k norm, RoPE scaling...), names the keys it
refuses (what the family would compute and ampd cannot), and writes back the
config.json transformers needs to open an export of a job with those parts.

Every module of this package whose name does not start with "_" is a family,
found at the first look-up: adding a family is adding its file here (and on
the server the parts it brings, if any). Nothing outside this package asks
which family a model is; the server only ever sees parts.
"""
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

_REGISTRY = {}  # model_type -> Family, filled on first use


@dataclass(frozen=True)
class Family:
    """One Hugging Face model_type.

    spec_of_config(config, overrides): the ampd spec of a config.json's dict,
      overrides (spec fields by keyword) applied last; ValueError naming the
      key for what it refuses.
    owns(model_spec): whether a job's effective pb.ModelSpec has exactly
      this family's parts (at most one family owns a spec).
    config_of_spec(model_spec): the config.json (a dict) transformers'
      AutoModelForCausalLM.from_pretrained needs for that spec.
    lora: whether LoRA adapters (PEFT's) apply to it."""
    model_type: str
    architecture: str
    spec_of_config: Callable
    owns: Callable
    config_of_spec: Callable
    lora: bool = True


def _families():
    if not _REGISTRY:
        for module in pkgutil.iter_modules(__path__):
            if module.name.startswith("_"):
                continue
            family = importlib.import_module("%s.%s" % (__name__, module.name)).FAMILY
            if family.model_type in _REGISTRY:
                raise RuntimeError("model_type %r: two families" % family.model_type)
            _REGISTRY[family.model_type] = family
    return _REGISTRY


def model_types():
    """The model_type of every family, sorted."""
    return sorted(_families())


def of_config(config):
    """The family of a config.json's dict, by its model_type."""
    model_type = config.get("model_type")
    family = _families().get(model_type)
    if family is None:
        raise ValueError("model_type %r: ampd reads %s" % (model_type, ", ".join(model_types())))
    return family


def of_spec(model_spec):
    """The family whose parts a pb.ModelSpec has (for an export)."""
    owners = [f for f in _families().values() if f.owns(model_spec)]
    if len(owners) > 1:
        raise RuntimeError("families %s all own one spec" % [f.model_type for f in owners])
    if not owners:
        kind = model_spec.WhichOneof("architecture") or "a layer stack"
        raise ValueError("%s with these parts is no Hugging Face family ampd writes (%s)"
                         % (kind, ", ".join(model_types())))
    return owners[0]
