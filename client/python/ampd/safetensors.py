"""A small safetensors reader and writer on NumPy, for ampd's state dicts.

The format: an 8-byte little-endian header length, a JSON header mapping each
tensor name to {dtype, shape, data_offsets} (plus "__metadata__", a map of
strings), then the tensors' little-endian bytes. NumPy has no bfloat16, so a
BF16 tensor is read as float32 by widening its bits (exact) and remembered as
BF16 in StateDict.dtypes; writing it narrows back with round-to-nearest-even,
which returns the original bits for every widened value.
"""
import json
import struct

import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# Headers past this are refused rather than parsed (the format's own limit).
_MAX_HEADER = 100 * 1024 * 1024


class StateDict(dict):
    """Tensor name -> NumPy array, plus the file's string metadata.

    metadata: the safetensors "__metadata__" (for ampd: scaler.* keys with the
    policy's own names, optimizer.step, ampd.step ...). dtypes: the file's
    dtype name per tensor, where it differs from the array's (BF16).
    """

    def __init__(self, tensors=(), metadata=None, dtypes=None):
        super().__init__(tensors)
        self.metadata = dict(metadata or {})
        self.dtypes = dict(dtypes or {})

    def copy(self):
        return StateDict(self, self.metadata, self.dtypes)


def bf16_to_f32(raw):
    """uint16 bit patterns -> float32, exactly."""
    return (np.asarray(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values):
    """float32 -> uint16 bf16 bit patterns, rounding to nearest even."""
    bits = np.ascontiguousarray(values, dtype="<f4").view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    # A NaN keeps its sign and upper payload bits (so a widened bf16 NaN
    # narrows back to itself); one whose payload lies only in the low bits
    # becomes quiet rather than turning into an infinity.
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    high = (bits[nan] >> 16).astype(np.uint16)
    out[nan] = np.where(high & 0x7F, high, high | 0x40)
    return out


def loads(data):
    """Parse safetensors bytes into a StateDict (arrays are copies, writable)."""
    data = memoryview(data)
    if len(data) < 8:
        raise ValueError("safetensors: %d bytes, shorter than the 8-byte header length" % len(data))
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(_MAX_HEADER, len(data) - 8):
        raise ValueError("safetensors: header length %d does not fit the %d-byte file" % (n, len(data)))
    header = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("safetensors: the header is not a JSON object")
    body = data[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    tensors, dtypes = {}, {}
    for name, entry in header.items():
        dtype_name = entry["dtype"]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(x) for x in entry["data_offsets"])
        if not 0 <= begin <= end <= len(body):
            raise ValueError("safetensors: %s: data_offsets [%d, %d] outside the %d-byte buffer"
                             % (name, begin, end, len(body)))
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if dtype_name == "BF16":
            if end - begin != 2 * count:
                raise ValueError("safetensors: %s: %d bytes for shape %s of BF16" % (name, end - begin, shape))
            raw = np.frombuffer(body[begin:end], dtype="<u2")
            tensors[name] = bf16_to_f32(raw).reshape(shape)
            dtypes[name] = "BF16"
            continue
        if dtype_name not in _DTYPES:
            raise ValueError("safetensors: %s: unsupported dtype %s" % (name, dtype_name))
        dtype = _DTYPES[dtype_name]
        if end - begin != dtype.itemsize * count:
            raise ValueError("safetensors: %s: %d bytes for shape %s of %s"
                             % (name, end - begin, shape, dtype_name))
        tensors[name] = np.frombuffer(body[begin:end], dtype=dtype).reshape(shape).copy()
    return StateDict(tensors, metadata, dtypes)


def dumps(tensors, metadata=None, dtypes=None):
    """safetensors bytes of name -> array (in the mapping's order).

    metadata defaults to tensors.metadata and dtypes to tensors.dtypes when
    tensors is a StateDict; a name whose dtype is "BF16" is narrowed.
    """
    if metadata is None:
        metadata = getattr(tensors, "metadata", {})
    if dtypes is None:
        dtypes = getattr(tensors, "dtypes", {})
    header, chunks, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, value in tensors.items():
        array = np.asarray(value)
        if dtypes.get(name) == "BF16":
            raw, dtype_name = f32_to_bf16(array).astype("<u2"), "BF16"
        else:
            array = array.astype(array.dtype.newbyteorder("<"), copy=False)
            key = np.dtype(array.dtype.str if array.dtype.itemsize > 1 else array.dtype)
            if key not in _NAMES:
                raise ValueError("safetensors: %s: unsupported dtype %s" % (name, array.dtype))
            raw, dtype_name = array, _NAMES[key]
        payload = np.ascontiguousarray(raw).tobytes()
        header[name] = {"dtype": dtype_name, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(payload)]}
        chunks.append(payload)
        offset += len(payload)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # align the buffer to 8, as the reference writer does
    return b"".join([struct.pack("<Q", len(text)), text] + chunks)


def load_file(path):
    with open(path, "rb") as f:
        return loads(f.read())


def save_file(tensors, path, metadata=None, dtypes=None):
    with open(path, "wb") as f:
        f.write(dumps(tensors, metadata, dtypes))
