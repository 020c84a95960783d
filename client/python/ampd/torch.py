"""PyTorch interop, without making torch a dependency of ampd.

Importing this module imports torch. An ampd model's layer i is index i of
the matching torch.nn.Sequential, and the state dict names agree after the
"model." prefix: model.{i}.weight <-> {i}.weight, model.{i}.bias <-> {i}.bias
(Linear, LayerNorm and Embedding keep PyTorch's parameter layouts: Linear
weight is (out, in)). A GPT job's weights carry Hugging Face GPT-2's names
and layouts: gpt2_state_dict() gives them to GPT2LMHeadModel, load_gpt2()
takes a pretrained GPT-2's into a job; a decoder job's carry Llama/Qwen2's
(decoder_state_dict()).
"""
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from ampd import spec
from ampd.safetensors import StateDict

_PREFIX = "model."


def to_state_dict(job_or_state):
    """A state dict that the matching nn.Sequential's load_state_dict takes.

    job_or_state: an ampd.Job (its state is read with GetStateDict) or a
    StateDict / dict from Job.state_dict() or ampd.safetensors.load_file.
    Tensors are the fp32 master weights.
    """
    state = job_or_state.state_dict() if hasattr(job_or_state, "state_dict") else job_or_state
    out = OrderedDict()
    for name, value in state.items():
        if name.startswith(_PREFIX):
            out[name[len(_PREFIX):]] = torch.from_numpy(np.array(value, copy=True))
    return out


def _layer_of(index, module):
    if isinstance(module, nn.Linear):
        return spec.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    if isinstance(module, nn.ReLU):
        return spec.ReLU()
    if isinstance(module, nn.GELU):
        if getattr(module, "approximate", "none") != "none":
            raise ValueError("layer %d: GELU(approximate=%r): ampd's GELU is approximate='none'"
                             % (index, module.approximate))
        return spec.GELU()
    if isinstance(module, nn.Tanh):
        return spec.Tanh()
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            raise ValueError("layer %d: LayerNorm%s: ampd normalizes the last dimension only"
                             % (index, tuple(module.normalized_shape)))
        return spec.LayerNorm(module.normalized_shape[0], eps=float(module.eps),
                              elementwise_affine=bool(module.elementwise_affine))
    if isinstance(module, nn.Embedding):
        if index != 0:
            raise ValueError("layer %d: Embedding is supported only as the first layer" % index)
        if module.padding_idx is not None or module.max_norm is not None:
            raise ValueError("layer 0: Embedding with padding_idx or max_norm is not supported")
        return spec.Embedding(module.num_embeddings, module.embedding_dim)
    raise ValueError("layer %d: %s is not a layer ampd supports (Linear, ReLU, GELU, Tanh, "
                     "LayerNorm, Embedding)" % (index, type(module).__name__))


def from_module(module, loss="mse", loss_multiplier=None):
    """(ampd.Model, StateDict of model.{i}.* float32 weights) from an nn.Sequential."""
    if not isinstance(module, nn.Sequential):
        raise TypeError("from_module takes an nn.Sequential, not %s" % type(module).__name__)
    layers = [_layer_of(i, m) for i, m in enumerate(module)]
    weights = StateDict()
    for name, value in module.state_dict().items():
        weights[_PREFIX + name] = value.detach().cpu().to(torch.float32).numpy().copy()
    return spec.Model(layers, loss=loss, loss_multiplier=loss_multiplier), weights


def load_module(job, module):
    """Load an nn.Sequential's weights into a job, keeping the job's optimizer
    and scaler state (LoadStateDict replaces the whole state, so the job's
    current state is read, its model.* tensors replaced, and written back)."""
    _, weights = from_module(module)
    state = job.state_dict()
    missing = sorted(set(k for k in state if k.startswith(_PREFIX)) - set(weights))
    extra = sorted(set(weights) - set(state))
    if missing or extra:
        raise ValueError("module does not match the job's model: missing %s, unexpected %s"
                         % (missing, extra))
    for name, value in weights.items():
        if state[name].shape != value.shape:
            raise ValueError("%s: module has shape %s, the job %s"
                             % (name, value.shape, state[name].shape))
        state[name] = value
    job.load_state_dict(state)


def create_job_from_module(client, module, loss="mse", loss_multiplier=None, **create_kwargs):
    """Create a job whose model and initial weights are the nn.Sequential's."""
    model, _ = from_module(module, loss, loss_multiplier)
    job = client.create_job(model=model, **create_kwargs)
    load_module(job, module)
    return job


