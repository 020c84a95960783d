"""ampd.safetensors without a server: exact round trips (bf16 included),
refusal of malformed files, and the ErrorInfo decoder next to generated
google.rpc modules in protobuf's default pool."""
import importlib
import os
import struct
import sys

import grpc
import numpy as np
import pytest

import ampd
from ampd import _rpc_status, errors, safetensors


def test_round_trip_every_dtype():
    rng = np.random.default_rng(0)
    state = ampd.StateDict({
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal(5).astype(np.float16),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "i32": np.array([-1, 7], dtype=np.int32),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }, metadata={"scaler.scale": "65536", "ampd.step": "3"})
    data = safetensors.dumps(state)
    (header_len,) = struct.unpack("<Q", data[:8])
    assert (8 + header_len) % 8 == 0
    back = safetensors.loads(data)
    assert back.metadata == state.metadata and list(back) == list(state)
    for name, value in state.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert np.array_equal(back[name], value), name
    assert safetensors.dumps(back) == data


def test_bf16_widens_exactly_and_narrows_back_to_the_same_bits():
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint16)  # every exponent, NaNs and infs included
    header = ('{"w":{"dtype":"BF16","shape":[%d],"data_offsets":[0,%d]}}'
              % (bits.size, 2 * bits.size)).encode()
    data = struct.pack("<Q", len(header)) + header + bits.astype("<u2").tobytes()
    state = safetensors.loads(data)
    assert state.dtypes == {"w": "BF16"} and state["w"].dtype == np.float32
    widened = state["w"].view(np.uint32)
    assert np.array_equal(widened >> 16, bits) and not (widened & 0xFFFF).any()
    assert safetensors.dumps(state).endswith(bits.astype("<u2").tobytes())


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch", reason="torch is not importable: no reference rounding")
    x = np.random.default_rng(1).standard_normal(10000).astype(np.float32) * 1e3
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(safetensors.f32_to_bf16(x), expected)


def file_of(header, body=b""):
    return struct.pack("<Q", len(header)) + header + body


@pytest.mark.parametrize("data, message", [
    (b"\x01\x02", "shorter than"),
    (struct.pack("<Q", 1 << 40) + b"{}", "does not fit"),
    (file_of(b"[]"), "not a JSON object"),
    (file_of(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'), "outside"),
    (file_of(b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', bytes(8)),
     "8 bytes for shape"),
    (file_of(b'{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}', bytes(8)),
     "unsupported dtype"),
])
def test_malformed_files_are_refused(data, message):
    with pytest.raises(ValueError, match=message):
        safetensors.loads(data)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailers):
        self._code, self._details, self._trailers = code, details, trailers

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


def status_trailer(reason, metadata, domain="ampd"):
    info = _rpc_status.ErrorInfo(reason=reason, domain=domain, metadata=metadata)
    status = _rpc_status.Status(code=9, message="m")
    detail = status.details.add()
    detail.type_url = "type.googleapis.com/google.rpc.ErrorInfo"
    detail.value = info.SerializeToString()
    return [(_rpc_status.STATUS_DETAILS_KEY, status.SerializeToString())]


def test_error_classes_follow_reason_then_code():
    fp = grpc.StatusCode.FAILED_PRECONDITION
    e = errors.from_rpc_error(FakeRpcError(fp, "sequence: expected 5, got 7",
                                           status_trailer("SEQUENCE_MISMATCH", {"expected_sequence": "5"})))
    assert type(e) is ampd.SequenceMismatch and e.expected_sequence == 5
    assert str(e) == "FAILED_PRECONDITION [SEQUENCE_MISMATCH expected_sequence=5]: sequence: expected 5, got 7"
    # A reason that does not fit the code, another domain's reason, a
    # malformed trailer: the code decides.
    assert type(errors.from_rpc_error(FakeRpcError(
        grpc.StatusCode.INTERNAL, "x", status_trailer("JOB_LIMIT", {})))) is ampd.Internal
    assert type(errors.from_rpc_error(FakeRpcError(
        fp, "x", status_trailer("JOB_FAILED", {}, domain="other")))) is ampd.FailedPrecondition
    e = errors.from_rpc_error(FakeRpcError(fp, "x", [(_rpc_status.STATUS_DETAILS_KEY, b"\xff\xff")]))
    assert type(e) is ampd.FailedPrecondition and e.reason == ""
    assert type(errors.from_rpc_error(FakeRpcError(grpc.StatusCode.CANCELLED, "x", None))) is ampd.AmpdError


def test_decoder_coexists_with_generated_google_rpc_modules():
    """google/rpc/status.proto registered in the default pool (as
    googleapis-common-protos does) leaves the private decoder working."""
    stubs = os.environ.get("AMPD_GOOGLE_RPC_STUBS")
    if not stubs:
        pytest.skip("AMPD_GOOGLE_RPC_STUBS (the build's proto/gen-python) is not set")
    sys.path.append(stubs)
    try:
        status_pb2 = importlib.import_module("google.rpc.status_pb2")
        details_pb2 = importlib.import_module("google.rpc.error_details_pb2")
    finally:
        sys.path.remove(stubs)
    trailer = status_trailer("JOB_LIMIT", {"max_jobs": "1"})
    public = status_pb2.Status.FromString(trailer[0][1])
    info = details_pb2.ErrorInfo()
    assert public.details[0].Unpack(info) and info.reason == "JOB_LIMIT"
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", trailer))
    assert type(e) is ampd.JobLimit and e.metadata == {"max_jobs": "1"}
