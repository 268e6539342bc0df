"""Frames: a message as one header (preamble + orjson + small inline buffers) plus raw buffers.

No I/O here. Layout of the header bytes:

    preamble  16 bytes  b"ILLM", protocol version u16, flags u16, json length u32,
                        inline length u32 (little-endian)
    json      orjson    {"t": type, "v": type version, "id": msg id, "re": reply-to id or null,
                         "f": {field: value}, "x": {tensor field: [dtype, shape] or a list of
                         them}, "b": [[nbytes, where], ...]}
              where: 0 a separate UCX message, 1 inside the header, 2 followed by an
              offset: in the sender's shared-memory region (``shared_memory``), or 3
              followed by a pool id and a list of row ids: those rows of a device pool of
              the sender's that the receiver mapped (``device_pools``)
    inline    bytes     the inline buffers, concatenated in buffer order
    end mark  8 bytes   b"ILLE", the header's whole length u32 (little-endian)

Buffers follow the header in order, one per tensor (tuple fields give one per element), each
the tensor's raw bytes. Small host buffers travel inside the header so that a small message is
one transfer; a host buffer that the sender placed in its shared-memory region travels as its
offset there, and rows of a pool that the receiver mapped as their ids. Nested records are JSON arrays in field order.

The end mark is how a header that came over UCX shows it came whole: UCX receives it into a
buffer of the largest size allowed and does not say how many bytes it wrote, so a header cut
short would otherwise be read to its announced length out of whatever the buffer held before.

``decode_header`` refuses anything malformed with ``ProtocolError``, never another exception:
the receiver answers with ``ErrorReply`` and closes the connection. It builds the message with
``TensorSpec``s in place of tensors, so the message's own checks run before any buffer is
received, and the receiver can place the buffers (``KVBlocks`` straight into reserved blocks).
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import typing
from dataclasses import dataclass
from enum import StrEnum

import orjson
import torch

from infinite_llm.transport import messages as messages_module
from infinite_llm.transport.device_pools import PoolRows
from infinite_llm.transport.errors import ProtocolError
from infinite_llm.transport.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    Message,
    WireArray,
)
from infinite_llm.transport.tensors import (
    DTYPE_ITEMSIZE,
    TORCH_DTYPE_NAMES,
    TensorSpec,
    host_tensor_from_bytes,
    is_cuda,
    nbytes_of,
    spec_of,
    wait_for_producers,
    wire_view,
)

MAGIC = b"ILLM"
PREAMBLE = struct.Struct("<4sHHII")
END_MAGIC = b"ILLE"
TRAILER = struct.Struct("<4sI")  # the end mark: END_MAGIC, the header's length
FLAG_WANTS_REPLY = 0x1
_MAX_INT = (1 << 63) - 1
_MIN_INT = -_MAX_INT - 1
_MAX_DIMS = 8


@dataclass(frozen=True)
class FrameLimits:
    """What a receiver accepts; anything beyond is refused before it is allocated."""

    max_header_bytes: int = 1 << 20  # whole header: preamble + json + inline + end mark, bytes
    inline_limit_bytes: int = 8192  # host buffers inlined into the header, bytes (sender side)
    # Device buffers staged through host memory and inlined, bytes (sender side). On the H200
    # machine a 1 KiB device round trip took 0.76-0.91 ms staged against 0.86-1.15 ms sent
    # GPU-to-GPU, while from 16 KiB up the copies through pageable host memory cost more than
    # they save (64 KiB: 1.19-1.50 ms staged, 0.82-1.34 ms not): a decode step's query rows
    # (8 KiB for 32 heads of 128 in bf16) are staged, attend results and KV blocks are not.
    inline_cuda_limit_bytes: int = 8 << 10
    max_buffers: int = 4096  # buffers per frame
    max_buffer_bytes: int = 1 << 32  # one buffer, bytes
    max_total_buffer_bytes: int = 1 << 34  # all buffers of a frame, bytes


class HeaderTooLarge(ValueError):
    """``encode``: the message's header would exceed the ``max_header_bytes`` it was given,
    so its receiver would refuse it (and close the connection). A ValueError, as the other
    messages that cannot travel (a non-contiguous tensor, a dtype the wire lacks)."""


@dataclass(frozen=True)
class EncodedFrame:
    header: bytes  # preamble + json + inline buffers + end mark
    buffers: tuple[object, ...]  # byte views of the buffers that are not inline, in order


@dataclass(frozen=True)
class FrameHeader:
    """A decoded header: the message with a TensorSpec in place of each tensor."""

    message: Message  # tensor fields hold TensorSpec
    msg_id: int
    reply_to: int | None  # the msg_id this frame answers, None for a request
    wants_reply: bool
    specs: tuple[TensorSpec, ...]  # one per buffer, in buffer order
    inline: tuple[bool, ...]  # per buffer: carried inside the header
    inline_bytes: bytes | memoryview  # the inline buffers, concatenated
    # Per buffer: its offset in the sender's shared-memory region, -1 where it is not there;
    # empty where no buffer of the frame is.
    shared_offsets: tuple[int, ...] = ()
    # Where some are: the sender's time (CLOCK_MONOTONIC, ns) from which they are not read.
    shared_until_ns: int = 0
    # Per buffer: (pool id, row ids) where it is rows of a pool of the sender's that the
    # receiver mapped, else None; empty where no buffer of the frame is.
    pool_rows: tuple[tuple[int, tuple[int, ...]] | None, ...] = ()

    @property
    def num_wire_buffers(self) -> int:
        """Buffers that arrive as UCX messages of their own."""
        return (len(self.inline) - sum(self.inline) - sum(o >= 0 for o in self.shared_offsets)
                - sum(r is not None for r in self.pool_rows))


# --- schema: how each field of each message type is encoded -------------------------------


@dataclass(frozen=True)
class _Field:
    name: str
    kind: str  # "int" | "bool" | "str" | "enum" | "record" | "tuple" | "tensor" | "tensors"
    type_: type | None = None  # enum or record class
    item: "_Field | None" = None  # element of a tuple


def _field_of(name: str, hint: object) -> _Field:
    if hint is int:
        return _Field(name, "int")
    if hint is bool:
        return _Field(name, "bool")
    if hint is str:
        return _Field(name, "str")
    if hint is WireArray:
        return _Field(name, "tensor")
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return _Field(name, "enum", hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _Field(name, "record", hint)
    if typing.get_origin(hint) is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        if item_hint is WireArray:
            return _Field(name, "tensors")
        return _Field(name, "tuple", item=_field_of(name, item_hint))
    raise TypeError(f"field {name}: no wire encoding for {hint}")


def _fields_of(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls, vars(messages_module))
    return tuple(
        _field_of(f.name, hints[f.name]) for f in dataclasses.fields(cls)
    )


# A field's encoder turns its value into JSON-ready data (None: the value as it is); its
# decoder checks the JSON data and returns the value, or raises ProtocolError. Both are built
# once per type from the schema: a generic walk of the schema per message cost more than
# orjson itself on a small message's round trip.
_Encoder = typing.Callable[[object], object]
_Decoder = typing.Callable[[object], object]


@dataclass(frozen=True)
class _TypePlan:
    """How one message type (or record) crosses the wire."""

    fields: tuple[_Field, ...]
    plain: tuple[tuple[str, _Encoder | None, _Decoder], ...]  # non-tensor fields, in order
    tensors: tuple[tuple[str, bool], ...]  # tensor fields in buffer order: (name, a tuple of them)
    plain_names: frozenset[str]  # the header's "f" keys
    tensor_names: frozenset[str]  # the header's "x" keys


_PLANS: dict[type, _TypePlan] = {}


def _plan_of(cls: type) -> _TypePlan:
    plan = _PLANS.get(cls)
    if plan is None:
        fields = _fields_of(cls)
        plan = _PLANS[cls] = _TypePlan(
            fields=fields,
            plain=tuple((f.name, _encoder_of(f), _decoder_of(f)) for f in fields if f.kind not in ("tensor", "tensors")),
            tensors=tuple((f.name, f.kind == "tensors") for f in fields if f.kind in ("tensor", "tensors")),
            plain_names=frozenset(f.name for f in fields if f.kind not in ("tensor", "tensors")),
            tensor_names=frozenset(f.name for f in fields if f.kind in ("tensor", "tensors")),
        )
    return plan


def _schema(cls: type) -> tuple[_Field, ...]:
    return _plan_of(cls).fields


def _encoder_of(field: _Field) -> _Encoder | None:
    kind = field.kind
    if kind in ("int", "bool", "str"):
        return None
    if kind == "enum":
        return _enum_value
    if kind == "record":
        parts = tuple((f.name, _encoder_of(f)) for f in _schema(field.type_))

        def encode_record(value: object) -> list:
            return [getattr(value, name) if enc is None else enc(getattr(value, name)) for name, enc in parts]
        return encode_record
    item = _encoder_of(field.item)
    if item is None:
        return list
    return lambda value: [item(v) for v in value]  # tuple


def _enum_value(value: StrEnum) -> str:
    return value.value


def _bad(field: _Field, raw: object) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_FIELDS, f"{field.name}: bad {field.kind} {raw!r:.80}")


def _decoder_of(field: _Field) -> _Decoder:
    kind = field.kind
    if kind == "int":
        def decode_int(raw: object) -> int:
            if type(raw) is int and -_MAX_INT - 1 <= raw <= _MAX_INT:
                return raw
            raise _bad(field, raw)
        return decode_int
    if kind in ("bool", "str"):
        wanted = bool if kind == "bool" else str

        def decode_exact(raw: object) -> object:
            if type(raw) is wanted:
                return raw
            raise _bad(field, raw)
        return decode_exact
    if kind == "enum":
        members = field.type_._value2member_map_
        enum_cls = field.type_

        def decode_enum(raw: object) -> StrEnum:
            if type(raw) is str and raw in members:
                return enum_cls(raw)
            raise _bad(field, raw)
        return decode_enum
    if kind == "record":
        record_cls = field.type_
        decoders = tuple(_decoder_of(f) for f in _schema(record_cls))
        count = len(decoders)

        def decode_record(raw: object) -> object:
            if type(raw) is list and len(raw) == count:
                values = [dec(v) for dec, v in zip(decoders, raw)]
                try:
                    return record_cls(*values)  # a record's fields are its schema, in order
                except (ValueError, TypeError) as e:
                    raise ProtocolError(ErrorCode.INVALID_FIELDS, f"{field.name}: {e}") from None
            raise _bad(field, raw)
        return decode_record
    item = _decoder_of(field.item)  # tuple

    def decode_tuple(raw: object) -> tuple:
        if type(raw) is list:
            return tuple(item(v) for v in raw)
        raise _bad(field, raw)
    return decode_tuple


MESSAGE_CLASSES = frozenset(MESSAGE_TYPES.values())  # the wire's message types
for _cls in MESSAGE_TYPES.values():  # every type's schema is checked at import
    _plan_of(_cls)


# --- encoding ------------------------------------------------------------------------------


def _spec_entry(array: WireArray) -> list:
    """``[dtype name, shape]`` of a tensor, as the header carries it."""
    if isinstance(array, (torch.Tensor, PoolRows)):
        name = TORCH_DTYPE_NAMES.get(array.dtype)
        if name is None:
            raise ValueError(f"dtype {array.dtype} cannot travel on the wire")
        return [name, list(array.shape)]
    spec = spec_of(array)
    return [spec.dtype, list(spec.shape)]


def _inline_host_bytes(array: WireArray, nbytes: int) -> bytes:
    """The bytes of a host array, copied once (a torch tensor straight from its memory)."""
    if isinstance(array, torch.Tensor):
        if not array.is_cpu:
            raise ValueError(f"cannot send a tensor on {array.device}")
        if not array.is_contiguous():
            raise ValueError("tensor must be contiguous")
        return ctypes.string_at(array.data_ptr(), nbytes) if nbytes else b""
    return bytes(wire_view(array))


def unencodable_reply(reply: Message, error: Exception) -> ErrorReply:
    """What a requester hears in place of a reply that could not be encoded (a handler's bad
    tensor): the connection serves on."""
    # Bounded: the ErrorReply itself must fit in a header.
    return ErrorReply(ErrorCode.HANDLER_FAILED,
                      f"the {type_name(reply)} reply could not be encoded: {type(error).__name__}: {error}"[:2000])


def type_name(message: object) -> str:
    """A message's wire type, or the Python type's name of something that is no message (a
    handler's return value)."""
    return getattr(type(message), "TYPE", type(message).__name__)


def encode(
    message: Message,
    msg_id: int,
    *,
    reply_to: int | None = None,
    wants_reply: bool = True,
    inline_limit_bytes: int = FrameLimits.inline_limit_bytes,
    inline_cuda_limit_bytes: int = FrameLimits.inline_cuda_limit_bytes,
    place_shared: typing.Callable[[WireArray], int | None] | None = None,
    max_header_bytes: int = FrameLimits.max_header_bytes,
    device_ready: bool = False,
    place_rows: typing.Callable[[PoolRows], int | None] | None = None,
    shared_until_ns: int = 0,
) -> EncodedFrame:
    """The frame of ``message``. Tensors must be C-contiguous; nothing is copied except the
    small buffers that go inline: host buffers up to ``inline_limit_bytes`` in all, device
    buffers up to ``inline_cuda_limit_bytes`` in all (copied to the host first, which waits for
    the current CUDA stream). A frame with device buffers that UCX reads in place waits for
    the current stream of their devices: UCX's copies run on streams of its own, which would
    not otherwise wait for the kernels that wrote those buffers; ``device_ready`` says the
    caller has waited for them already (an event it polled from its event loop).

    ``place_shared``: for a host buffer that is not inline, its offset in the sender's
    shared-memory region (placing it there), or None to send it over UCX. A frame with such
    buffers carries ``shared_until_ns`` (CLOCK_MONOTONIC, ns): the receiver copies nothing out
    of the sender's slots from then on, so that the sender may use them again a little later
    whether or not a reply came.

    ``place_rows``: for a ``PoolRows`` buffer, the id under which the receiver mapped its pool,
    or None; such rows travel as their ids. Rows whose pool it has not mapped are gathered
    here, on the current stream, and sent as any device buffer (waited for whatever
    ``device_ready`` says: the gather is queued now).

    Raises ``HeaderTooLarge`` (a ValueError) where the header (preamble, JSON, inline
    buffers and end mark) would exceed ``max_header_bytes``, which the receiver refuses: a sender passes its
    ``FrameLimits.max_header_bytes`` (the cluster's transports share one configuration)."""
    cls = type(message)
    if cls not in MESSAGE_CLASSES:
        raise TypeError(f"a {type_name(message)} is not a message of the wire")
    plan = _plan_of(cls)
    fields = {name: getattr(message, name) if enc is None else enc(getattr(message, name))
              for name, enc, _dec in plan.plain}
    tensor_specs: dict[str, object] = {}
    arrays: list[WireArray] = []
    for name, group in plan.tensors:
        value = getattr(message, name)
        if group:
            tensor_specs[name] = [_spec_entry(v) for v in value]
            arrays.extend(value)
        else:
            tensor_specs[name] = _spec_entry(value)
            arrays.append(value)

    buffer_table: list[list] = []  # [nbytes, where], [nbytes, 2, offset] or [nbytes, 3, pool id, rows]
    inline_parts: list[bytes] = []
    wire_buffers: list[object] = []
    inline_total = inline_host = inline_cuda = 0
    posted_device_arrays: list[WireArray] = []
    gathered_here = placed_shared = False
    for array in arrays:
        if type(array) is PoolRows:
            pool_id = place_rows(array) if place_rows is not None else None
            if pool_id is not None:
                buffer_table.append([array.nbytes, 3, pool_id, list(array.rows)])
                continue
            array = array.gather()
            gathered_here = gathered_here or array.is_cuda
        if isinstance(array, torch.Tensor):
            nbytes, on_device = array.nbytes, array.is_cuda
        else:
            nbytes, on_device = nbytes_of(array), is_cuda(array)
        if on_device:
            inline = inline_cuda + nbytes <= inline_cuda_limit_bytes
        else:
            inline = inline_host + nbytes <= inline_limit_bytes
        buffer_table.append([nbytes, int(inline)])
        if inline:
            if on_device:
                inline_parts.append(_host_bytes(wire_view(array)))
                inline_cuda += nbytes
            else:
                inline_parts.append(_inline_host_bytes(array, nbytes))
                inline_host += nbytes
            inline_total += nbytes
        elif nbytes > 0:  # an empty buffer is never sent
            if place_shared is not None and not on_device:
                offset = place_shared(array)
                if offset is not None:
                    buffer_table[-1] = [nbytes, 2, offset]
                    placed_shared = True
                    continue
            wire_buffers.append(wire_view(array))
            if on_device:
                posted_device_arrays.append(array)
    if posted_device_arrays and (not device_ready or gathered_here):
        wait_for_producers(posted_device_arrays)

    envelope = {"t": cls.TYPE, "v": cls.VERSION, "id": msg_id, "re": reply_to,
                "f": fields, "x": tensor_specs, "b": buffer_table}
    if placed_shared:
        if shared_until_ns <= 0:
            raise ValueError("buffers placed in shared memory need shared_until_ns")
        envelope["su"] = shared_until_ns
    body = orjson.dumps(envelope)
    header_bytes = PREAMBLE.size + len(body) + inline_total + TRAILER.size
    if header_bytes > max_header_bytes:
        raise HeaderTooLarge(f"a {cls.TYPE} header of {header_bytes} bytes is over the "
                             f"{max_header_bytes}-byte limit")
    flags = FLAG_WANTS_REPLY if wants_reply else 0
    preamble = PREAMBLE.pack(MAGIC, PROTOCOL_VERSION, flags, len(body), inline_total)
    frame = object.__new__(EncodedFrame)  # as in decode_header: no field-by-field frozen __init__
    frame.__dict__.update(header=b"".join([preamble, body, *inline_parts, TRAILER.pack(END_MAGIC, header_bytes)]),
                          buffers=tuple(wire_buffers))
    return frame


def _host_bytes(device_view: object) -> bytes:
    """The bytes of a flat uint8 device array (torch or cupy), copied to the host."""
    import torch

    return torch.as_tensor(device_view, device="cuda").cpu().numpy().tobytes()


# --- decoding ------------------------------------------------------------------------------


def frame_length(preamble: bytes | memoryview) -> int:
    """Total header length announced by a preamble (``PREAMBLE.size`` bytes), end mark included."""
    _magic, _version, _flags, json_len, inline_len = PREAMBLE.unpack(preamble)
    return PREAMBLE.size + json_len + inline_len + TRAILER.size


def header_bytes(body: bytes, inline: bytes = b"", flags: int = 0, *, magic: bytes = MAGIC,
                 version: int = PROTOCOL_VERSION) -> bytes:
    """A header of ``body`` (the JSON's bytes) and ``inline``, with its preamble and end mark,
    as ``encode`` lays it out: for frames made by hand (tests, tools)."""
    size = PREAMBLE.size + len(body) + len(inline) + TRAILER.size
    return b"".join([PREAMBLE.pack(magic, version, flags, len(body), len(inline)), body, inline,
                     TRAILER.pack(END_MAGIC, size)])


def decode_header(data: bytes | memoryview, limits: FrameLimits) -> FrameHeader:
    """Parse and check one header; ``data`` is exactly the header's bytes.

    Raises ProtocolError for every malformed input, and nothing else.
    """
    # Each stage checks a well-formed frame in one condition, and hands anything else to its
    # refusal, which finds the first fault in order and says what it is: a small frame's decode
    # is on every round trip's critical path twice, and most of its cost was the checks.
    size = len(data)
    if not PREAMBLE.size <= size <= limits.max_header_bytes:
        raise _preamble_refusal(data, limits)
    magic, version, flags, json_len, inline_len = PREAMBLE.unpack_from(data)
    if (magic != MAGIC or version != PROTOCOL_VERSION or flags & ~FLAG_WANTS_REPLY
            or PREAMBLE.size + json_len + inline_len + TRAILER.size != size
            or TRAILER.unpack_from(data, size - TRAILER.size) != (END_MAGIC, size)):
        raise _preamble_refusal(data, limits)
    try:
        # A view: orjson reads it in place, where bytes() would copy the JSON first.
        body = orjson.loads(memoryview(data)[PREAMBLE.size:PREAMBLE.size + json_len])
    except orjson.JSONDecodeError as e:
        raise ProtocolError(ErrorCode.INVALID_JSON, str(e)) from None

    try:
        cls = MESSAGE_TYPES[body["t"]]
        type_version, msg_id, fields, tensor_fields, table = (
            body["v"], body["id"], body["f"], body["x"], body["b"])
        reply_to = body.get("re")
    except (KeyError, TypeError):  # a key missing, a type unhashable, or not an object
        raise _envelope_refusal(body, limits) from None
    if not (type(type_version) is int and type_version == cls.VERSION  # not true, not 1.0
            and type(msg_id) is int and _MIN_INT <= msg_id <= _MAX_INT
            and (reply_to is None or (type(reply_to) is int and _MIN_INT <= reply_to <= _MAX_INT))
            and type(fields) is dict and type(tensor_fields) is dict
            and type(table) is list and len(table) <= limits.max_buffers):
        raise _envelope_refusal(body, limits)

    plan = _plan_of(cls)
    # Each field under its own key: a plain field under "x" or a tensor under "f" is refused.
    if fields.keys() != plan.plain_names or tensor_fields.keys() != plan.tensor_names:
        raise ProtocolError(ErrorCode.INVALID_FIELDS, f"fields of {cls.TYPE} do not match")
    kwargs = {name: dec(fields[name]) for name, _enc, dec in plan.plain}
    specs: list[TensorSpec] = []
    for name, group in plan.tensors:
        if group:
            raw = tensor_fields[name]
            if type(raw) is not list:
                raise ProtocolError(ErrorCode.INVALID_FIELDS, f"{name}: not a list")
            kwargs[name] = value = tuple([_decode_spec(r, limits) for r in raw])
            specs.extend(value)
        else:
            kwargs[name] = spec = _decode_spec(tensor_fields[name], limits)
            specs.append(spec)

    inline, shared_offsets, pool_rows = _check_buffer_table(table, specs, inline_len, limits)
    shared_until_ns = 0
    if shared_offsets:
        shared_until_ns = body.get("su")
        if type(shared_until_ns) is not int or not 0 < shared_until_ns <= _MAX_INT:
            raise ProtocolError(ErrorCode.INVALID_FIELDS, "buffers in shared memory need 'su', the time "
                                "(CLOCK_MONOTONIC, ns) after which they are not read")
    try:
        message = cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ProtocolError(ErrorCode.INVALID_FIELDS, f"{cls.TYPE}: {e}") from None
    # Filled in directly: a frozen dataclass's __init__ sets each field through
    # object.__setattr__, a tenth of a small frame's decode.
    header = object.__new__(FrameHeader)
    header.__dict__.update(
        message=message,
        msg_id=msg_id,
        reply_to=reply_to,
        wants_reply=bool(flags & FLAG_WANTS_REPLY),
        specs=tuple(specs),
        inline=inline,
        shared_offsets=shared_offsets,
        shared_until_ns=shared_until_ns,
        pool_rows=pool_rows,
        # Zero-copy where ``data`` is immutable bytes (the transports pass a fresh copy).
        inline_bytes=(memoryview(data)[PREAMBLE.size + json_len:size - TRAILER.size] if type(data) is bytes
                      else bytes(data[PREAMBLE.size + json_len:size - TRAILER.size])),
    )
    return header


def _preamble_refusal(data: bytes | memoryview, limits: FrameLimits) -> ProtocolError:
    """Why ``decode_header`` refuses a header's size or preamble."""
    if len(data) > limits.max_header_bytes:
        return ProtocolError(ErrorCode.OVERSIZED_FRAME, f"header of {len(data)} bytes")
    if len(data) < PREAMBLE.size:
        return ProtocolError(ErrorCode.TRUNCATED_FRAME, f"header of {len(data)} bytes")
    magic, version, flags, json_len, inline_len = PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        return ProtocolError(ErrorCode.BAD_MAGIC, repr(bytes(magic)))
    if version != PROTOCOL_VERSION:
        return ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version}")
    if flags & ~FLAG_WANTS_REPLY:
        return ProtocolError(ErrorCode.INVALID_FIELDS, f"unknown flags {flags:#06x}")
    expected = PREAMBLE.size + json_len + inline_len + TRAILER.size
    if expected > len(data):
        return ProtocolError(ErrorCode.TRUNCATED_FRAME, f"{len(data)} of {expected} bytes")
    if expected < len(data):
        return ProtocolError(ErrorCode.LENGTH_MISMATCH, f"{len(data)} bytes, {expected} announced")
    # The announced length, but not the end mark there: the header was cut short where it
    # came over UCX (its receive buffer held other bytes past the cut), or overwritten.
    return ProtocolError(ErrorCode.TRUNCATED_FRAME, f"no end mark in the last {TRAILER.size} of "
                         f"{expected} bytes: the header was cut short")


