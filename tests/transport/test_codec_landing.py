"""``land_inline`` (the receive path's one pass) does what its three steps do, and refuses alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.tensors import allocate, copy_bytes

LIMITS = codec.FrameLimits()


def kv_blocks(run_sizes: list[int]) -> m.KVBlocks:
    runs = tuple(m.BlockRun(dst_block_id=10 * i, num_blocks=n) for i, n in enumerate(run_sizes))
    data = tuple(torch.randn(n, 2, 4, 8).to(torch.bfloat16) for n in run_sizes)  # [blocks, 2, block, dim]
    return m.KVBlocks(move_id=1, reservation_id=2, runs=runs, runs_data=data)


@pytest.mark.parametrize("inline_limit_bytes", [0, 300, 8192])
def test_land_inline_matches_the_three_steps(inline_limit_bytes):
    message = kv_blocks([1, 2, 1])  # 128-byte blocks: some runs inline, some not, by the limit
    frame = codec.encode(message, msg_id=1, inline_limit_bytes=inline_limit_bytes)
    header = codec.decode_header(frame.header, LIMITS)

    landed = [allocate(spec, "cpu") for spec in header.specs]
    views = codec.land_inline(header, landed)
    stepwise = [allocate(spec, "cpu") for spec in header.specs]
    codec.check_destinations(header, stepwise)
    codec.fill_inline(header, stepwise)
    expected_views = codec.wire_destinations(header, stepwise)

    assert len(views) == len(expected_views) == len(frame.buffers)
    for view, src in zip(views, frame.buffers, strict=True):
        copy_bytes(view, src)
    for view, src in zip(expected_views, frame.buffers, strict=True):
        copy_bytes(view, src)
    for got, want, sent in zip(codec.assemble(header, landed).runs_data,
                               codec.assemble(header, stepwise).runs_data, message.runs_data, strict=True):
        assert torch.equal(got, want) and torch.equal(got, sent)


def test_land_inline_refuses_what_check_destinations_refuses():
    frame = codec.encode(kv_blocks([2, 1]), msg_id=1, inline_limit_bytes=0)
    header = codec.decode_header(frame.header, LIMITS)
    right = [allocate(spec, "cpu") for spec in header.specs]
    with pytest.raises(ValueError, match="destinations for"):
        codec.land_inline(header, right[:1])
    with pytest.raises(ValueError, match="bytes for"):
        codec.land_inline(header, [right[0], torch.empty(3, dtype=torch.uint8)])
    strided = torch.empty(2, 2, 4, 16, dtype=torch.bfloat16)[..., :8]  # right size, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        codec.land_inline(header, [strided, right[1]])


def test_host_tensors_of_an_all_inline_frame_hold_its_values() -> None:
    """Small frames landing on the host: tensors made from the header's bytes, writable, with
    the sent dtypes, shapes and values (bfloat16 and empty tensors included)."""
    out = torch.randn(2, 3, 8).to(torch.bfloat16)
    lse = torch.randn(2, 3)
    frame = codec.encode(m.AttendResult(1, 2, 3, 4, out, lse), 9)
    header = codec.decode_header(bytes(frame.header), codec.FrameLimits())
    got = codec.host_tensors_of_inline(header)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.float32]
    assert torch.equal(got[0], out) and torch.equal(got[1], lse)
    got[0].zero_()  # writable, and its own memory
    end = len(frame.header) - codec.TRAILER.size  # the inline bytes end where the end mark begins
    assert header.inline_bytes.tobytes() == bytes(frame.header)[end - len(header.inline_bytes):end]
    message = codec.assemble(header, got)
    assert message.out is got[0]

    empty = codec.encode(m.AttendResult(1, 2, 3, 4, torch.zeros(0, 3, 8), torch.zeros(0, 3)), 10)
    empty_header = codec.decode_header(bytes(empty.header), codec.FrameLimits())
    assert [tuple(t.shape) for t in codec.host_tensors_of_inline(empty_header)] == [(0, 3, 8), (0, 3)]


def test_host_tensors_of_inline_refuse_bytes_that_disagree_with_the_specs() -> None:
    frame = codec.encode(m.AttendResult(1, 2, 3, 4, torch.zeros(1, 2, 4), torch.zeros(1, 2)), 1)
    header = codec.decode_header(bytes(frame.header), codec.FrameLimits())
    short = dataclasses.replace(header, inline_bytes=header.inline_bytes[:-4])
    with pytest.raises(codec.ProtocolError):
        codec.host_tensors_of_inline(short)


def test_host_tensors_of_inline_keep_every_tensor_aligned() -> None:
    """Inline buffers lie back to back; a tensor whose bytes start off a 16-byte boundary (after
    a 3-element uint8 run here) still gets aligned memory of its own, and the right values."""
    runs = (m.BlockRun(dst_block_id=0, num_blocks=3), m.BlockRun(dst_block_id=9, num_blocks=2))
    data = (torch.tensor([1, 2, 3], dtype=torch.uint8), torch.randn(2, 5))
    frame = codec.encode(m.KVBlocks(move_id=1, reservation_id=2, runs=runs, runs_data=data), 3)
    header = codec.decode_header(bytes(frame.header), codec.FrameLimits())
    got = codec.host_tensors_of_inline(header)
    assert torch.equal(got[0], data[0]) and torch.equal(got[1], data[1])
    assert all(t.data_ptr() % 16 == 0 for t in got)
    got[1].mul_(2)  # writable
    assert torch.equal(got[1], 2 * data[1])


def test_an_assembled_message_is_the_decoded_one_with_its_tensors() -> None:
    """``assemble`` does not build and check the message again: the same field values, the
    tensors in place of the specs, and still frozen."""
    q = torch.randn(2, 3, 8)
    slices = (m.AttendSlice(7, 0, 1, 0, 16), m.AttendSlice(8, 1, 1, 4, 32))
    frame = codec.encode(m.AttendRequest(1, 2, 3, 4, slices, q), 5)
    header = codec.decode_header(bytes(frame.header), codec.FrameLimits())
    message = codec.assemble(header, codec.host_tensors_of_inline(header))
    assert type(message) is m.AttendRequest and message.slices == slices
    assert (message.home_inst_id, message.creditor_inst_id, message.step_id, message.layer) == (1, 2, 3, 4)
    assert torch.equal(message.q, q)
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.layer = 0  # type: ignore[misc]
    assert header.message.q == codec.TensorSpec("float32", (2, 3, 8))  # the header's is left as it was


def test_a_placer_that_shapes_a_buffer_otherwise_gets_a_protocol_error() -> None:
    """The message's own checks run on the destinations too: a placement of the right byte
    count but of a shape the message refuses is a ProtocolError, not a message that breaks
    its own rules."""
    runs = (m.BlockRun(dst_block_id=0, num_blocks=2),)
    frame = codec.encode(m.KVBlocks(1, 2, runs, (torch.zeros(2, 8),)), 3, inline_limit_bytes=0)
    header = codec.decode_header(bytes(frame.header), codec.FrameLimits())
    with pytest.raises(codec.ProtocolError, match="num_blocks blocks in its first dimension"):
        codec.assemble(header, [torch.zeros(4, 4)])  # 64 bytes, as sent, but 4 blocks


def test_a_tensor_off_the_cpu_and_the_gpu_is_refused_on_send() -> None:
    with pytest.raises(ValueError, match="cannot send a tensor on meta"):
        codec.encode(m.Echo(torch.empty(4, device="meta")), 1)
