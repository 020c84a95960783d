"""The front's two kinds of refusal, and the one name rule of checkpoints,
model folders and ids."""
import re

NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
# Model ids: the front's own, or SESSION:train:N (the SDK names a model it
# creates from a checkpoint itself).
MODEL_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,159}$")


class NotFound(Exception):
    """An unknown (or another key's) model, checkpoint or sampler."""


class UserError(ValueError):
    """The caller's mistake, in words the SDK shows."""


def check_name(name, what):
    if not isinstance(name, str) or not NAME.match(name):
        raise UserError("%s %r: letters, digits, '_', '-', '.', at most 128, not starting "
                        "with '.' or '-'" % (what, name))
    return name