def _envelope_refusal(body: object, limits: FrameLimits) -> ProtocolError:
    """Why ``decode_header`` refuses a header's JSON object (its type, version, ids, the
    objects of its fields, its buffer table); a missing "re" reads as a request."""
    if not isinstance(body, dict):
        return ProtocolError(ErrorCode.INVALID_FIELDS, "header is not an object")
    cls = MESSAGE_TYPES.get(body.get("t")) if isinstance(body.get("t"), str) else None
    if cls is None:
        return ProtocolError(ErrorCode.UNKNOWN_TYPE, repr(body.get("t"))[:80])
    type_version = body.get("v")
    if type(type_version) is not int or type_version != cls.VERSION:
        return ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"{cls.TYPE} version {type_version!r:.40}")
    reply_to = body.get("re")
    if not _is_int(body.get("id")) or not (reply_to is None or _is_int(reply_to)):
        return ProtocolError(ErrorCode.INVALID_FIELDS, "id and re must be integers")
    if not isinstance(body.get("f"), dict) or not isinstance(body.get("x"), dict):
        return ProtocolError(ErrorCode.INVALID_FIELDS, "f and x must be objects")
    table = body.get("b")
    if not isinstance(table, list):
        return ProtocolError(ErrorCode.INVALID_FIELDS, "b must be a list")
    return ProtocolError(ErrorCode.TOO_MANY_BUFFERS, f"{len(table)} buffers")


