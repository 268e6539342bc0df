"""Mailboxes for the layers of a step: a home and a creditor of one host, no host per layer.

A home that attends over KV held by a creditor of its own host sends one ``StepBegin`` per
step over the transport; the per-layer exchange (the query in, the partial output and its
log-sum-exp back) then goes through a *mailbox*: memory of the creditor's that the home maps
(CUDA IPC for a creditor on a GPU, a shared-memory file for one on the host), with one query
slot and one result slot per layer and a flag beside each.

The protocol of layer ``l`` of a step, every flag starting ``EMPTY``:

- home: write the query into ``q[l]``, then ``q_flags[l] = READY``;
- creditor: wait ``q_flags[l] >= READY``, set it ``EMPTY``, attend, write ``out[l]`` and
  ``lse[l]``, then ``result_flags[l] = READY``;
- home: wait ``result_flags[l] >= READY``, set it ``EMPTY``, merge ``out[l]`` and ``lse[l]``.

Every value is the same at every step, so a GPU's waits and writes (stream memory operations,
which CUDA graphs capture) are captured once and replayed: the creditor's whole step is one
graph launch, and the home's layers queue on its stream without waiting. Each slot is written
only after its reader has let go of it: the home writes ``q[l]`` of the next step after it saw
``result_flags[l]``, which the creditor sets after its attention read ``q[l]``; the creditor
writes ``out[l]`` of the next step after it saw ``q_flags[l]`` of that step, which the home
sets after its merge of this one (both in stream order on a GPU).

A wait never outlives its deadline: a watchdog on the host of the waiting side sets the flag
it waits on to ``ABORTED`` (which satisfies the wait, ``>=``), and the creditor records in
``status`` that it gave up, so that a home reads no result computed from a stale query. A
mailbox that was aborted is not used again: its flags no longer follow the protocol.

No I/O here but CUDA's and the mapping of one file.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from infinite_llm.transport.device_pools import DevicePoolUnavailable, export_pool, open_pool
from infinite_llm.transport.messages import DevicePoolOffer
from infinite_llm.transport.tensors import _TORCH_DTYPES

FLAG_EMPTY = 0
FLAG_READY = 1
FLAG_ABORTED = 2  # set by a watchdog: satisfies a wait (>= READY) that would otherwise hang

STATUS_OK = 0
STATUS_TIMED_OUT = 1  # the creditor's watchdog released its waits: the step's results are stale

# Each flag on a line of its own (64 bytes): the two sides write neighbouring flags.
FLAG_STRIDE_WORDS = 16
_ALIGN = 256


# A creditor's refusal of a shared mailbox to a home of another host begins with this: the
# home then asks for an NCCL link instead (transport/nccl_link.py).
OTHER_HOST = "the home is on another host"


class MailboxUnavailable(Exception):
    """A mailbox could not be made, shared or opened here (another host, a driver without
    stream memory operations, a malformed offer): the step's layers go by messages."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class MailboxLayout:
    """Where each part of a mailbox lies in its memory (one uint8 buffer of ``nbytes``)."""

    num_layers: int
    max_rows: int  # query rows a step may send
    num_heads: int
    head_dim: int
    dtype: torch.dtype  # of the queries and the outputs; log-sum-exp is float32

    def __post_init__(self) -> None:
        if min(self.num_layers, self.max_rows, self.num_heads, self.head_dim) <= 0:
            raise ValueError("a mailbox has at least one layer, row, head and element")

    @property
    def _flags_bytes(self) -> int:
        return _aligned(self.num_layers * FLAG_STRIDE_WORDS * 4)

    @property
    def result_flags_offset(self) -> int:
        return self._flags_bytes

    @property
    def status_offset(self) -> int:
        return 2 * self._flags_bytes

    @property
    def q_offset(self) -> int:
        return self.status_offset + _ALIGN

    @property
    def rows_bytes(self) -> int:
        """One layer's query (or output) slot, bytes."""
        return _aligned(self.max_rows * self.num_heads * self.head_dim * self.dtype.itemsize)

    @property
    def out_offset(self) -> int:
        return self.q_offset + self.num_layers * self.rows_bytes

    @property
    def lse_offset(self) -> int:
        return self.out_offset + self.num_layers * self.rows_bytes

    @property
    def lse_bytes(self) -> int:
        return _aligned(self.max_rows * self.num_heads * 4)

    @property
    def nbytes(self) -> int:
        return self.lse_offset + self.num_layers * self.lse_bytes


