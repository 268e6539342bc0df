"""The configuration of one `infinited` instance: one validated dataclass from TOML and flags.

Precedence: defaults < the TOML file < command-line flags. Unknown keys are errors, so that a
misspelt setting is never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

_DEVICES = ("cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


GPU_PEER_SPIN_S = 0.02  # default peer_spin_s of an instance on a GPU, s
CPU_PEER_SPIN_S = 500e-6  # default peer_spin_s of an instance on the CPU, s
# The smallest header ring (transport.header_ring.MIN_DATA_BYTES; not imported: the CLI reads
# configs without loading the transport).
MIN_HEADER_RING_BYTES = 64 << 10


MIN_TIMEOUT_S = 0.01  # the shortest wait a timeout may set, s


REMOTE_ATTENTION_MODES = ("auto", "mailboxes", "messages")
# Which creditors the layers reach by NCCL links (daemon/step_attention): "auto" those of other
# hosts, "always" every one (GPUs of one machine, tests), "never" none.
NCCL_LINK_MODES = ("auto", "always", "never")

@dataclass(frozen=True)
class Timeouts:
    """Every bounded wait of the daemon, in seconds."""

    heartbeat_interval_s: float = 1.0  # instance -> gManager
    peer_request_s: float = 5.0  # one request to a peer (attend, try-move, commit)
    reservation_s: float = 10.0  # a reserved move not committed in time is released
    kv_hold_s: float = 300.0  # blocks kept for another home's starting request, released after this
    debtor_lost_s: float = 30.0  # segments held for a silent debtor are freed after this
    held_audit_s: float = 60.0  # a creditor asks each home this often which held segments it still counts on
    drain_s: float = 600.0  # graceful stop: time to finish or hand over work
    connect_s: float = 1.0  # opening a connection to a peer
    etcd_request_s: float = 2.0  # one request to etcd, the first connection included
    etcd_lease_s: float = 10.0  # TTL of the membership lease: a killed instance leaves etcd after this


@dataclass(frozen=True)
class InstanceConfig:
    """Settings of one instance.

    KV pool size: give ``kv_pool_blocks`` or ``kv_pool_bytes`` (not both); with neither, the
    engine's default applies. A flag for one replaces the file's value of the other
    (:func:`load_config`).
    """

    instance_id: int = 1  # >= 1: the gManager numbers instances from 1
    model: str | None = None  # GGUF file or Hugging Face folder; None: the embedded SmolLM2
    served_model_name: str | None = None  # the name in the OpenAI API; None: the model file's stem
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on the CPU
    block_size: int = 16  # tokens per KV block
    kv_pool_blocks: int | None = None
    kv_pool_bytes: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # tokens per step: the prefill chunk
    # Later requests that may start ahead of a waiting request whose context does not fit the
    # free memory yet (a long one), before the queue waits for it; 0: first come, first served.
    queue_bypass_limit: int = 0
    # Decoding requests whose KV spans peers run in one step of this many while others run: a
    # split step waits on the peers at every layer, and so does its whole batch.
    split_decode_interval: int = 1
    # The shortest document chunk an APB prefill gives an instance (a request's ``prefill:
    # "apb"``): a shorter document is prefilled exactly, with a note in the response.
    apb_min_chunk_tokens: int = 256
    peer_host: str = "127.0.0.1"  # UCX listener, for other instances
    peer_port: int = 0  # 0: any free port (reported in the heartbeat)
    # How long a wait on a peer spins (progressing UCX) before it sleeps on the worker's event
    # fd, s: a reply that comes within it is seen at once, at the cost of a busy core meanwhile.
    # None: GPU_PEER_SPIN_S on a GPU (waking from a sleep cost more than the spin there: two
    # H200 instances decoded a split request 1.33x faster at 20 ms than at 0.5 ms), and
    # CPU_PEER_SPIN_S on the CPU, whose cores the engine needs.
    peer_spin_s: float | None = None
    # Host buffers sent to instances on this host (a CPU pool's KV moves) go through a file of
    # this many bytes in peer_shared_memory_dir (sparse, committed as used), not TCP loopback;
    # 0: over UCX. Instances of one host need the same directory and the same user (the file
    # is its owner's alone: mode 0600).
    peer_shared_memory_bytes: int = 1 << 30
    peer_shared_memory_dir: Path = Path("/dev/shm")
    # Frame headers to and from instances on this host go through a ring of this many bytes in
    # peer_shared_memory_dir, one per connection and direction (a daemon's decode step sends
    # one per layer and creditor), not TCP loopback; 0: over UCX. x86-64 only (elsewhere UCX).
    peer_header_ring_bytes: int = 2 << 20
    # On a GPU, KV moves to instances on this host go as block ids: the receiver maps this
    # instance's pool through CUDA IPC and copies the blocks out of it (transport/device_pools).
    # False, or where the two GPUs cannot reach each other: gathered and sent over UCX.
    peer_device_pools: bool = True
    # The blocks such a move brings into this instance's pool are copied by one replay of a
    # captured CUDA graph (transport/device_pools PullGraphs). False: launched eagerly.
    peer_pull_graphs: bool = True
    # False: a static instance (vLLM-style): it admits only what its own pool holds, never
    # spills its requests' KV to peers, lends them nothing and refuses moves.
    share_kv: bool = True
    # The CPUs this instance runs on ("0-7,32-39" or a list of ids; empty: those it was started
    # with). An instance's event loop is on every remote-attention round trip: a core of its own,
    # on its GPU's NUMA node, keeps the loop's code and data warm.
    cpu_affinity: tuple[int, ...] = ()
    # On a GPU, serve peers' small attend requests (decode rows) from a CUDA graph per layer once
    # a layer has been served eagerly: one replay instead of several kernel launches.
    creditor_cuda_graphs: bool = True
    # How a home attends over KV that an instance of its own host holds: "mailboxes", one
    # StepBegin message per step and the layers through a mailbox in the creditor's memory
    # (daemon/step_server, daemon/step_attention); "messages", an AttendRequest per layer;
    # "auto", mailboxes on a GPU and messages on the CPU. Creditors that cannot share a mailbox
    # are attended by messages, or by an NCCL link (``nccl_links``).
    remote_attention: str = "auto"
    # With mailboxes, on a GPU: which creditors the layers reach by a two-rank NCCL link instead
    # of shared memory (transport/nccl_link.py): "auto" those of other hosts, "always" every one
    # (GPUs of one host, where NCCL goes over NVLink), "never" none (messages for other hosts).
    # A creditor with nccl_links "never" refuses links too.
    nccl_links: str = "auto"
    # Through a mailbox: the steps a creditor keeps queued past the current one for the same
    # slices (0 or 1). With 1 a home's next step finds its creditors' layers queued already, and
    # its StepBegin is off the step's path; 0 queues each step when its StepBegin arrives.
    steps_ahead: int = 1
    http_host: str = "127.0.0.1"  # OpenAI-compatible API and /metrics
    http_port: int | None = 8000  # 0: any free port; None: no TCP API
    socket_path: Path = Path("/run/infinite-llm/infinited.sock")  # local admin API
    admin_group: str | None = None  # besides root, members may call mutating local endpoints
    # The bearer token of the gManager's admin API over TCP (its --admin-token-file), sent when
    # this instance asks the leader to drain it at a stop; None: none sent.
    gmanager_token_file: Path | None = None
    etcd_endpoints: tuple[str, ...] = ()  # host:port of etcd; empty: local discovery through state_dir
    etcd_prefix: str = "/infinite-llm"  # the cluster's keys in etcd (one prefix per cluster)
    state_dir: Path = Path("/var/lib/infinite-llm")  # local election and membership files
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        _check_int("instance_id", self.instance_id, minimum=1)
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model must be a path string, got {self.model!r}")
        if not isinstance(self.device, str) or not (
            self.device in _DEVICES or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        _check_int("block_size", self.block_size, minimum=1)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_pool_blocks is not None and self.kv_pool_bytes is not None:
            raise ConfigError("give kv_pool_blocks or kv_pool_bytes, not both")
        if self.kv_pool_blocks is not None:
            _check_int("kv_pool_blocks", self.kv_pool_blocks, minimum=1)
        if self.kv_pool_bytes is not None:
            _check_int("kv_pool_bytes", self.kv_pool_bytes, minimum=1)
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("queue_bypass_limit", self.queue_bypass_limit, minimum=0)
        _check_int("split_decode_interval", self.split_decode_interval, minimum=1)
        _check_int("apb_min_chunk_tokens", self.apb_min_chunk_tokens, minimum=1)
        _check_int("steps_ahead", self.steps_ahead, minimum=0, maximum=1)  # messages.MAX_STEPS_AHEAD
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=self.block_size)
        _check_int("peer_port", self.peer_port, minimum=0, maximum=65535)
        _check_int("peer_shared_memory_bytes", self.peer_shared_memory_bytes, minimum=0)
        if 0 < self.peer_shared_memory_bytes < 1 << 20:
            raise ConfigError(f"peer_shared_memory_bytes must be 0 (off) or at least 1 MiB, got {self.peer_shared_memory_bytes}")
        _check_int("peer_header_ring_bytes", self.peer_header_ring_bytes, minimum=0)
        if 0 < self.peer_header_ring_bytes < MIN_HEADER_RING_BYTES:
            raise ConfigError(f"peer_header_ring_bytes must be 0 (off) or at least {MIN_HEADER_RING_BYTES}, "
                              f"got {self.peer_header_ring_bytes}")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.cpu_affinity):
            raise ConfigError(f"cpu_affinity must list CPU ids >= 0, got {self.cpu_affinity!r}")
        for name in ("share_kv", "creditor_cuda_graphs", "peer_device_pools", "peer_pull_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.nccl_links not in NCCL_LINK_MODES:
            raise ConfigError(f"nccl_links must be one of {', '.join(NCCL_LINK_MODES)}, got {self.nccl_links!r}")
        if self.remote_attention not in REMOTE_ATTENTION_MODES:
            raise ConfigError(f"remote_attention must be one of {', '.join(REMOTE_ATTENTION_MODES)}, "
                              f"got {self.remote_attention!r}")
        if self.peer_spin_s is not None and (isinstance(self.peer_spin_s, bool) or not isinstance(self.peer_spin_s, (int, float))
                                             or not 0 <= self.peer_spin_s <= 1):
            raise ConfigError(f"peer_spin_s must be a number of seconds in [0, 1], got {self.peer_spin_s!r}")
        if self.http_port is not None:
            _check_int("http_port", self.http_port, minimum=0, maximum=65535)
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str) or not self.served_model_name):
            raise ConfigError(f"served_model_name must be a non-empty string, got {self.served_model_name!r}")
        for name in ("peer_host", "http_host"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{name} must be a non-empty host string")
        if self.admin_group is not None and (not isinstance(self.admin_group, str) or not self.admin_group):
            raise ConfigError(f"admin_group must be a group name, got {self.admin_group!r}")
        if any(not isinstance(e, str) or not e for e in self.etcd_endpoints):
            raise ConfigError(f"etcd_endpoints must be host:port strings, got {self.etcd_endpoints!r}")
        if self.etcd_endpoints:
            from .etcd_discovery import parse_endpoints

            try:
                parse_endpoints(self.etcd_endpoints)
            except ValueError as exc:
                raise ConfigError(f"etcd_endpoints: {exc}") from None
        if not isinstance(self.etcd_prefix, str) or not self.etcd_prefix.startswith("/") or self.etcd_prefix.endswith("/"):
            raise ConfigError(f"etcd_prefix must start with '/' and not end with one, got {self.etcd_prefix!r}")
        for name, value in dataclasses.asdict(self.timeouts).items():
            # Finite (TOML has inf: a stop that never ends), and not so small that a loop
            # paced by it spins.
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not value >= MIN_TIMEOUT_S):
                raise ConfigError(f"timeouts.{name} must be a finite number of seconds >= {MIN_TIMEOUT_S}, "
                                  f"got {value!r}")
        if self.timeouts.etcd_lease_s < 2:  # etcd's shortest lease with its default election timeout
            raise ConfigError(f"timeouts.etcd_lease_s must be at least 2 s, got {self.timeouts.etcd_lease_s!r}")

    @property
    def discovery(self) -> str:
        """``"etcd"`` when etcd endpoints are set, else ``"local"`` (files in ``state_dir``)."""
        return "etcd" if self.etcd_endpoints else "local"


def read_gmanager_token(config: InstanceConfig) -> str | None:
    """The token in ``config.gmanager_token_file`` (None where none is named). Raises
    ConfigError where the file cannot be used (``admin_token.read_admin_token``). Apart from
    the dataclass's checks for the same reason as ``check_device_present``: it reads a file."""
    if config.gmanager_token_file is None:
        return None
    from .admin_token import read_admin_token

    try:
        return read_admin_token(config.gmanager_token_file)
    except ValueError as exc:
        raise ConfigError(f"gmanager_token_file: {exc}") from None