# The codes of a frame refused by its receiver (``decode_header``'s, and a frame whose buffers
# disagree with its header): the refusal closes the connection.
REFUSAL_CODES = frozenset({
    ErrorCode.TRUNCATED_FRAME, ErrorCode.OVERSIZED_FRAME, ErrorCode.BAD_MAGIC,
    ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_TYPE, ErrorCode.INVALID_JSON,
    ErrorCode.INVALID_FIELDS, ErrorCode.LENGTH_MISMATCH, ErrorCode.BUFFER_TOO_LARGE,
    ErrorCode.TOO_MANY_BUFFERS,
})


def request_id_of(data: bytes | memoryview) -> int | None:
    """The id of a request whose header ``decode_header`` refused, where its JSON can be read
    (the refusal then answers that request); None otherwise. Only on the refusal path."""
    try:
        json_len = PREAMBLE.unpack_from(data)[3]
        body = orjson.loads(memoryview(data)[PREAMBLE.size:PREAMBLE.size + json_len])
        msg_id = body.get("id")
        if type(msg_id) is int and 0 <= msg_id <= _MAX_INT and body.get("re") is None:
            return msg_id
    except Exception:  # noqa: BLE001  (whatever it is, the frame is refused anyway)
        pass
    return None


def _check_buffer_table(
    table: list, specs: list[TensorSpec], inline_len: int, limits: FrameLimits
) -> tuple[tuple[bool, ...], tuple[int, ...], tuple]:
    """Per buffer, whether it is inline, the offsets of those in shared memory, and the pool
    ids and rows of those that are rows of a mapped pool (``FrameHeader``)."""
    # The common table first: each buffer [nbytes, 0|1], its byte count its tensor's (a spec
    # spans at most max_buffer_bytes, ``_decode_spec``); anything else is checked below.
    if len(table) == len(specs):
        inline = []
        total = inline_total = 0
        for entry, spec in zip(table, specs):
            if type(entry) is not list or len(entry) != 2:
                break
            nbytes, where = entry
            if nbytes != spec.nbytes or type(nbytes) is not int or type(where) is not int or not 0 <= where <= 1:
                break
            total += nbytes
            if where:
                inline_total += nbytes
            inline.append(where == 1)
        else:
            if inline_total == inline_len and total <= limits.max_total_buffer_bytes:
                return tuple(inline), (), ()
    return _check_any_buffer_table(table, specs, inline_len, limits)


