"""google.rpc.Status and google.rpc.ErrorInfo, decoded without shipping google/rpc.

ampd attaches a google.rpc.Status holding one google.rpc.ErrorInfo to every
error, in the trailer grpc-status-details-bin. Generated modules for those two
messages would have to live at google/rpc/*_pb2.py, where they clash with
googleapis-common-protos, and registering google/rpc/status.proto twice in
protobuf's default pool fails. So the two messages (and google.protobuf.Any,
copied from protobuf's own descriptor) are built here, in code, in a private
DescriptorPool that nothing else sees.
"""
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory

_FD = descriptor_pb2.FieldDescriptorProto


def _field(message, name, number, ftype, label=_FD.LABEL_OPTIONAL, type_name=None):
    f = message.field.add(name=name, number=number, type=ftype, label=label)
    if type_name:
        f.type_name = type_name
    return f


def _build_pool():
    pool = descriptor_pool.DescriptorPool()
    any_file = descriptor_pb2.FileDescriptorProto()
    any_pb2.DESCRIPTOR.CopyToProto(any_file)
    pool.Add(any_file)

    status_file = descriptor_pb2.FileDescriptorProto(
        name="google/rpc/status.proto", package="google.rpc", syntax="proto3",
        dependency=["google/protobuf/any.proto"])
    status = status_file.message_type.add(name="Status")
    _field(status, "code", 1, _FD.TYPE_INT32)
    _field(status, "message", 2, _FD.TYPE_STRING)
    _field(status, "details", 3, _FD.TYPE_MESSAGE, _FD.LABEL_REPEATED, ".google.protobuf.Any")
    pool.Add(status_file)

    details_file = descriptor_pb2.FileDescriptorProto(
        name="google/rpc/error_details.proto", package="google.rpc", syntax="proto3")
    info = details_file.message_type.add(name="ErrorInfo")
    _field(info, "reason", 1, _FD.TYPE_STRING)
    _field(info, "domain", 2, _FD.TYPE_STRING)
    _field(info, "metadata", 3, _FD.TYPE_MESSAGE, _FD.LABEL_REPEATED,
           ".google.rpc.ErrorInfo.MetadataEntry")
    entry = info.nested_type.add(name="MetadataEntry")
    entry.options.map_entry = True
    _field(entry, "key", 1, _FD.TYPE_STRING)
    _field(entry, "value", 2, _FD.TYPE_STRING)
    pool.Add(details_file)
    return pool


def _message_class(pool, full_name):
    descriptor = pool.FindMessageTypeByName(full_name)
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


_POOL = _build_pool()
Status = _message_class(_POOL, "google.rpc.Status")
ErrorInfo = _message_class(_POOL, "google.rpc.ErrorInfo")
_ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo"

STATUS_DETAILS_KEY = "grpc-status-details-bin"


def error_info_from_trailers(trailing_metadata):
    """(reason, domain, metadata dict) of the first ErrorInfo, or None.

    A trailer that does not parse is treated as absent: an error's code and
    message are still there, and a malformed detail must not hide them.
    """
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY:
            continue
        try:
            status = Status.FromString(value)
            for detail in status.details:
                if detail.type_url == _ERROR_INFO_URL:
                    info = ErrorInfo.FromString(detail.value)
                    return info.reason, info.domain, dict(info.metadata)
        except Exception:  # noqa: BLE001 (DecodeError's class differs per backend)
            return None
    return None