# ---- GPT ---------------------------------------------------------------------

_OPTIMIZER_PREFIX = "optimizer."
_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # old GPT-2 checkpoints' causal masks


def _gpt2_name(name):
    """Hugging Face GPT2LMHeadModel's name for a GPT-2 state dict key, which may
    come without the "transformer." prefix (GPT2Model's own state dict)."""
    if name.startswith("transformer.") or name == "lm_head.weight":
        return name
    return "transformer." + name


def gpt2_state_dict(job_or_state):
    """A GPT job's weights as a state dict that transformers.GPT2LMHeadModel
    (and bench/pytorch/gpt.py's GPT) loads: Hugging Face's names and layouts
    (Conv1D weights (in, out)), fp32 master weights, lm_head.weight added as
    wte's when the job ties them and does not list it. job_or_state: an
    ampd.Job or a StateDict from Job.state_dict() / ampd.safetensors."""
    state = job_or_state.state_dict() if hasattr(job_or_state, "state_dict") else job_or_state
    out = OrderedDict()
    for name, value in state.items():
        # A LoRA job's adapters (PEFT's names) are not the decoder's: lora_state_dict.
        if not name.startswith(_OPTIMIZER_PREFIX) and not _is_adapter(name):
            out[name] = torch.from_numpy(np.array(value, copy=True))
    if "lm_head.weight" not in out and "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def load_gpt2(job, state_dict):
    """Load GPT-2 weights (a torch or NumPy state dict with Hugging Face's
    names, with or without the "transformer." prefix; the old attn.bias /
    attn.masked_bias buffers are ignored) into a GPT job, keeping the job's
    optimizer and scaler state. Every weight of the job must be given."""
    given = {}
    for name, value in state_dict.items():
        if name.endswith(_GPT2_BUFFERS):
            continue
        if hasattr(value, "detach"):
            value = value.detach().cpu().to(torch.float32).numpy()
        given[_gpt2_name(name)] = np.ascontiguousarray(value, dtype=np.float32)
    state = job.state_dict()
    weights = set(k for k in state if not k.startswith(_OPTIMIZER_PREFIX))
    if "lm_head.weight" not in weights:  # tied: the job has wte only
        tied = given.pop("lm_head.weight", None)
        wte = given.get("transformer.wte.weight")
        if tied is not None and wte is not None and not np.array_equal(tied, wte):
            raise ValueError("lm_head.weight differs from transformer.wte.weight, but the job "
                             "ties them")
    missing = sorted(weights - set(given))
    extra = sorted(set(given) - weights)
    if missing or extra:
        raise ValueError("state dict does not match the job's GPT: missing %s, unexpected %s"
                         % (missing, extra))
    for name, value in given.items():
        if state[name].shape != value.shape:
            raise ValueError("%s: given shape %s, the job's %s"
                             % (name, value.shape, state[name].shape))
        state[name] = value
    job.load_state_dict(state)


# ---- Llama / Qwen2 decoder -----------------------------------------------------


def _is_adapter(name):
    return ".lora_A." in name or ".lora_B." in name


def lora_state_dict(job_or_state):
    """A LoRA job's adapters (fp32 masters) in PEFT's names
    (base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight, ...), as
    torch tensors: what peft's set_peft_model_state_dict takes."""
    state = job_or_state.state_dict() if hasattr(job_or_state, "state_dict") else job_or_state
    return OrderedDict((name, torch.from_numpy(np.array(value, copy=True)))
                       for name, value in state.items()
                       if not name.startswith(_OPTIMIZER_PREFIX) and _is_adapter(name))


def decoder_state_dict(job_or_state):
    """A decoder job's weights as a state dict that transformers'
    LlamaForCausalLM / Qwen2ForCausalLM (and bench/pytorch/decoder.py's
    Decoder) load: Hugging Face's names and layouts, fp32 master weights (a
    LoRA job's frozen base in its working dtype, its adapters left out),
    lm_head.weight added as the embedding when the job ties them.
    job_or_state: an ampd.Job or a StateDict from Job.state_dict()."""
    state = job_or_state.state_dict() if hasattr(job_or_state, "state_dict") else job_or_state
    out = OrderedDict()
    for name, value in state.items():
        # A LoRA job's adapters (PEFT's names) are not the decoder's: lora_state_dict.
        if not name.startswith(_OPTIMIZER_PREFIX) and not _is_adapter(name):
            out[name] = torch.from_numpy(np.array(value, copy=True))
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
