"""Hugging Face folders in and out: a job made from what transformers'
save_pretrained writes (config.json, model.safetensors or sharded
model-0000k-of-0000n.safetensors with model.safetensors.index.json), a PEFT
adapter (adapter_config.json, adapter_model.safetensors) loaded into a LoRA
job, and a job's weights written back as a folder that
AutoModelForCausalLM.from_pretrained opens.

    job = client.create_job(model=ampd.from_pretrained(DIR), precision="bf16")
    job.save_pretrained(OUT)

What config.json means is the server's one mapping (model/hf_config.cc),
both ways: create_job sends the file's text (JobConfig.hf_config_json) and
the job's effective config.model is what the server made of it; an export
writes the config.json the server writes for the job's model
(Job.hf_config_json). The weights travel through the state-dict calls
(each file a partial LoadStateDict), so nothing here reads a config key but
num_hidden_layers (for a PEFT adapter's full-path target_modules) and
model_type (whether overrides are a GPT's or a decoder's fields).
"""
import json
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ampd import safetensors, spec
from ampd.v1 import trainer_pb2 as pb

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# transformers 5.x's save_pretrained default (4.x's was "5GB").
DEFAULT_MAX_SHARD_SIZE = "50GB"


def _read_config(config):
    """A JSON file's dict: config itself, or the file at that path."""
    if isinstance(config, dict):
        return config
    with open(config) as f:
        return json.load(f)


