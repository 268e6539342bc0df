"""A two-rank NCCL communicator: the per-layer exchange with a creditor on another host.

A mailbox (``step_mailbox``) needs memory that both processes map, so it serves creditors of
the home's own host only. For a creditor elsewhere the step protocol keeps its messages
(``StepBegin``, the timeouts, the status) and replaces the mailbox's flags by NCCL
point-to-point: per layer the home ``send``s the query rows and ``recv``s the partial output
and its log-sum-exp; the creditor does the mirror image. Both are queued on a stream like a
kernel, so CUDA graphs capture them: no host runs between layers on either side, and NCCL's
own proxy thread (C++) drives the network. A send waits (on its stream) until the peer posted
the matching receive, which is what orders the two sides; counts must match on both.

One ``NcclLink`` per (home, creditor) pair, rank 0 the home, rank 1 the creditor, made on
demand when a home first opens a link with a creditor (its unique id travels in
``StepMailboxOpen``). Each direction of lending has its own links (A's steps on B and B's
steps on A use two communicators, on streams of their own), so two instances that lend to
each other never wait on each other's sends.

NCCL has no timeout of its own: a link whose peer died or never posted its half is ended by
``abort`` (``ncclCommAbort``, which also ends its operations still queued on the device), from
the watchdog of whichever side waits, and is not used again.

Bound through ctypes to the ``libnccl.so.2`` that torch's CUDA build loads (the
``nvidia-nccl-cu13`` wheel); ``NcclUnavailable`` where there is none (the CPU, a build without
it). No I/O here but NCCL's.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading
from collections.abc import Iterator

import torch

UNIQUE_ID_BYTES = 128
_NCCL_UINT8 = 1  # ncclDataType_t: every transfer here is bytes
_NCCL_SUCCESS = 0
_NCCL_IN_PROGRESS = 7


class NcclUnavailable(Exception):
    """No NCCL here (no GPU, no library), or a link could not be made: the layers of a creditor
    on another host then go by messages."""


class NcclError(Exception):
    """An NCCL call failed on a link that was made."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]