def _check_any_buffer_table(
    table: list, specs: list[TensorSpec], inline_len: int, limits: FrameLimits
) -> tuple[tuple[bool, ...], tuple[int, ...], tuple]:
    if len(table) != len(specs):
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH,
                            f"{len(table)} buffers for {len(specs)} tensors")
    inline: list[bool] = []
    shared: list[int] | None = None
    pool_rows: list | None = None
    total = inline_total = 0
    for i, (entry, spec) in enumerate(zip(table, specs)):
        if not (isinstance(entry, list) and _is_int(entry[0] if entry else None)
                and ((len(entry) == 2 and entry[1] in (0, 1) and type(entry[1]) is int)
                     or (len(entry) == 3 and entry[1] == 2 and type(entry[1]) is int
                         and _is_int(entry[2]) and entry[2] >= 0)
                     or (len(entry) == 4 and entry[1] == 3 and type(entry[1]) is int
                         and _is_int(entry[2]) and entry[2] >= 0 and _are_rows(entry[3])))):
            raise ProtocolError(ErrorCode.INVALID_FIELDS, "a buffer entry is [nbytes, 0|1], [nbytes, 2, offset] "
                                "or [nbytes, 3, pool id, [row id, ...]]")
        nbytes, where = entry[0], entry[1]
        if nbytes > limits.max_buffer_bytes:
            raise ProtocolError(ErrorCode.BUFFER_TOO_LARGE, f"buffer of {nbytes} bytes")
        if nbytes != spec.nbytes:
            raise ProtocolError(ErrorCode.LENGTH_MISMATCH,
                                f"buffer of {nbytes} bytes for a {spec.nbytes}-byte tensor")
        total += nbytes
        if where == 1:
            inline_total += nbytes
        elif where == 2:
            if shared is None:
                shared = [-1] * len(table)
            shared[i] = entry[2]
        elif where == 3:
            if nbytes % len(entry[3]):
                raise ProtocolError(ErrorCode.LENGTH_MISMATCH,
                                    f"a buffer of {nbytes} bytes in {len(entry[3])} rows of one size")
            if pool_rows is None:
                pool_rows = [None] * len(table)
            pool_rows[i] = (entry[2], tuple(entry[3]))
        inline.append(where == 1)
    if total > limits.max_total_buffer_bytes:
        raise ProtocolError(ErrorCode.BUFFER_TOO_LARGE, f"buffers of {total} bytes")
    if inline_total != inline_len:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH,
                            f"inline buffers of {inline_total} bytes, {inline_len} carried")
    return (tuple(inline), (() if shared is None else tuple(shared)),
            (() if pool_rows is None else tuple(pool_rows)))


