"""Where a sampled sequence ends, as Tinker's SamplingParams.stop says.

stop is None (the model's end-of-sequence tokens end a sequence), a list of
token ids (those alone; [] none, not even EOS), or a string or list of
strings: a sequence also ends at the first token whose addition makes the
decoded text of the sampled tokens contain one of them. That token is the
last one returned (as vLLM and SGLang return token ids: the stop string's
tokens are kept, so that the cookbook's renderers, which split the decoded
response on the stop string, find it), with its log-prob, and the sequence's
stop_reason is "stop"; EOS still ends it (the cookbook's RoleColon renderer
reads a response ended by EOS without its stop string).

ampd's Sample stops on token ids only, so for stop strings it samples to
max_tokens (or EOS) and the sequence is cut here: the tokens kept are
exactly those a server stopping on the spot would return, since a
completion's first k tokens are the same whatever max_tokens is (its draws
come from its own seeded stream, in order). The text is
decoded with the base model's tokenizer.json (the `tokenizers` package),
special tokens included, so a stop string may also name one.
"""
import json
import os
import threading

from ampd_tinker.errors import UserError

MAX_STOPS = 64  # ampd's limit on stop token ids; the same for strings
MAX_STOP_CHARS = 1024


def parse(stop):
    """SamplingParams.stop checked: (token ids or None, strings or None).
    (None, None): the model's EOS; (ids, None): those ids alone;
    (None, strings): the strings and EOS."""
    if stop is None:
        return None, None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOPS:
        raise UserError("sampling_params.stop: at most %d token ids or strings" % MAX_STOPS)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        if not all(0 <= s < 1 << 31 for s in stop):
            raise UserError("sampling_params.stop: token ids in [0, 2^31)")
        return list(stop), None
    if all(isinstance(s, str) for s in stop):
        # U+FFFD is what a prefix cut inside a character decodes to: a stop
        # string holding it could match text the full sequence does not hold.
        if not all(0 < len(s) <= MAX_STOP_CHARS and "\ufffd" not in s for s in stop):
            raise UserError("sampling_params.stop: strings of 1..%d characters (no U+FFFD)"
                            % MAX_STOP_CHARS)
        return None, list(stop)
    raise UserError("sampling_params.stop: token ids or strings, not both")


def _eos_ids(directory):
    """The end-of-sequence ids config.json and generation_config.json name
    (an id or a list), as transformers' generate stops on them."""
    ids = []
    for name in ("config.json", "generation_config.json"):
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
                ids.append(v)
    return ids[:MAX_STOPS]


class Stops:
    """Per base model folder: its EOS ids and its tokenizer, read once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._eos = {}
        self._tokenizers = {}

    def eos_ids(self, directory):
        with self._lock:
            if directory not in self._eos:
                self._eos[directory] = _eos_ids(directory)
            return self._eos[directory]

    def tokenizer(self, directory):
        with self._lock:
            tokenizer = self._tokenizers.get(directory)
        if tokenizer is not None:
            return tokenizer
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise UserError("stop strings need the base model's tokenizer.json beside its "
                            "config.json (give stop token ids instead)")
        from tokenizers import Tokenizer  # only the front's stop strings need it

        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the package's own error type varies by version
            raise UserError("the base model's tokenizer.json does not load: %s" % e) from None
        with self._lock:
            self._tokenizers[directory] = tokenizer
        return tokenizer


def cut(tokenizer, tokens, strings):
    """The number of leading tokens to return: the smallest k whose decoded
    tokens[:k] holds one of strings, or None when none appears. The decoded
    text of a prefix is a prefix of the whole one's (but for a character cut
    short, U+FFFD, which no stop string holds), so containment grows with k
    and a binary search finds the first k."""
    def holds(k):
        text = tokenizer.decode(list(tokens[:k]), skip_special_tokens=False)
        return any(s in text for s in strings)

    if not tokens or not holds(len(tokens)):
        return None
    low, high = 1, len(tokens)  # holds(high); the answer is in [low, high]
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    return low
