"""Tinker's forward_backward input as ampd's: each datum one micro-batch of one
row, its loss_fn_inputs as ampd's per-token arrays, and the per-datum outputs
(logprobs, elementwise_loss) Tinker returns.

A datum is model_input (N tokens) and loss_fn_inputs of N entries each:
target_tokens (int64), weights (cross_entropy), logprobs (the sampler's, for
the RL losses) and advantages. Tinker's five losses are sums over tokens, as
ampd's token losses are, so nothing is rescaled.
"""
import math

import numpy as np

from ampd_tinker import wire

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
# The loss_fn_config keys each loss reads, and the clip ranges' defaults
# (ampd's, which are Tinker's) for a config that gives one end only.
_CONFIG_KEYS = {"ppo": ("clip_low_threshold", "clip_high_threshold"),
                "cispo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",)}
_CLIP_DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}
MAX_DATA = 4096       # datums in one request
MAX_TOKENS = 1 << 20  # tokens over one request's datums


class BadRequest(ValueError):
    """The caller's mistake: answered as a user error, never retried."""


class Batch:
    """One forward_backward request as ampd's arguments.

    micro_batches: [(inputs (1, N) int64, targets (1, N) int64)] per datum.
    kwargs: loss_fn and the per-token arrays (one (1, N) float32 per datum).
    """

    def __init__(self, loss_fn, micro_batches, kwargs, inputs):
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.kwargs = kwargs
        self.inputs = inputs  # per datum: {name: (N,) array}, for forward_only's losses


def _tokens(datum, index):
    parts = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise BadRequest("data[%d]: only encoded_text chunks (no images or audio)" % index)
        parts.append(wire.int32_bytes(chunk.encoded_text.tokens, "data[%d].model_input" % index))
    if not parts:
        raise BadRequest("data[%d]: an empty model_input" % index)
    return np.concatenate(parts).astype(np.int64)


def _config(request):
    """loss_fn_config (v2 preferred) as {name: float}."""
    config = {k: float(v) for k, v in request.loss_fn_config.items()}
    for k, v in request.loss_fn_config_v2.items():
        if v.WhichOneof("value") != "number":
            raise BadRequest("loss_fn_config[%s]: a number" % k)
        config[k] = float(v.number)
    return config


def batch_of_request(request):
    """A wire.ForwardBackwardRequest as a Batch (BadRequest naming what is wrong)."""
    loss_fn = request.loss_fn
    if loss_fn not in LOSSES:
        raise BadRequest("loss_fn %r: one of %s" % (loss_fn, ", ".join(LOSSES)))
    if not request.data:
        raise BadRequest("forward_backward: no data")
    if len(request.data) > MAX_DATA:
        raise BadRequest("forward_backward: %d datums, at most %d" % (len(request.data), MAX_DATA))
    wanted = {"cross_entropy": ("target_tokens",),
              "importance_sampling": ("target_tokens", "logprobs", "advantages"),
              "ppo": ("target_tokens", "logprobs", "advantages"),
              "cispo": ("target_tokens", "logprobs", "advantages"),
              "dro": ("target_tokens", "logprobs", "advantages")}[loss_fn]
    optional = ("weights",) if loss_fn == "cross_entropy" else ()
    micro_batches, per_token, inputs, total = [], {}, [], 0
    for i, datum in enumerate(request.data):
        tokens = _tokens(datum, i)
        total += tokens.size
        if total > MAX_TOKENS:
            raise BadRequest("forward_backward: more than %d tokens" % MAX_TOKENS)
        arrays = {}
        for name in datum.loss_fn_inputs:
            if name not in wanted + optional:
                raise BadRequest("data[%d].loss_fn_inputs[%s]: %s takes %s" % (
                    i, name, loss_fn, ", ".join(wanted + optional)))
            arrays[name] = wire.tensor_array(datum.loss_fn_inputs[name],
                                             "data[%d].loss_fn_inputs[%s]" % (i, name))
            if arrays[name].size != tokens.size:
                raise BadRequest("data[%d].loss_fn_inputs[%s]: %d entries for %d tokens" % (
                    i, name, arrays[name].size, tokens.size))
        for name in wanted:
            if name not in arrays:
                raise BadRequest("data[%d]: %s needs loss_fn_inputs[%s]" % (i, loss_fn, name))
        targets = arrays["target_tokens"].astype(np.int64).reshape(-1)
        micro_batches.append((tokens.reshape(1, -1), targets.reshape(1, -1)))
        for name, key in (("weights", "weights"), ("advantages", "advantages"),
                          ("logprobs", "sampling_logprobs")):
            if name in arrays:
                per_token.setdefault(key, []).append(
                    arrays[name].astype(np.float32).reshape(1, -1))
        inputs.append({k: v.reshape(-1) for k, v in arrays.items()})
    if "weights" in per_token and len(per_token["weights"]) != len(micro_batches):
        raise BadRequest("weights: give them for every datum or none")
    kwargs = {"loss_fn": loss_fn}
    kwargs.update(per_token)
    config = _config(request)
    keys = _CONFIG_KEYS.get(loss_fn, ())
    for key, value in config.items():
        if key not in keys:
            raise BadRequest("loss_fn_config[%s]: %s takes %s" % (
                key, loss_fn, ", ".join(keys) or "none"))
        if not math.isfinite(value):
            raise BadRequest("loss_fn_config[%s]: a finite number" % key)
    if loss_fn in _CLIP_DEFAULTS and config:
        lo, hi = _CLIP_DEFAULTS[loss_fn]
        kwargs[loss_fn + "_clip"] = (config.get("clip_low_threshold", lo),
                                     config.get("clip_high_threshold", hi))
    if loss_fn == "dro" and "beta" in config:
        kwargs["dro_beta"] = config["beta"]
    return Batch(loss_fn, micro_batches, kwargs, inputs)


def elementwise_losses(batch, logprobs):
    """Each token's loss of a forward_only call (no gradients, so ampd returns
    only log-probs): Tinker's definitions, in float64 then rounded."""
    out = []
    config = batch.kwargs
    for datum, lp in zip(batch.inputs, logprobs):
        lp = lp.astype(np.float64)
        if batch.loss_fn == "cross_entropy":
            w = datum.get("weights", np.ones_like(lp))
            loss = -w * lp
        else:
            q, a = datum["logprobs"].astype(np.float64), datum["advantages"].astype(np.float64)
            r = np.exp(lp - q)
            if batch.loss_fn == "importance_sampling":
                loss = -r * a
            elif batch.loss_fn == "ppo":
                lo, hi = config.get("ppo_clip", (0.8, 1.2))
                loss = -np.minimum(r * a, np.clip(r, lo, hi) * a)
            elif batch.loss_fn == "cispo":
                lo, hi = config.get("cispo_clip", (0.0, 4.0))
                loss = -np.clip(r, lo, hi) * lp * a
            else:
                beta = config.get("dro_beta", 0.05)
                loss = -(lp * a - 0.5 * beta * (lp - q) ** 2)
        out.append(loss.astype(np.float32))
    return out