def _are_rows(rows: object) -> bool:
    """A buffer's row ids: a non-empty list of ints >= 0 (each checked against the pool when
    the buffer lands)."""
    return type(rows) is list and len(rows) > 0 and all(type(r) is int and 0 <= r <= _MAX_INT for r in rows)


def _is_int(value: object) -> bool:
    return type(value) is int and -_MAX_INT - 1 <= value <= _MAX_INT


# Specs decoded before, by (dtype, *shape), each with its span (below): a frame's tensors
# mostly have shapes seen before, and making a frozen spec costs more than the rest of a small
# frame's field.
_DECODED_SPECS_KEPT = 4096
_decoded_specs: dict[tuple, tuple[TensorSpec, int]] = {}


def _decode_spec(raw: object, limits: FrameLimits) -> TensorSpec:
    if type(raw) is list and len(raw) == 2:
        dtype, shape = raw
        if (type(dtype) is str and dtype in DTYPE_ITEMSIZE and type(shape) is list and len(shape) <= _MAX_DIMS
                and all(type(d) is int and 0 <= d <= _MAX_INT for d in shape)):
            # Looked up only once checked: a float or bool dimension, equal to an int as a key,
            # is refused above.
            key = (dtype, *shape)
            known = _decoded_specs.get(key)
            if known is None:
                spec = TensorSpec(dtype=dtype, shape=tuple(shape))
                # The bytes the shape spans with its empty dimensions counted as one: a tensor's
                # strides reach that far, and an empty tensor of huge other dimensions (no
                # bytes, so no cap on buffers applies) would overflow torch's stride
                # calculation. Its byte count where none is empty.
                span = DTYPE_ITEMSIZE[dtype]
                for d in shape:
                    span *= d or 1
                if span > _MAX_INT:
                    raise ProtocolError(ErrorCode.BUFFER_TOO_LARGE, f"tensor of shape {spec.shape}")
                if len(_decoded_specs) >= _DECODED_SPECS_KEPT:
                    _decoded_specs.clear()  # start again: the shapes in use now are kept
                _decoded_specs[key] = known = (spec, span)
            spec, span = known
            if span > limits.max_buffer_bytes:  # per receiver: its limits may differ
                raise ProtocolError(ErrorCode.BUFFER_TOO_LARGE, f"tensor of shape {spec.shape}")
            return spec
    raise ProtocolError(ErrorCode.INVALID_FIELDS, f"bad tensor spec {raw!r:.80}")