class _Library:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        c_comm = ctypes.c_void_p
        signatures = {
            "ncclGetVersion": [ctypes.POINTER(ctypes.c_int)],
            "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(c_comm), ctypes.c_int, _UniqueId, ctypes.c_int],
            "ncclSend": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, c_comm, ctypes.c_void_p],
            "ncclRecv": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, c_comm, ctypes.c_void_p],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
            "ncclCommAbort": [c_comm],
            "ncclCommDestroy": [c_comm],
            "ncclCommGetAsyncError": [c_comm, ctypes.POINTER(ctypes.c_int)],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
            setattr(self, name, function)
        self.ncclGetErrorString = lib.ncclGetErrorString
        self.ncclGetErrorString.argtypes = [ctypes.c_int]
        self.ncclGetErrorString.restype = ctypes.c_char_p
        version = ctypes.c_int()
        self.check(self.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        self.version = version.value  # e.g. 22703 for 2.27.3

    def check(self, status: int, what: str) -> None:
        if status != _NCCL_SUCCESS:
            detail = self.ncclGetErrorString(status)
            raise NcclError(f"{what} failed: {detail.decode() if detail else status}")


_library: _Library | None = None
_library_lock = threading.Lock()


def nccl() -> _Library:
    """The process's NCCL; NcclUnavailable where there is none."""
    global _library
    with _library_lock:
        if _library is None:
            if not torch.cuda.is_available():
                raise NcclUnavailable("no CUDA device here")
            _library = _Library(_load())
        return _library


def _load() -> ctypes.CDLL:
    # torch's CUDA build loads the wheel's libnccl; a dlopen of the same soname returns it.
    candidates = ["libnccl.so.2"]
    for entry in __import__("sys").path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so*")))
    problems = []
    for candidate in candidates:
        try:
            return ctypes.CDLL(candidate)
        except OSError as e:
            problems.append(str(e))
    raise NcclUnavailable(f"no NCCL library: {'; '.join(problems[:3])}")


def loopback_host_env(host_name: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes a process of this machine a host of its own to NCCL (its
    ``NCCL_HOSTID``), reached over the loopback unless ``environ`` names another network: two
    such processes on one GPU exchange their layers over NCCL's network transport, as a home and
    a creditor of two machines do (tests and benches; one GPU has no two ranks otherwise)."""
    environ = os.environ if environ is None else environ
    return {"NCCL_HOSTID": host_name, "NCCL_SOCKET_IFNAME": environ.get("NCCL_SOCKET_IFNAME", "lo"),
            "NCCL_IB_DISABLE": environ.get("NCCL_IB_DISABLE", "1")}


def new_unique_id() -> bytes:
    """A fresh communicator id (rank 0's bootstrap address inside), ``UNIQUE_ID_BYTES`` long."""
    lib = nccl()
    uid = _UniqueId()
    lib.check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid.internal)


class NcclLink:
    """One end of a two-rank communicator (``rank`` 0: the home, 1: the creditor).

    Making it blocks until the other rank made its end (call it off the event loop). ``send``
    and ``recv`` queue on a stream (None: the current one) and are captured by a graph
    being captured there; a transfer's ``tensor`` must be contiguous and the same size as the
    peer's.
    """

    def __init__(self, unique_id: bytes, rank: int, device: torch.device) -> None:
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NcclUnavailable(f"an NCCL id is {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}")
        if rank not in (0, 1):
            raise ValueError("a link has ranks 0 and 1")
        self._lib = nccl()
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            status = self._lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank)
        if status != _NCCL_SUCCESS:
            raise NcclUnavailable(f"ncclCommInitRank: {self._lib.ncclGetErrorString(status).decode()}")
        self._comm = comm
        self._lock = threading.Lock()  # abort (watchdog) against queuing (event loop)
        self.aborted = False
        try:
            self._connect()
        except BaseException:
            self.abort()
            raise

    def _connect(self) -> None:
        """One byte each way, now, while the peer's making of its end does the same: NCCL
        connects a pair's channels at their first transfer (and loads its kernels at their first
        launch), which blocks the host until the peer connects too. Later, inside a graph's
        capture on the event loop's thread, that wait could be for a peer whose StepBegin that
        very thread has yet to send."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)
            byte = torch.zeros(2, dtype=torch.uint8, device=self.device)
            with self.group():
                self.send(byte[:1], stream)
                self.recv(byte[1:], stream)
            stream.synchronize()

    @property
    def usable(self) -> bool:
        return not self.aborted and self._comm is not None

    def send(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        self._transfer(self._lib.ncclSend, tensor, stream, "ncclSend")

    def recv(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        self._transfer(self._lib.ncclRecv, tensor, stream, "ncclRecv")

    def _transfer(self, function, tensor: torch.Tensor, stream: torch.cuda.Stream | None, what: str) -> None:
        if not tensor.is_contiguous() or not tensor.is_cuda:
            raise ValueError(f"{what} takes a contiguous CUDA tensor")
        handle = (stream or torch.cuda.current_stream(tensor.device)).cuda_stream
        with self._lock:
            if not self.usable:
                raise NcclError(f"{what} on a link that was aborted")
            status = function(ctypes.c_void_p(tensor.data_ptr()), tensor.numel() * tensor.element_size(),
                              _NCCL_UINT8, self.peer, self._comm, ctypes.c_void_p(handle))
        self._lib.check(status, what)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Transfers queued inside are one NCCL group: they progress together (two receives of
        one layer's result, for instance, wait on one peer's two sends in any order)."""
        self._lib.check(self._lib.ncclGroupStart(), "ncclGroupStart")
        try:
            yield
        finally:
            self._lib.check(self._lib.ncclGroupEnd(), "ncclGroupEnd")

    def async_error(self) -> str | None:
        """What went wrong on the link in the background (a peer that closed its end), or None."""
        with self._lock:
            if not self.usable:
                return "aborted"
            result = ctypes.c_int()
            status = self._lib.ncclCommGetAsyncError(self._comm, ctypes.byref(result))
        if status != _NCCL_SUCCESS:
            return self._lib.ncclGetErrorString(status).decode()
        if result.value not in (_NCCL_SUCCESS, _NCCL_IN_PROGRESS):
            return self._lib.ncclGetErrorString(result.value).decode()
        return None

    def abort_soon(self) -> None:
        """``abort`` on a thread of its own: ncclCommAbort may take a while to tear down its
        proxy, and the event loop goes on meanwhile."""
        threading.Thread(target=self.abort, daemon=True, name="nccl-link-abort").start()

    def abort(self) -> None:
        """End the link: its operations still queued on the device end (their buffers are
        left as they are) and it is not used again. Safe to call twice, from any thread.

        Every link ends this way, not with ``ncclCommDestroy``, which finalizes with the peer
        (on NCCL 2.28, both ends of a link that had run a graph were still in it after 50 s),
        where a link ends because its peer is gone or gave up."""
        with self._lock:
            if not self.usable:
                return
            self.aborted = True
            comm, self._comm = self._comm, None
        self._lib.ncclCommAbort(comm)