def _weight_files(directory):
    """The folder's safetensors files in load order: the index's, or the one file."""
    index = os.path.join(directory, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(directory, _SINGLE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError("%s: neither %s nor %s" % (directory, _INDEX, _SINGLE))


def _peft_targets(modules, num_layers):
    """PEFT's target_modules as ampd takes them. Names, dotted suffixes and
    "all-linear" pass as they are (the server reads them); full paths
    (model.layers.{i}.self_attn.q_proj: what PEFT saves after expanding
    "all-linear") become their module's name when they list it in every
    layer, as ampd adapts every layer alike."""
    if isinstance(modules, str):
        if modules != "all-linear":
            raise ValueError("target_modules %r: a regular expression; give module names"
                             % modules)
        return modules
    if not modules:
        return None
    paths = [m for m in modules if m.startswith("model.layers.")]
    if not paths:
        return list(modules)
    layers_of = {}
    for path in paths:
        parts = path.split(".")
        if len(parts) != 5 or not parts[2].isdigit():
            raise ValueError("target_modules %r: not a projection of a layer" % path)
        layers_of.setdefault(".".join(parts[3:]), set()).add(int(parts[2]))
    for module, layers in sorted(layers_of.items()):
        if layers != set(range(num_layers)):
            raise ValueError("target_modules: %s in layers %s only; ampd adapts all %d layers "
                             "alike" % (module, sorted(layers), num_layers))
    return [m for m in modules if not m.startswith("model.layers.")] + sorted(layers_of)


def lora_of_peft_config(config, num_layers=None):
    """A LoRA spec of PEFT's adapter_config.json (a path, or its dict): r,
    lora_alpha, target_modules (PEFT's forms: names, dotted suffixes,
    "all-linear", or full paths in every one of num_layers layers). Refused,
    naming the key: what would train differently (bias other than "none",
    rslora, DoRA, LoRA biases, per-module ranks or alphas,
    layers_to_transform, modules_to_save)."""
    config = _read_config(config)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError("peft_type %r: only LORA adapters" % (config.get("peft_type"),))
    refused = (("bias", "none"), ("use_rslora", False), ("use_dora", False),
               ("rank_pattern", {}), ("alpha_pattern", {}), ("layers_to_transform", None),
               ("modules_to_save", None), ("lora_bias", False))
    for key, wanted in refused:
        value = config.get(key)
        if value and value != wanted:  # None, {} and [] are PEFT's "not set" too
            raise ValueError("%s %r: ampd trains LoRA with %s = %r" % (key, value, key, wanted))
    return spec.LoRA(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                     target_modules=_peft_targets(config.get("target_modules"), num_layers))


@dataclass(frozen=True)
class HfConfig:
    """A model for Client.create_job given as a Hugging Face config.json: its
    text, which the server maps onto the model (JobConfig.hf_config_json),
    and the fields set over it (`overrides`: a pb.ModelSpec with only those
    fields, LoRA among them). Its weights are drawn from the job's seed."""
    hf_config_json: str
    overrides: pb.ModelSpec = field(default_factory=pb.ModelSpec)

    @property
    def config(self):
        """config.json as a dict."""
        return json.loads(self.hf_config_json)

    def to_proto(self):
        return self.overrides


@dataclass(frozen=True)
class Pretrained(HfConfig):
    """A Hugging Face folder to make a job of: HfConfig's config.json and
    overrides, and the weights create_job loads into the new job
    (load_weights). adapter: a PEFT adapter folder whose weights follow the
    base's."""
    directory: str = ""
    adapter: Optional[str] = None

    def load_weights(self, job):
        """Every weight file of the folder (then the adapter's), each a partial load."""
        for path in _weight_files(self.directory):
            _load_widened(job, path)
        if self.adapter is not None:
            _load_widened(job, os.path.join(self.adapter, "adapter_model.safetensors"))


def _load_widened(job, path):
    """One file as a partial load. A checkpoint in bf16 or fp16 (as most
    published ones are) is widened to F32 here, exactly: every job takes
    F32 weights (a full job's masters are F32; a LoRA job rounds its base
    to the working dtype), not every job another dtype. An F32 file goes up
    as its own bytes."""
    with open(path, "rb") as f:
        data = f.read()
    state = safetensors.loads(data)
    if not state.dtypes and all(v.dtype == np.float32 for v in state.values()):
        job.load_state_dict_bytes(data, partial=True)
        return
    widened = {name: np.asarray(value, dtype=np.float32) for name, value in state.items()}
    job.load_state_dict(widened, metadata={"format": "pt"}, partial=True)


_MLP_ACTIVATIONS = {"silu": pb.MLP_ACTIVATION_SILU, "gelu_tanh": pb.MLP_ACTIVATION_GELU_TANH}


def _overrides_proto(model_type, overrides):
    """A pb.ModelSpec setting only the overridden fields (spec.GPT's names
    for gpt2, spec.Decoder's otherwise), for the server to set over what it
    makes of config.json."""
    model = pb.ModelSpec()
    if "loss_multiplier" in overrides:
        model.loss_multiplier = overrides.pop("loss_multiplier")
    if not overrides:
        return model
    for name, value in overrides.items():
        if value is None:
            continue
        # LoRA is a decoder's: on a GPT-2 folder the server refuses it, saying so.
        target = model.gpt if model_type == "gpt2" and name != "lora" else model.decoder
        if name not in target.DESCRIPTOR.fields_by_name:
            raise ValueError("%s: not a field of %s's spec" % (name, type(target).__name__))
        if hasattr(value, "to_proto"):  # LoRA, RopeScaling
            getattr(target, name).CopyFrom(value.to_proto())
        elif name == "mlp_activation":
            target.mlp_activation = _MLP_ACTIVATIONS[value]
        elif name == "sliding_layers":
            target.sliding_layers.extend(value)
        else:
            setattr(target, name, value)
    return model


def from_pretrained(directory, *, lora=None, adapter=None, **overrides):
    """A model to pass to Client.create_job, from a folder that transformers'
    save_pretrained wrote: the server maps its config.json (families gpt2,
    llama, qwen2, qwen3, gemma3_text; what it cannot compute is refused by
    create_job, InvalidArgument naming the key), and create_job loads the
    folder's weights into the new job. lora: an ampd.LoRA to fine-tune with
    fresh adapters; adapter: a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors) to go on training. overrides: spec fields by
    keyword (max_position_embeddings=..., spec.Decoder's or spec.GPT's
    names), set over config.json's."""
    with open(os.path.join(directory, "config.json")) as f:
        text = f.read()
    config = json.loads(text)
    if adapter is not None:
        if lora is not None:
            raise ValueError("lora and adapter: give one (the adapter carries its LoRA config)")
        lora = lora_of_peft_config(os.path.join(adapter, "adapter_config.json"),
                                   config.get("num_hidden_layers"))
    if lora is not None:
        overrides["lora"] = lora
    return Pretrained(text, _overrides_proto(config.get("model_type"), overrides),
                      os.path.abspath(directory),
                      os.path.abspath(adapter) if adapter is not None else None)


def from_hf_config(config, *, lora=None, **overrides):
    """A model to pass to Client.create_job from a config.json alone (a dict,
    or the file's path): the server maps it as from_pretrained's, and the
    job's weights are drawn from its seed. lora, overrides: as
    from_pretrained's."""
    if isinstance(config, dict):
        text = json.dumps(config)
    else:
        with open(config) as f:
            text = f.read()
        config = json.loads(text)
    if lora is not None:
        overrides["lora"] = lora
    return HfConfig(text, _overrides_proto(config.get("model_type"), overrides))


def _parse_size(size):
    """transformers' max_shard_size: bytes, or "5GB", "100KB", "2GiB"."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for suffix, scale in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10),
                          ("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3), ("B", 1)):
        if text.endswith(suffix):
            return int(text[:-len(suffix)]) * scale
    return int(text)


def _shards(state, max_bytes):
    """huggingface_hub's split of a state dict: in order, a new shard where
    the next tensor would pass max_bytes, a tensor larger than it alone."""
    shards, current, size = [], [], 0
    for name, value in state.items():
        n = np.asarray(value).nbytes
        if n > max_bytes:
            shards.append([name])
            continue
        if current and size + n > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


def save_pretrained(job, directory, max_shard_size=DEFAULT_MAX_SHARD_SIZE):
    """Write the job as transformers' save_pretrained does: the config.json
    the server writes for its model (Job.hf_config_json), a
    generation_config.json, and the merged view (fp32 masters; a LoRA job's
    adapters merged in; a tied head left to the embedding) as
    model.safetensors, or in shards of at most max_shard_size tensor bytes
    with model.safetensors.index.json, in `directory` (made if needed).
    Returns directory."""
    job.refresh()
    if not job.proto.hf_config_json:
        raise ValueError("job %s: its model is no Hugging Face family (gpt2, llama, qwen2, "
                         "qwen3, gemma3_text)" % job.job_id)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write(job.proto.hf_config_json)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True}, f, indent=2)
    state = job.state_dict("merged")
    dtypes = getattr(state, "dtypes", {})
    for stale in (_INDEX, _SINGLE):  # an earlier export's, read beside the new one
        if os.path.exists(os.path.join(directory, stale)):
            os.remove(os.path.join(directory, stale))
    shards = _shards(state, _parse_size(max_shard_size))
    names = [_SINGLE] if len(shards) == 1 else [
        "model-%05d-of-%05d.safetensors" % (i + 1, len(shards)) for i in range(len(shards))]
    for name, keys in zip(names, shards):
        part = {k: state[k] for k in keys}
        with open(os.path.join(directory, name), "wb") as f:
            f.write(safetensors.dumps(part, {"format": "pt"},
                                      {k: dtypes[k] for k in keys if k in dtypes}))
    if len(shards) > 1:
        # Bytes as stored: a BF16 tensor (held here as float32) takes 2 each.
        total = sum(np.asarray(v).size * (2 if dtypes.get(k) == "BF16" else np.asarray(v).itemsize)
                    for k, v in state.items())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        with open(os.path.join(directory, _INDEX), "w") as f:
            json.dump(index, f, indent=2)
    return directory