# --- receiving the buffers -----------------------------------------------------------------


def check_destinations(header: FrameHeader, destinations: typing.Sequence[WireArray]) -> None:
    """Each destination must have exactly its buffer's byte count and be contiguous."""
    if len(destinations) != len(header.specs):
        raise ValueError(f"{len(destinations)} destinations for {len(header.specs)} buffers")
    for dest, spec in zip(destinations, header.specs):
        if nbytes_of(dest) != spec.nbytes:
            raise ValueError(f"destination of {nbytes_of(dest)} bytes for {spec.nbytes}")
        wire_view(dest)  # raises for a non-contiguous destination


def fill_inline(header: FrameHeader, destinations: typing.Sequence[WireArray]) -> None:
    """Copy the inline buffers out of the header into their destinations (checked first)."""
    land_inline(header, destinations)


def _copy_host_to_device(view: object, chunk: bytes) -> None:
    import torch

    host = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
    torch.as_tensor(view, device="cuda").copy_(host)


def wire_destinations(
    header: FrameHeader, destinations: typing.Sequence[WireArray]
) -> list[object]:
    """Byte views of the destinations that arrive as separate buffers, in order."""
    shared = header.shared_offsets or (-1,) * len(header.specs)
    rows = header.pool_rows or (None,) * len(header.specs)
    return [
        wire_view(dest)
        for dest, spec, inline, offset, pulled in zip(destinations, header.specs, header.inline, shared, rows)
        if not inline and offset < 0 and pulled is None and spec.nbytes > 0
    ]


