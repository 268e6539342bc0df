"""Every message type round-trips through the codec; every malformed header is refused."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest
import torch

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.errors import ProtocolError
from infinite_llm.transport.tensors import TensorSpec, allocate, copy_bytes

LIMITS = codec.FrameLimits()


def roundtrip(message: m.Message, inline_limit_bytes: int = 8192) -> m.Message:
    frame = codec.encode(message, msg_id=3, inline_limit_bytes=inline_limit_bytes)
    header = codec.decode_header(frame.header, LIMITS)
    destinations = [allocate(spec, "cpu") for spec in header.specs]
    codec.fill_inline(header, destinations)
    for dest, src in zip(codec.wire_destinations(header, destinations), frame.buffers,
                         strict=True):
        copy_bytes(dest, src)
    return codec.assemble(header, destinations)


def q_rows(num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, 4, 8).to(torch.bfloat16)  # [num_rows, num_heads, head_dim]


def sample_messages() -> list[m.Message]:
    out = torch.randn(3, 4, 8).to(torch.bfloat16)
    return [
        m.Heartbeat(
            inst_id=2, seq=9, pool=m.PoolFigures(100, 40, 10, 5), batch_size=7,
            placement_base_version=3, placement_version=4,
            placement_upserts=(m.RequestPlacementEntry(11, 2, 6, True, movable=False),
                               m.RequestPlacementEntry(11, 5, 3, False)),
            placement_removals=(m.PlacementKey(12, 5),)),
        m.HeartbeatReply(epoch=17, acked_placement_version=4, needs_full_placement=False,
                         creditors=(m.CreditorHint(5, 60),)),
        m.AttendRequest(home_inst_id=2, creditor_inst_id=5, step_id=100, layer=3,
                        slices=(m.AttendSlice(11, 0, 1, 1, 48), m.AttendSlice(13, 1, 2, 0, 16)),
                        q=q_rows(3)),
        m.AttendResult(home_inst_id=2, creditor_inst_id=5, step_id=100, layer=3, out=out,
                       lse=torch.randn(3, 4)),
        m.TryMoveKV(epoch=17, move_id=1, req_id=11, home_inst_id=2, src_inst_id=2,
                    num_blocks=4, block_nbytes=4096),
        m.MoveReserved(move_id=1, reservation_id=8, dst_block_ids=(5, 6, 9, 10),
                       expires_in_ms=2000),
        m.MoveRejected(move_id=1, reason=m.MoveRejectReason.NO_SPACE, num_blocks_free=2),
        m.HoldKV(home_inst_id=2, req_id=11, num_blocks=40),
        m.HoldKV(home_inst_id=2, req_id=11, num_blocks=0, home_run=3, renew=True),
        m.KVHoldReply(num_blocks_held=40, num_blocks_free=12),
        m.KVBlocks(move_id=1, reservation_id=8, runs=(m.BlockRun(5, 2), m.BlockRun(9, 2)),
                   runs_data=(torch.randn(2, 2, 2, 16, 2, 8), torch.randn(2, 2, 2, 16, 2, 8)), commit_segment_id=3),
        m.KVBlocksStored(move_id=1, reservation_id=8, num_blocks=4),
        m.MoveCommit(move_id=1, reservation_id=8, req_id=11, home_inst_id=2, segment_id=1),
        m.FreeSegment(home_inst_id=2, req_id=11, segment_id=0, reservation_id=8),
        m.AuditHeld(creditor_inst_id=5, segments=(m.HeldSegmentRef(11, 0, 8), m.HeldSegmentRef(12, 4, 9))),
        m.AuditHeldReply(stale=(m.HeldSegmentRef(12, 4, 9),)),
        m.MoveKV(epoch=17, move_id=1, home_inst_id=2, req_id=11, src_inst_id=2, dst_inst_id=5,
                 num_blocks=4),
        m.ForwardSegment(epoch=17, move_id=3, home_inst_id=2, req_id=11, segment_id=4, dst_inst_id=6,
                         dst_host="127.0.0.1", dst_port=41000, reservation_id=9, dst_block_ids=(7, 8, 12)),
        m.Drain(epoch=17, drain_id=1, inst_id=5),
        m.Uncordon(epoch=17, drain_id=1, inst_id=5),
        m.Echo(payload=np.arange(10, dtype=np.int64)),
        m.EchoReply(payload=torch.arange(4, dtype=torch.int32)),
        m.SharedMemoryOffer(region="infllm-123-0123456789abcdef", nonce="ab" * 16, clock_ns=123_456_789_000),
        m.HeaderRingOffer(ring="infllm-123-0123456789abcdef.ring", nonce="ab" * 16),
        m.HeaderRingAccepted(ring="infllm-124-0123456789abcdef.ring", nonce="cd" * 16),
        m.HeaderRingOpened(),
        m.DevicePoolOffer(pool_id=0, device=0, handle="ab" * 64, storage_bytes=1 << 30, storage_offset_bytes=512,
                          ref_counter="2f746f726368", ref_counter_offset=8, event="cd" * 64, event_sync_required=True,
                          dtype="bfloat16", shape=(1024, 16, 2, 16, 8, 128), offset=0),
        m.StepMailboxOpen(home_inst_id=2, creditor_inst_id=5, num_layers=16, max_rows=64, num_heads=32,
                          head_dim=64, dtype="bfloat16", host_id="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"),
        m.StepMailboxOpened(mailbox_id=3, nbytes=1 << 20, host_path="",
                            device=(m.DevicePoolOffer(pool_id=0, device=0, handle="ef" * 64, storage_bytes=1 << 20,
                                                      storage_offset_bytes=0, ref_counter="2f746f726368",
                                                      ref_counter_offset=8, event="01" * 64,
                                                      event_sync_required=False, dtype="uint8", shape=(1 << 20,),
                                                      offset=0),)),
        m.StepMailboxOpened(mailbox_id=4, nbytes=4096, device=(), host_path="/dev/shm/infinite-llm-mailbox-1-4"),
        m.StepBegin(home_inst_id=2, creditor_inst_id=5, mailbox_id=3, step_id=91, num_layers=16,
                    slices=(m.AttendSlice(11, 0, 1, 1, 48), m.AttendSlice(13, 1, 2, 0, 16)), num_rows=3),
        m.StepBegin(home_inst_id=2, creditor_inst_id=5, mailbox_id=3, step_id=92, num_layers=16,
                    slices=(m.AttendSlice(11, 0, 1, 1, 48),), num_rows=1, ahead=1),
        m.StepStandDown(home_inst_id=2, mailbox_id=3, step_id=92),
        m.StepMailboxClose(home_inst_id=2, mailbox_id=3),
        m.APBChunkPrefill(home_inst_id=2, req_id=11, home_run=3, rank=0, host_inst_ids=(5, 2), reservation_id=8,
                          token_start=0, anchor_len=0, query_len=4, chunk_len=32, passing_len=8, pool_width=7,
                          observe_len=16, scorer="attention", seed=0, layer_timeout_ms=5000,
                          token_ids=torch.arange(36, dtype=torch.int64)),
        m.APBChunkDone(req_id=11, reservation_id=8, num_tokens=32, passing_bytes=4096, compute_ms=12),
        m.APBPassing(home_inst_id=2, req_id=11, round=1, src_rank=0, data=torch.randn(2, 8, 2, 16).to(torch.bfloat16)),
        m.Ack(),
        m.ErrorReply(code=m.ErrorCode.STALE_EPOCH, detail="epoch 16 < 17"),
    ]


def assert_same(a: object, b: object) -> None:
    if isinstance(a, (torch.Tensor, np.ndarray)):
        assert torch.equal(torch.as_tensor(np.asarray(a)) if isinstance(a, np.ndarray) else a,
                           b if isinstance(b, torch.Tensor) else torch.as_tensor(b))
    elif isinstance(a, tuple) and a and isinstance(a[0], (torch.Tensor, np.ndarray)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_every_message_type_is_sampled():
    assert {type(x) for x in sample_messages()} == set(m.MESSAGE_TYPES.values())


@pytest.mark.parametrize("message", sample_messages(), ids=lambda x: x.TYPE)
@pytest.mark.parametrize("inline_limit_bytes", [0, 8192])
def test_roundtrip(message: m.Message, inline_limit_bytes: int):
    decoded = roundtrip(message, inline_limit_bytes)
    assert type(decoded) is type(message)
    for name in message.__dataclass_fields__:
        assert_same(getattr(message, name), getattr(decoded, name))


def test_small_host_buffers_go_inline_and_large_ones_separately():
    small = codec.encode(m.Echo(np.zeros(100, np.uint8)), msg_id=1)
    large = codec.encode(m.Echo(np.zeros(100_000, np.uint8)), msg_id=1)
    assert small.buffers == () and len(small.header) > 100
    assert len(large.buffers) == 1 and large.buffers[0].nbytes == 100_000


def test_header_message_holds_specs_before_buffers_arrive():
    (blocks,) = [x for x in sample_messages() if isinstance(x, m.KVBlocks)]
    frame = codec.encode(blocks, msg_id=5)
    header = codec.decode_header(frame.header, LIMITS)
    assert header.msg_id == 5 and header.reply_to is None and header.wants_reply
    assert header.message.runs == (m.BlockRun(5, 2), m.BlockRun(9, 2))
    assert header.message.runs_data == (TensorSpec("float32", (2, 2, 2, 16, 2, 8)),) * 2


def test_non_contiguous_tensor_is_refused_on_send():
    with pytest.raises(ValueError):
        codec.encode(m.Echo(torch.randn(4, 4).t()), msg_id=1)


@pytest.mark.parametrize("bad", [
    lambda: m.AttendRequest(1, 2, 0, 0, (m.AttendSlice(1, 0, 1, 0, 4),), q_rows(2)),
    lambda: m.AttendRequest(1, 2, 0, 0, (m.AttendSlice(1, 1, 1, 0, 4),), q_rows(1)),
    lambda: m.AttendResult(1, 2, 0, 0, torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.float16)),
    lambda: m.AttendResult(1, 2, 0, 0, torch.zeros(2, 4, 8), torch.zeros(3, 4)),
    lambda: m.KVBlocks(1, 1, (m.BlockRun(0, 2),), (torch.zeros(3, 4),)),
    lambda: m.KVBlocks(1, 1, (), (), commit_segment_id=-2),
    lambda: m.MoveKV(1, 1, 1, 1, 2, 2, 1),
    lambda: m.Heartbeat(1, 1, m.PoolFigures(1, 1, 0, 0), 0, 0, 1, (), (m.PlacementKey(1, 1),)),
    lambda: m.ForwardSegment(1, 1, 2, 11, 0, 3, "127.0.0.1", 41000, 9, ()),
    lambda: m.ForwardSegment(1, 1, 2, 11, 0, 3, "127.0.0.1", 70000, 9, (1,)),
    lambda: m.ForwardSegment(1, 1, 2, 11, 0, 2, "127.0.0.1", 41000, 9, (1,)),
    lambda: m.StepMailboxOpen(2, 5, 0, 64, 32, 64, "bfloat16", "host"),
    lambda: m.StepMailboxOpened(3, 4096, (), ""),
    lambda: m.StepBegin(2, 5, 3, 91, 16, (m.AttendSlice(11, 0, 1, 0, 48),), 2),
], ids=["rows_short", "rows_gap", "lse_dtype", "lse_shape", "run_size", "commit_segment", "move_to_self",
        "full_with_removals", "forward_no_blocks", "forward_bad_port", "forward_to_home",
        "mailbox_no_layers", "mailbox_nowhere", "step_rows_short"])
def test_messages_check_their_own_fields(bad):
    with pytest.raises(ValueError):
        bad()


# --- refusals, one per error code ---


def frame_with(body: dict, inline: bytes = b"", version: int = m.PROTOCOL_VERSION,
               magic: bytes = codec.MAGIC) -> bytes:
    return codec.header_bytes(orjson.dumps(body), inline, 1, magic=magic, version=version)


def echo_body(**overrides) -> dict:
    body = {"t": "echo", "v": 1, "id": 1, "re": None, "f": {},
            "x": {"payload": ["uint8", [4]]}, "b": [[4, 1]]}
    body.update(overrides)
    return body


def refusal_code(data: bytes, limits: codec.FrameLimits = LIMITS) -> m.ErrorCode:
    with pytest.raises(ProtocolError) as info:
        codec.decode_header(data, limits)
    return info.value.code


def test_a_valid_hand_made_frame_decodes():
    header = codec.decode_header(frame_with(echo_body(), b"abcd"), LIMITS)
    assert header.message == m.Echo(TensorSpec("uint8", (4,))) and header.inline == (True,)


@pytest.mark.parametrize("data, code", [
    (b"ILL", m.ErrorCode.TRUNCATED_FRAME),
    (frame_with(echo_body(), b"abcd")[:-1], m.ErrorCode.TRUNCATED_FRAME),
    (frame_with(echo_body(), b"abcd") + b"x", m.ErrorCode.LENGTH_MISMATCH),
    (frame_with(echo_body(), b"abcd", magic=b"XLLM"), m.ErrorCode.BAD_MAGIC),
    (frame_with(echo_body(), b"abcd", version=m.PROTOCOL_VERSION + 1), m.ErrorCode.UNSUPPORTED_VERSION),
    (frame_with(echo_body(), b"abcd", version=m.PROTOCOL_VERSION - 1), m.ErrorCode.UNSUPPORTED_VERSION),
    (frame_with(echo_body(v=2), b"abcd"), m.ErrorCode.UNSUPPORTED_VERSION),
    (frame_with(echo_body(t="nope"), b"abcd"), m.ErrorCode.UNKNOWN_TYPE),
    (frame_with(echo_body(t=5), b"abcd"), m.ErrorCode.UNKNOWN_TYPE),
    (codec.header_bytes(b"{not}"), m.ErrorCode.INVALID_JSON),
    (frame_with([1, 2]), m.ErrorCode.INVALID_FIELDS),
    (frame_with(echo_body(id="1"), b"abcd"), m.ErrorCode.INVALID_FIELDS),
    (frame_with(echo_body(id=True), b"abcd"), m.ErrorCode.INVALID_FIELDS),
    (frame_with(echo_body(f={"x": 1}), b"abcd"), m.ErrorCode.INVALID_FIELDS),
    (frame_with(echo_body(x={"payload": ["complex", [4]]}), b"abcd"), m.ErrorCode.INVALID_FIELDS),
    (frame_with(echo_body(x={"payload": ["uint8", [-4]]}), b"abcd"), m.ErrorCode.INVALID_FIELDS),
    (frame_with(echo_body(b=[[5, 1]]), b"abcde"), m.ErrorCode.LENGTH_MISMATCH),
    (frame_with(echo_body(b=[[4, 1], [4, 1]]), b"abcdabcd"), m.ErrorCode.LENGTH_MISMATCH),
    (frame_with(echo_body(b=[[4, 1]]), b"abcdef"), m.ErrorCode.LENGTH_MISMATCH),
    (frame_with(echo_body(b=[[4, 2]]), b"abcd"), m.ErrorCode.INVALID_FIELDS),
    (frame_with(echo_body(x={"payload": ["uint8", [1 << 40]]}, b=[[1 << 40, 0]])),
     m.ErrorCode.BUFFER_TOO_LARGE),
    (frame_with({"t": "kv_blocks", "v": 3, "id": 1, "re": None,
                 "f": {"move_id": 1, "reservation_id": 1, "runs": [[0, 1]] * 5000, "commit_segment_id": -1},
                 "x": {"runs_data": [["uint8", [1]]] * 5000}, "b": [[1, 0]] * 5000}),
     m.ErrorCode.TOO_MANY_BUFFERS),
    (frame_with({"t": "move_rejected", "v": 1, "id": 1, "re": None,
                 "f": {"move_id": 1, "reason": "bored", "num_blocks_free": 0}, "x": {}, "b": []}),
     m.ErrorCode.INVALID_FIELDS),
    (frame_with({"t": "move_kv", "v": 1, "id": 1, "re": None,
                 "f": {"epoch": 1, "move_id": 1, "home_inst_id": 1, "req_id": 1,
                       "src_inst_id": 2, "dst_inst_id": 2, "num_blocks": 1},
                 "x": {}, "b": []}), m.ErrorCode.INVALID_FIELDS),
    # A plain field under "x" and a tensor under "f": every name is there, under the wrong key.
    (frame_with({"t": "attend_result", "v": 1, "id": 1, "re": None,
                 "f": {"home_inst_id": 1, "creditor_inst_id": 2, "step_id": 0, "out": ["float32", [1, 1, 1]]},
                 "x": {"layer": 0, "lse": ["float32", [1, 1]]}, "b": [[4, 1], [4, 1]]}, b"abcdefgh"),
     m.ErrorCode.INVALID_FIELDS),
])
def test_malformed_headers_are_refused(data: bytes, code: m.ErrorCode):
    assert refusal_code(data) == code


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


@pytest.mark.parametrize("key, code", [
    ("t", m.ErrorCode.UNKNOWN_TYPE), ("v", m.ErrorCode.UNSUPPORTED_VERSION),
    ("id", m.ErrorCode.INVALID_FIELDS), ("f", m.ErrorCode.INVALID_FIELDS),
    ("x", m.ErrorCode.INVALID_FIELDS), ("b", m.ErrorCode.INVALID_FIELDS),
])
def test_a_header_missing_a_key_is_refused_with_its_code(key: str, code: m.ErrorCode):
    assert refusal_code(frame_with(without(echo_body(), key), b"abcd")) == code


@pytest.mark.parametrize("body, code", [
    (echo_body(t=["echo"]), m.ErrorCode.UNKNOWN_TYPE), (echo_body(t={"echo": 1}), m.ErrorCode.UNKNOWN_TYPE),
    ("echo", m.ErrorCode.INVALID_FIELDS), (5, m.ErrorCode.INVALID_FIELDS), (None, m.ErrorCode.INVALID_FIELDS),
])
def test_an_unhashable_type_or_a_header_that_is_no_object_is_refused(body: object, code: m.ErrorCode):
    assert refusal_code(frame_with(body, b"abcd")) == code


def test_a_header_without_re_is_a_request():
    header = codec.decode_header(frame_with(without(echo_body(), "re"), b"abcd"), LIMITS)
    assert header.reply_to is None and header.msg_id == 1


def test_a_table_of_shared_and_separate_buffers_decodes():
    body = {"t": "attend_result", "v": 1, "id": 1, "re": 7,
            "f": {"home_inst_id": 1, "creditor_inst_id": 2, "step_id": 0, "layer": 0},
            "x": {"out": ["float32", [1, 1, 1]], "lse": ["float32", [1, 1]]},
            "b": [[4, 2, 64], [4, 0]], "su": 5_000_000_000}
    header = codec.decode_header(frame_with(body), LIMITS)
    assert header.inline == (False, False) and header.shared_offsets == (64, -1)
    assert header.shared_until_ns == 5_000_000_000
    assert header.reply_to == 7 and header.num_wire_buffers == 1


def test_oversized_frame_is_refused():
    small_limits = codec.FrameLimits(max_header_bytes=64)
    assert refusal_code(frame_with(echo_body(), b"abcd"), small_limits) == m.ErrorCode.OVERSIZED_FRAME


def test_buffer_over_the_configured_cap_is_refused():
    capped = codec.FrameLimits(max_buffer_bytes=3)
    assert refusal_code(frame_with(echo_body(), b"abcd"), capped) == m.ErrorCode.BUFFER_TOO_LARGE


def test_total_over_the_configured_cap_is_refused():
    capped = codec.FrameLimits(max_total_buffer_bytes=7)
    body = {"t": "attend_result", "v": 1, "id": 1, "re": None,
            "f": {"home_inst_id": 1, "creditor_inst_id": 2, "step_id": 0, "layer": 0},
            "x": {"out": ["float32", [1, 1, 1]], "lse": ["float32", [1, 1]]},
            "b": [[4, 0], [4, 0]]}
    assert refusal_code(frame_with(body), capped) == m.ErrorCode.BUFFER_TOO_LARGE


def test_preamble_layout_is_fixed():
    assert codec.PREAMBLE.size == 16
    assert struct.calcsize("<4sHHII") == 16


def forward_body(**fields) -> dict:
    f = {"epoch": 3, "move_id": 1, "home_inst_id": 2, "req_id": 11, "segment_id": 0, "dst_inst_id": 3,
         "dst_host": "127.0.0.1", "dst_port": 41000, "reservation_id": 9, "dst_block_ids": [4, 5]}
    f.update(fields)
    return {"t": "forward_segment", "v": 1, "id": 1, "re": None, "f": f, "x": {}, "b": []}


def test_a_hand_made_forward_segment_decodes():
    header = codec.decode_header(frame_with(forward_body()), LIMITS)
    assert header.message == m.ForwardSegment(3, 1, 2, 11, 0, 3, "127.0.0.1", 41000, 9, (4, 5))


@pytest.mark.parametrize("fields", [
    {"dst_block_ids": []},  # no block to send
    {"dst_block_ids": [4, "5"]},  # a block id that is not an integer
    {"dst_host": 7},  # a host that is not a string
    {"dst_port": 0},  # no port
    {"dst_inst_id": 2},  # the home as destination
    {"reservation_id": 1.5},
], ids=["no_blocks", "string_block", "int_host", "port_zero", "to_home", "float_reservation"])
def test_bad_forward_segment_fields_are_refused(fields):
    assert refusal_code(frame_with(forward_body(**fields))) == m.ErrorCode.INVALID_FIELDS


def test_forward_segment_with_a_missing_field_is_refused():
    body = forward_body()
    del body["f"]["dst_port"]
    assert refusal_code(frame_with(body)) == m.ErrorCode.INVALID_FIELDS