def layout_of(num_layers: int, max_rows: int, num_heads: int, head_dim: int, dtype_name: str) -> MailboxLayout:
    """The layout a ``StepMailboxOpen`` names; ValueError for a dtype that is not the wire's."""
    dtype = _TORCH_DTYPES.get(dtype_name)
    if dtype is None or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"a mailbox holds float16, bfloat16 or float32, not {dtype_name!r}")
    return MailboxLayout(num_layers, max_rows, num_heads, head_dim, dtype)


class Mailbox:
    """Views of one mailbox's memory, laid out by ``layout``.

    ``q_flags``, ``result_flags``: ``[num_layers]`` int32 (strided: one a line);
    ``status``: ``[1]`` int32; ``q``, ``out``: ``[num_layers, max_rows, num_heads, head_dim]``
    of ``layout.dtype``; ``lse``: ``[num_layers, max_rows, num_heads]`` float32, natural log.
    """

    def __init__(self, layout: MailboxLayout, memory: torch.Tensor) -> None:
        if memory.dtype != torch.uint8 or memory.dim() != 1 or memory.numel() != layout.nbytes:
            raise MailboxUnavailable(f"a mailbox of this layout is {layout.nbytes} bytes of uint8, "
                                     f"not {memory.numel()} of {memory.dtype}")
        self.layout = layout
        self.memory = memory
        L, flags = layout.num_layers, layout._flags_bytes
        stride = FLAG_STRIDE_WORDS
        self.q_flags = memory[:flags].view(torch.int32)[: L * stride: stride]
        self.result_flags = memory[layout.result_flags_offset: layout.result_flags_offset + flags] \
            .view(torch.int32)[: L * stride: stride]
        self.status = memory[layout.status_offset: layout.status_offset + 4].view(torch.int32)
        rows = (layout.max_rows, layout.num_heads, layout.head_dim)
        self.q = self._slots(layout.q_offset, layout.rows_bytes, layout.dtype, rows)
        self.out = self._slots(layout.out_offset, layout.rows_bytes, layout.dtype, rows)
        self.lse = self._slots(layout.lse_offset, layout.lse_bytes, torch.float32, rows[:2])

    def _slots(self, offset: int, slot_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        used = math.prod(shape) * dtype.itemsize
        region = self.memory[offset: offset + self.layout.num_layers * slot_bytes].view(self.layout.num_layers,
                                                                                       slot_bytes)
        return region[:, :used].view(dtype).view(self.layout.num_layers, *shape)

    @property
    def is_cuda(self) -> bool:
        return self.memory.is_cuda

    def reset(self) -> None:
        """Every flag ``EMPTY`` and the status ``OK`` (a new mailbox; memory of a free one)."""
        self.memory[: self.layout.q_offset].zero_()


# --- stream memory operations (the CUDA driver's, which the runtime and torch do not expose) --------

_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_STREAM_WAIT_VALUE_EQ = 0x1
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # the write follows a memory barrier: earlier writes are seen first


class StreamFlags:
    """``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` on a torch stream: queued like a
    kernel, captured by a CUDA graph being captured on that stream."""

    def __init__(self) -> None:
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
            self._write = _function(libcuda, "cuStreamWriteValue32")
            self._wait = _function(libcuda, "cuStreamWaitValue32")
        except (OSError, AttributeError) as e:
            raise MailboxUnavailable(f"the CUDA driver has no stream memory operations: {e}") from None

    def write(self, address: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue ``*address = value`` (uint32) on ``stream`` (None: the current one), after the
        stream's earlier work and its writes."""
        handle = (stream or torch.cuda.current_stream()).cuda_stream
        _check(self._write(ctypes.c_void_p(handle), ctypes.c_uint64(address), ctypes.c_uint32(value),
                           _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")

    def wait(self, address: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue a wait until ``*address >= value`` (as the driver compares: cyclically) on
        ``stream``: the stream's later work runs after it."""
        handle = (stream or torch.cuda.current_stream()).cuda_stream
        _check(self._wait(ctypes.c_void_p(handle), ctypes.c_uint64(address), ctypes.c_uint32(value),
                          _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")


    def wait_equal(self, address: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue a wait until ``*address == value`` on ``stream``."""
        handle = (stream or torch.cuda.current_stream()).cuda_stream
        _check(self._wait(ctypes.c_void_p(handle), ctypes.c_uint64(address), ctypes.c_uint32(value),
                          _CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")


def _function(libcuda: ctypes.CDLL, name: str):
    # CUDA 12 made the _v2 entry points the ones the plain names stand for.
    function = getattr(libcuda, name + "_v2", None) or getattr(libcuda, name)
    function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _check(status: int, what: str) -> None:
    if status != 0:
        raise MailboxUnavailable(f"{what} failed (CUresult {status})")


_stream_flags: StreamFlags | None = None


def stream_flags() -> StreamFlags:
    """The process's one ``StreamFlags``; MailboxUnavailable where the driver has none."""
    global _stream_flags
    if _stream_flags is None:
        _stream_flags = StreamFlags()
    return _stream_flags


def flag_address(flags: torch.Tensor, layer: int) -> int:
    """The device address of ``flags[layer]``."""
    return flags.data_ptr() + layer * flags.stride(0) * flags.element_size()


# --- making, sharing and opening mailboxes ------------------------------------------------------------

_HOST_MAILBOX_NAME = re.compile(r"infinite-llm-mailbox-[0-9]+-[0-9]+")


def make_mailbox(layout: MailboxLayout, device: torch.device, mailbox_id: int,
                 host_dir: Path | None = None) -> tuple[Mailbox, DevicePoolOffer | None, str]:
    """A new mailbox (flags ``EMPTY``) on ``device``, and how a process of this host opens it:
    ``(mailbox, offer, "")`` on a GPU, ``(mailbox, None, path)`` on the host, in a
    shared-memory file under ``host_dir`` (which the caller unlinks with ``remove_host_file``)."""
    if device.type == "cuda":
        memory = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        try:
            offer = export_pool(memory, mailbox_id)
        except DevicePoolUnavailable as e:
            raise MailboxUnavailable(str(e)) from None
        stream_flags()  # refused here, not at the first step, where the driver has none
        return Mailbox(layout, memory), offer, ""
    if host_dir is None:
        raise MailboxUnavailable("a mailbox on the host needs a shared-memory folder")
    path = Path(host_dir) / f"infinite-llm-mailbox-{os.getpid()}-{mailbox_id}"
    try:
        with open(path, "xb") as f:
            f.truncate(layout.nbytes)
        memory = torch.from_file(str(path), shared=True, size=layout.nbytes, dtype=torch.uint8)
    except OSError as e:
        raise MailboxUnavailable(f"cannot make {path}: {e}") from None
    return Mailbox(layout, memory), None, str(path)


def make_local_mailbox(layout: MailboxLayout, device: torch.device) -> Mailbox:
    """A mailbox in this process's memory alone (flags ``EMPTY``): one end of an NCCL link,
    whose slots the link's sends read and its receives write."""
    if device.type != "cuda":
        raise MailboxUnavailable("an NCCL link needs a GPU on both ends")
    return Mailbox(layout, torch.zeros(layout.nbytes, dtype=torch.uint8, device=device))


def remove_host_file(path: str) -> None:
    """Unlink a host mailbox's file (the mappings stay valid until dropped)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def open_mailbox(layout: MailboxLayout, nbytes: int, device: torch.device, offer: DevicePoolOffer | None,
                 host_path: str) -> Mailbox:
    """The peer's mailbox, mapped here. MailboxUnavailable where it cannot be (another host, a
    size that is not the layout's, a path that is no mailbox's)."""
    if nbytes != layout.nbytes:
        raise MailboxUnavailable(f"a mailbox of {nbytes} bytes for a layout of {layout.nbytes}")
    if offer is not None:
        if offer.dtype != "uint8" or tuple(offer.shape) != (nbytes,):
            raise MailboxUnavailable(f"the offer is {offer.dtype} {offer.shape}, not uint8 ({nbytes},)")
        try:
            memory = open_pool(offer, device)
        except DevicePoolUnavailable as e:
            raise MailboxUnavailable(str(e)) from None
        stream_flags()
        return Mailbox(layout, memory)
    path = Path(host_path)
    if not _HOST_MAILBOX_NAME.fullmatch(path.name):
        raise MailboxUnavailable(f"{host_path!r} is not a mailbox's file")
    try:
        if not path.is_file() or path.stat().st_size != nbytes:
            raise MailboxUnavailable(f"{host_path} is not a file of {nbytes} bytes")
        memory = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    except OSError as e:
        raise MailboxUnavailable(f"cannot open {host_path}: {e}") from None
    if device.type == "cuda":
        raise MailboxUnavailable("a home on a GPU uses device mailboxes only")
    return Mailbox(layout, memory)


def host_id() -> str:
    """This host's boot id: two processes share mailboxes only where theirs agree."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return os.uname().nodename