def land_inline(header: FrameHeader, destinations: typing.Sequence[WireArray]) -> list[object]:
    """``check_destinations``, ``fill_inline`` and ``wire_destinations`` in one pass (one byte
    view per destination): the receive path of every frame. Returns the byte views of the
    destinations whose buffers arrive as UCX messages of their own, in order (those in the
    sender's shared memory are ``shared_destinations``)."""
    if len(destinations) != len(header.specs):
        raise ValueError(f"{len(destinations)} destinations for {len(header.specs)} buffers")
    separate: list[object] = []
    offset = 0
    shared = header.shared_offsets
    pulled = header.pool_rows
    for i, (dest, spec, inline) in enumerate(zip(destinations, header.specs, header.inline)):
        if nbytes_of(dest) != spec.nbytes:
            raise ValueError(f"destination of {nbytes_of(dest)} bytes for {spec.nbytes}")
        view = wire_view(dest)  # raises for a non-contiguous destination
        if spec.nbytes == 0:
            continue
        if not inline:
            if (not shared or shared[i] < 0) and (not pulled or pulled[i] is None):
                separate.append(view)
            continue
        chunk = header.inline_bytes[offset:offset + spec.nbytes]
        if hasattr(view, "__cuda_array_interface__"):
            _copy_host_to_device(view, chunk)
        else:
            view[:] = memoryview(chunk)
        offset += spec.nbytes
    return separate


