"""API keys onto owners (tenants): the X-API-Key of every call names the
owner of what it creates and the only one who sees it; --api-keys lists the
keys served and the ampd bearer token of each key's tenant."""
import hashlib


class Keys:
    """API keys -> owners. keys: {api_key: owner} from --api-keys; None: any
    key starting tml- is its own owner (a digest of it)."""

    def __init__(self, keys=None):
        self.keys = keys

    def owner(self, key):
        if not key:
            return None
        if self.keys is not None:
            return self.keys.get(key)
        if not key.startswith("tml-") or len(key) > 512:
            return None
        return "k" + hashlib.sha256(key.encode()).hexdigest()[:16]


def read_keys(path):
    keys, tokens = {}, {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) not in (2, 3):
                raise SystemExit("%s:%d: API_KEY TENANT [AMPD_TOKEN]" % (path, number))
            keys[fields[0]] = fields[1]
            if len(fields) == 3:
                tokens[fields[1]] = fields[2]
    return keys, tokens
