"""The decoder refuses whatever it is fed with ProtocolError, and never anything else.

Default run: 4 x 2,600 generated frames; ``-m slow``: ten times as many.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinite_llm.transport import codec
from infinite_llm.transport.errors import ProtocolError
from infinite_llm.transport.tensors import allocate

from test_codec import sample_messages

LIMITS = codec.FrameLimits(max_header_bytes=1 << 16, max_buffers=64, max_buffer_bytes=1 << 20,
                           max_total_buffer_bytes=1 << 22)
VALID_FRAMES = [codec.encode(msg, msg_id=i).header for i, msg in enumerate(sample_messages())]
VALID_BODIES = [orjson.loads(f[codec.PREAMBLE.size:codec.PREAMBLE.size + codec.PREAMBLE.unpack_from(f)[3]])
                for f in VALID_FRAMES]

DEFAULT_EXAMPLES = 2_600
SLOW_EXAMPLES = 26_000

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=5),
    max_leaves=20,
)


def decodes_or_refuses(data: bytes) -> None:
    """The property: a header either decodes (and its message assembles) or is refused."""
    try:
        header = codec.decode_header(data, LIMITS)
    except ProtocolError:
        return
    destinations = [allocate(spec, "cpu") for spec in header.specs]
    codec.fill_inline(header, destinations)
    try:
        codec.assemble(header, destinations)
    except ProtocolError:
        pass


@st.composite
def mutated_frames(draw) -> bytes:
    frame = bytearray(draw(st.sampled_from(VALID_FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "truncate", "append", "splice"]))
        if action == "flip" and frame:
            i = draw(st.integers(0, len(frame) - 1))
            frame[i] = draw(st.integers(0, 255))
        elif action == "truncate":
            del frame[draw(st.integers(0, len(frame))):]
        elif action == "append":
            frame += draw(st.binary(max_size=32))
        elif action == "splice" and frame:
            i = draw(st.integers(0, len(frame) - 1))
            frame[i:i + draw(st.integers(0, 8))] = draw(st.binary(max_size=8))
    return bytes(frame)


@st.composite
def frames_with_random_json(draw) -> bytes:
    body = orjson.dumps(draw(json_values), option=orjson.OPT_NON_STR_KEYS) \
        if draw(st.booleans()) else draw(st.binary(max_size=64))
    inline = draw(st.binary(max_size=16))
    return codec.header_bytes(body, inline, draw(st.integers(0, 3)))


@st.composite
def frames_with_one_field_replaced(draw) -> bytes:
    body = dict(draw(st.sampled_from(VALID_BODIES)))
    path = draw(st.sampled_from(["t", "v", "id", "re", "f", "x", "b", "f.*", "x.*", "b.0"]))
    value = draw(json_values)
    if path.endswith(".*") and isinstance(body[path[0]], dict) and body[path[0]]:
        inner = dict(body[path[0]])
        inner[draw(st.sampled_from(sorted(inner)))] = value
        body[path[0]] = inner
    elif path == "b.0" and body["b"]:
        body["b"] = [value, *body["b"][1:]]
    else:
        body[path[0]] = value
    raw = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
    inline_len = draw(st.integers(0, 64))
    return codec.header_bytes(raw, draw(st.binary(min_size=inline_len, max_size=inline_len)), 1)


STRATEGIES = {
    "random_bytes": st.binary(max_size=256),
    "mutated_frames": mutated_frames(),
    "random_json": frames_with_random_json(),
    "one_field_replaced": frames_with_one_field_replaced(),
}


def fuzz(strategy, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def run(data: bytes) -> None:
        decodes_or_refuses(data)

    run()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fuzz_codec(name: str):
    fuzz(STRATEGIES[name], DEFAULT_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fuzz_codec_long(name: str):
    fuzz(STRATEGIES[name], SLOW_EXAMPLES)


def test_mutations_are_mostly_refused():
    """The fuzz reaches the refusal paths rather than decoding valid frames over and over."""
    refused = 0
    for frame in VALID_FRAMES:
        for cut in range(0, len(frame), 7):
            try:
                codec.decode_header(frame[:cut], LIMITS)
            except ProtocolError:
                refused += 1
    assert refused == sum(len(range(0, len(f), 7)) for f in VALID_FRAMES)