def shared_destinations(
    header: FrameHeader, destinations: typing.Sequence[WireArray]
) -> list[tuple[object, int, int]]:
    """(byte view, offset, nbytes) of each destination whose buffer lies in the sender's
    shared-memory region, in order (destinations checked by ``land_inline``)."""
    return [
        (wire_view(dest), offset, spec.nbytes)
        for dest, spec, offset in zip(destinations, header.specs, header.shared_offsets)
        if offset >= 0 and spec.nbytes > 0
    ]


def pool_row_destinations(
    header: FrameHeader, destinations: typing.Sequence[WireArray]
) -> list[tuple[WireArray, int, tuple[int, ...]]]:
    """(destination, pool id, row ids) of each buffer that is rows of a pool the receiver
    mapped, in order (destinations checked by ``land_inline``)."""
    return [(dest, *pulled) for dest, pulled in zip(destinations, header.pool_rows) if pulled is not None]


def host_tensors_of_inline(header: FrameHeader) -> list[WireArray]:
    """The tensors of a frame whose buffers all came inline, in host memory, made from the
    header's bytes: the receive path of small frames landing on the host. One copy of the
    inline bytes and two torch calls a tensor, where allocating a destination and landing into
    it (``land_inline``) take about eight; on a decode layer's critical path, with the caches
    cold after the step's own work, each torch call costs several microseconds on the CPU and
    tens on a GPU host."""
    if not all(header.inline):
        raise ValueError("a buffer of this frame arrives separately")
    sizes = [spec.nbytes for spec in header.specs]
    if sum(sizes) != len(header.inline_bytes):
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH,
                            f"{len(header.inline_bytes)} inline bytes for buffers of {sum(sizes)}")
    data = bytearray(header.inline_bytes)  # writable, and the tensors' own
    tensors: list[WireArray] = []
    offset = 0
    for spec, nbytes in zip(header.specs, sizes):
        # Inline buffers lie back to back: one that starts off a 16-byte boundary gets memory
        # of its own, so that no tensor is misaligned for its dtype's vector loads.
        if offset % 16:
            tensors.append(host_tensor_from_bytes(spec, bytes(data[offset:offset + nbytes])))
        else:
            tensors.append(host_tensor_from_bytes(spec, data, offset))
        offset += nbytes
    return tensors


def assemble(header: FrameHeader, destinations: typing.Sequence[WireArray]) -> Message:
    """The message with its tensors, once every destination holds its bytes.

    The message is not built a second time (``dataclasses.replace`` would): its fields are
    taken over as decoded and its own checks run once more on the destinations, which a
    placer may have shaped otherwise than the specs."""
    message = header.message
    plan = _plan_of(type(message))
    if not plan.tensors:
        return message
    values = dict(message.__dict__)
    position = 0
    for name, group in plan.tensors:
        if group:
            count = len(values[name])
            values[name] = tuple(destinations[position:position + count])
            position += count
        else:
            values[name] = destinations[position]
            position += 1
    assembled = object.__new__(type(message))
    assembled.__dict__.update(values)
    check = getattr(assembled, "__post_init__", None)
    if check is not None:
        try:
            check()
        except (ValueError, TypeError) as e:
            raise ProtocolError(ErrorCode.INVALID_FIELDS, str(e)) from None
    return assembled