def check_device_present(device: str) -> None:
    """Raise ConfigError when ``device`` (a valid ``"cuda"`` or ``"cuda:N"``) names a GPU this
    host does not have or this torch cannot use.

    Apart from the dataclass's checks, which look at values only: this one asks the host. Made
    at start-up, it turns what would fail only after the model loaded (torch built without
    CUDA, an index past the GPUs) into a message at once.
    """
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        built = "built without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(f"device {device!r}: no CUDA device is usable on this host (torch {torch.__version__}, "
                          f"{built}); use device = \"cpu\"")
    num_gpus = torch.cuda.device_count()
    index = int(device[5:]) if device.startswith("cuda:") else 0  # "cuda": the current device, 0 at start
    if index >= num_gpus:
        raise ConfigError(f"device {device!r}: this host has {num_gpus} CUDA device{'s' if num_gpus > 1 else ''} "
                          f"visible (cuda:0 to cuda:{num_gpus - 1}; CUDA_VISIBLE_DEVICES limits them)")


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be {bound}, got {value}")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """CPU ids from a list in the kernel's notation: ``"0-3,8,10-11"``."""
    cpus: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ConfigError(f"cpu_affinity: {part!r} is not a CPU id or a range like 0-3") from None
        if low < 0 or high < low:
            raise ConfigError(f"cpu_affinity: {part!r} is not a CPU id or a range like 0-3")
        cpus.extend(range(low, high + 1))
    return tuple(sorted(set(cpus)))


