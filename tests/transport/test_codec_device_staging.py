"""Small device buffers travel inline through the host; large ones stay separate GPU buffers."""

from __future__ import annotations

import pytest
import torch

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.tensors import allocate, copy_bytes

pytestmark = pytest.mark.gpu


def roundtrip_on_device(message: m.Message, inline_cuda_limit_bytes: int) -> tuple[m.Message, codec.EncodedFrame]:
    frame = codec.encode(message, msg_id=1, inline_cuda_limit_bytes=inline_cuda_limit_bytes)
    header = codec.decode_header(frame.header, codec.FrameLimits())
    destinations = [allocate(spec, "cuda") for spec in header.specs]
    codec.fill_inline(header, destinations)
    for dest, src in zip(codec.wire_destinations(header, destinations), frame.buffers, strict=True):
        copy_bytes(dest, src)
    torch.cuda.synchronize()
    return codec.assemble(header, destinations), frame


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_device_buffer_goes_inline_and_lands_on_the_device(dtype):
    q = torch.randn(4, 32, 128, device="cuda").to(dtype)  # [rows, heads, head_dim]
    decoded, frame = roundtrip_on_device(m.Echo(q), inline_cuda_limit_bytes=1 << 20)
    assert frame.buffers == ()
    assert decoded.payload.is_cuda
    assert torch.equal(decoded.payload, q)


def test_device_buffers_past_the_limit_stay_on_the_device():
    small = torch.randn(1024, device="cuda")  # 4 KiB
    large = torch.randn(1 << 16, device="cuda")  # 256 KiB: over what is left of the limit
    message = m.KVBlocks(move_id=1, reservation_id=2, runs=(m.BlockRun(0, 1), m.BlockRun(5, 1)),
                         runs_data=(small.view(torch.uint8).view(1, -1), large.view(torch.uint8).view(1, -1)))
    decoded, frame = roundtrip_on_device(message, inline_cuda_limit_bytes=64 << 10)
    assert len(frame.buffers) == 1 and frame.buffers[0].is_cuda
    assert torch.equal(decoded.runs_data[0], message.runs_data[0])
    assert torch.equal(decoded.runs_data[1], message.runs_data[1])
