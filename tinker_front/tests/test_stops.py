"""Stop strings alone: SamplingParams.stop's forms checked, and the cut
found by stops.cut's binary search equal to a linear scan over every prefix,
with a tokenizer whose tokens hold several characters (a stop string may end
inside a token, or span tokens) and bytes of one character split over two
tokens (a prefix ending between them decodes to U+FFFD)."""
import itertools
import random

import pytest
from tokenizers import Tokenizer, decoders, models

from ampd_tinker import stops
from ampd_tinker.errors import UserError


@pytest.fixture(scope="module")
def tokenizer():
    # Byte-level pieces: "é" is the two bytes c3 a9, one token each.
    pieces = ["ab", "c", "\n\n", "Us", "er:", "User:", "x", "Ã", "©", "<|end|>"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="x"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    return tok


def linear(tokenizer, tokens, strings):
    for k in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:k], skip_special_tokens=False) for s in strings):
            return k
    return None


def test_parse_forms():
    assert stops.parse(None) == (None, None)
    assert stops.parse([]) == ([], None)
    assert stops.parse([3, 4]) == ([3, 4], None)
    assert stops.parse("\n\nUser:") == (None, ["\n\nUser:"])
    assert stops.parse(["a", "b"]) == (None, ["a", "b"])
    for bad in ([3, "a"], [""], ["\ufffd"], [-1], [True], 1.5, {"a": 1}, ["a"] * 65,
                ["a" * 1025]):
        with pytest.raises(UserError):
            stops.parse(bad)


def test_cut_equals_a_linear_scan(tokenizer):
    assert tokenizer.decode([7, 8]) == "é"
    assert tokenizer.decode([7]) == "\ufffd"
    strings_tried = [["\n\nUser:"], ["bc"], ["é"], ["er:\n"], ["<|end|>"], ["zz"], ["c", "ab"]]
    rng = random.Random(0)
    cases = [list(t) for t in itertools.product(range(10), repeat=3)]
    cases += [[rng.randrange(10) for _ in range(rng.randrange(1, 30))] for _ in range(2000)]
    found = 0
    for tokens in cases:
        for strings in strings_tried:
            expected = linear(tokenizer, tokens, strings)
            assert stops.cut(tokenizer, tokens, strings) == expected, (tokens, strings)
            found += expected is not None
    assert found > 1000
    # "\n\nUser:" completed by "User:" after "\n\n", and by "Us" + "er:".
    assert stops.cut(tokenizer, [0, 2, 5, 1], ["\n\nUser:"]) == 3
    assert stops.cut(tokenizer, [0, 2, 3, 4, 1], ["\n\nUser:"]) == 4
    assert stops.cut(tokenizer, [], ["a"]) is None
