"""asample's JSON body, checked into what Engine.sample takes: the prompt's
tokens (encoded_text chunks only), num_samples, the sampling parameters
ampd serves (max_tokens, seed, temperature, top_k, top_p, stop as token ids
or strings: stops.py) and the prompt's log-probs (all of them, or the last
prompt_logprobs_last_n); what it does not serve (top-k or target prompt
log-probs, top-k sample log-probs, prompt draws) is refused by name."""
import hashlib
import math
import time

from ampd_tinker import stops
from ampd_tinker.errors import UserError


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def parse(body):
    """asample's body, checked: {tokens, num_samples, sampling_params,
    prompt_logprobs, prompt_logprobs_last_n}; sampling_params' stop_ids and
    stop_strings are stops.parse's."""
    prompt = body.get("prompt")
    if not isinstance(prompt, dict):
        raise UserError("prompt: a ModelInput object")
    chunks = prompt.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise UserError("prompt.chunks: a non-empty list")
    tokens = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError("prompt: only encoded_text chunks")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in values):
            raise UserError("prompt: tokens are non-negative integers")
        tokens.extend(values)
    if not tokens or len(tokens) > 1 << 20:
        raise UserError("prompt: 1..%d tokens" % (1 << 20))
    num_samples = body.get("num_samples", 1)
    if not _is_int(num_samples) or not 1 <= num_samples <= 1024:
        raise UserError("num_samples: 1..1024")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise UserError("sampling_params: an object")
    for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if body.get(key):
            raise UserError("%s: not served by ampd" % key)
    if body.get("target_prompt_logprobs") is not None:
        raise UserError("target_prompt_logprobs: not served by ampd")
    prompt_logprobs = bool(body.get("prompt_logprobs"))
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None:
        # As Tinker's: only with prompt_logprobs, 1..len(prompt) - 1.
        if not prompt_logprobs:
            raise UserError("prompt_logprobs_last_n: only with prompt_logprobs")
        if not _is_int(last_n) or not 1 <= last_n <= len(tokens) - 1:
            raise UserError("prompt_logprobs_last_n: 1..len(prompt) - 1 (%d)" % (len(tokens) - 1))
    stop_ids, stop_strings = stops.parse(params.get("stop"))
    max_tokens = params.get("max_tokens")
    max_tokens = 16 if max_tokens is None else max_tokens
    seed = params.get("seed")
    if seed is None:
        seed = int.from_bytes(hashlib.sha256(str(time.time_ns()).encode()).digest()[:7], "little")
    temperature = params.get("temperature", 1.0)
    top_k = params.get("top_k", -1)
    top_p = params.get("top_p", 1.0)
    for name, value in (("max_tokens", max_tokens), ("seed", seed), ("top_k", top_k)):
        if not _is_int(value):
            raise UserError("sampling_params.%s: an integer" % name)
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not _is_number(value):
            raise UserError("sampling_params.%s: a finite number" % name)
    if not 1 <= max_tokens <= 1 << 16 or not 0 <= seed < 1 << 64 or not -1 <= top_k < 1 << 31 \
            or not 0 <= temperature <= 100 or not 0 < top_p <= 1:
        raise UserError("sampling_params: max_tokens 1..65536, seed in [0, 2^64), top_k >= -1, "
                        "temperature in [0, 100], top_p in (0, 1]")
    return {"tokens": tokens, "num_samples": num_samples, "prompt_logprobs": prompt_logprobs,
            "prompt_logprobs_last_n": last_n,
            "sampling_params": {"max_tokens": max_tokens, "seed": seed,
                                "temperature": float(temperature),
                                "top_k": max(0, top_k), "top_p": float(top_p),
                                "stop_ids": stop_ids, "stop_strings": stop_strings}}
