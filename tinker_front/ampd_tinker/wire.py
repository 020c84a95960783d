"""Tinker's bodies: the protobuf messages (tinker_wire.proto) and their JSON
twins for callers that do not ask for protobuf, as bytes and arrays.

A forward_backward result is one ArrayRecord whose fields batch every
datum's array (BatchedTensor: the datums' bytes back to back, int64 byte
offsets); a sample result carries int32 tokens and float32 log-probs.
"""
import json

import numpy as np

from ampd_tinker.wire_pb2 import tinker_wire_pb2 as pb

PROTO = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8"),
           pb.DTYPE_INT32: np.dtype("<i4")}
_TENSOR_DTYPES = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}


class WireError(ValueError):
    """A body that does not parse: the caller's mistake."""


def int32_bytes(data, what):
    if len(data) % 4:
        raise WireError("%s: %d bytes is no whole number of int32" % (what, len(data)))
    return np.frombuffer(data, dtype="<i4")


def tensor_array(tensor, what):
    """A wire Tensor (dense or CSR) as a flat NumPy array of its dtype."""
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError("%s: dtype %d, one of float32, int64, int32" % (what, tensor.dtype))
    shape = [int(s) for s in tensor.shape]
    if any(s < 0 for s in shape):
        raise WireError("%s: a negative shape" % what)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        if len(shape) != 2:
            raise WireError("%s: a sparse tensor is 2-D" % what)
        values = _frombuffer(csr.values, dtype, what)
        crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), what)
        col = _frombuffer(csr.col_indices, np.dtype("<i8"), what)
        rows, cols = shape
        if (rows * cols > (1 << 26) or crow.size != rows + 1 or col.size != values.size
                or (crow.size and (crow[0] != 0 or crow[-1] != values.size
                                   or np.any(np.diff(crow) < 0)))
                or np.any(col < 0) or np.any(col >= cols)):
            raise WireError("%s: inconsistent sparse CSR indices" % what)
        dense = np.zeros((rows, cols), dtype=dtype)
        for r in range(rows):
            dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return dense.reshape(-1)
    array = _frombuffer(tensor.dense, dtype, what)
    if shape and int(np.prod(shape)) != array.size:
        raise WireError("%s: %d values for shape %s" % (what, array.size, shape))
    return array


def _frombuffer(data, dtype, what):
    if len(data) % dtype.itemsize:
        raise WireError("%s: %d bytes is no whole number of %s" % (what, len(data), dtype))
    return np.frombuffer(data, dtype=dtype)


def parse_forward_backward(body):
    """The bytes of POST /forward_backward. (aiohttp decodes a
    Content-Encoding it knows, within the body limit, and refuses the rest
    with 400; the front tells the SDK not to compress.)"""
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as e:  # DecodeError, or a RecursionError on hostile nesting
        raise WireError("forward_backward: not a ForwardBackwardRequest: %s" % e) from None
    return request


def _batched(arrays, dtype):
    """Per-datum flat arrays as one BatchedTensor."""
    arrays = [np.ascontiguousarray(a, dtype=_DTYPES[dtype]) for a in arrays]
    offsets = np.zeros(len(arrays) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                            offsets=offsets.tobytes(), dtype=dtype)


def forward_backward_output(fields, metrics):
    """fields: {name: [per-datum float32 arrays]}; metrics: {"loss:sum": ...}.
    Returns (protobuf bytes, the JSON dict) of a ForwardBackwardOutput."""
    count = len(next(iter(fields.values()))) if fields else 0
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=count)
    for name, arrays in fields.items():
        record.fields[name].CopyFrom(_batched(arrays, pb.DTYPE_FLOAT32))
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord",
                                       loss_fn_outputs=[record], metrics=metrics)
    as_json = {"loss_fn_output_type": "ArrayRecord", "metrics": metrics, "loss_fn_outputs": [
        {name: {"data": [float(x) for x in fields[name][i]], "dtype": "float32",
                "shape": [int(fields[name][i].size)]} for name in fields}
        for i in range(count)]}
    return message.SerializeToString(), as_json


def sample_output(sequences, prompt_logprobs):
    """sequences: [(tokens, logprobs, "stop"|"length")]; prompt_logprobs: None
    or float32 (NaN where none). Returns (protobuf bytes, the JSON dict)."""
    message = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(logprobs, dtype="<f4").tobytes())
    as_json = {"type": "sample", "sequences": [
        {"tokens": [int(t) for t in tokens], "logprobs": [float(x) for x in logprobs],
         "stop_reason": reason} for tokens, logprobs, reason in sequences]}
    if prompt_logprobs is not None:
        array = np.asarray(prompt_logprobs, dtype="<f4")
        message.prompt_logprobs = array.tobytes()
        as_json["prompt_logprobs"] = [None if np.isnan(x) else float(x) for x in array]
    return message.SerializeToString(), as_json


def json_body(data, limit):
    """A JSON object body, or WireError."""
    if len(data) > limit:
        raise WireError("body of %d bytes, at most %d" % (len(data), limit))
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise WireError("not JSON: %s" % e) from None
    if not isinstance(value, dict):
        raise WireError("the body is a JSON object")
    return value