def _coerce(name: str, value: Any, annotation: str) -> Any:
    """Turn TOML values into the field's type where TOML has no such type (paths, tuples)."""
    if value is None:
        return None
    if name == "cpu_affinity" and isinstance(value, str):
        return parse_cpu_list(value)
    if "Path" in annotation:
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{name} must be a path string, got {value!r}")
        return Path(value)
    if "tuple" in annotation:
        if isinstance(value, str):
            return tuple(v for v in value.split(",") if v)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        return tuple(value)
    if annotation.startswith("float") and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _build(cls: type, values: Mapping[str, Any], where: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting{'s' if len(unknown) > 1 else ''} in {where}: {', '.join(unknown)}")
    kwargs = {}
    for name, value in values.items():
        annotation = str(known[name].type)
        if name == "timeouts":
            if not isinstance(value, Mapping):
                raise ConfigError(f"[timeouts] must be a table, got {value!r}")
            kwargs[name] = _build(Timeouts, value, f"{where} [timeouts]")
        else:
            kwargs[name] = _coerce(name, value, annotation)
    return cls(**kwargs)


# The KV pool's size has two spellings; a flag for either replaces the file's value of both.
_POOL_SIZE_KEYS = ("kv_pool_blocks", "kv_pool_bytes")


def load_config(path: Path | str | None = None, overrides: Mapping[str, Any] | None = None) -> InstanceConfig:
    """Read the TOML file (if any), apply ``overrides`` (from flags; None values are ignored).

    A flag replaces the file's value of its key; a flag for one of ``kv_pool_blocks`` and
    ``kv_pool_bytes`` also drops the file's value of the other (both as flags stay an error).

    Raises:
        ConfigError: an unreadable file, invalid TOML, an unknown key or an invalid value.
    """
    values: dict[str, Any] = {}
    where = "flags"
    if path is not None:
        where = str(path)
        values = _read_toml(Path(path))
    flags = {key: value for key, value in (overrides or {}).items() if value is not None}
    if any(key in flags for key in _POOL_SIZE_KEYS):
        for key in _POOL_SIZE_KEYS:
            values.pop(key, None)
    timeout_flags = {key.split(".", 1)[1]: value for key, value in flags.items() if key.startswith("timeouts.")}
    if timeout_flags:
        file_timeouts = values.get("timeouts", {})
        if not isinstance(file_timeouts, Mapping):
            raise ConfigError(f"[timeouts] must be a table, got {file_timeouts!r}")
        values["timeouts"] = {**file_timeouts, **timeout_flags}
    values.update({key: value for key, value in flags.items() if not key.startswith("timeouts.")})
    return _build(InstanceConfig, values, where)


def _read_toml(path: Path) -> dict[str, Any]:
    """The file's settings; ConfigError with the reason for a file that cannot be read as TOML."""
    try:
        text = path.read_text(encoding="utf-8")  # TOML is UTF-8 whatever the locale
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except PermissionError:
        # Under systemd the daemon runs as its own user, not as whoever wrote the file.
        raise ConfigError(f"{path}: permission denied (reading as uid {os.geteuid()})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or type(exc).__name__}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def peer_spin_for(config_spin_s: float | None, device_type: str) -> float:
    """The spin an instance uses: the configured one, else the default of its kind of device."""
    if config_spin_s is not None:
        return config_spin_s
    return GPU_PEER_SPIN_S if device_type == "cuda" else CPU_PEER_SPIN_S
