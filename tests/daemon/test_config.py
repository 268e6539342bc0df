from pathlib import Path

import pytest

from infinite_llm.daemon.config import ConfigError, InstanceConfig, Timeouts, load_config


def test_defaults_are_valid() -> None:
    config = load_config()
    assert config == InstanceConfig()
    assert config.discovery == "local"


def test_toml_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "infinited.toml"
    path.write_text(
        'instance_id = 3\ndevice = "cuda:1"\nkv_pool_blocks = 4096\n'
        'etcd_endpoints = ["10.0.0.1:2379", "10.0.0.2:2379"]\nsocket_path = "/tmp/x.sock"\n'
        "[timeouts]\nheartbeat_interval_s = 2\n"
    )
    config = load_config(path, {"kv_pool_blocks": 128, "http_port": None, "timeouts.drain_s": 5})
    assert config.instance_id == 3
    assert config.device == "cuda:1"
    assert config.kv_pool_blocks == 128  # the flag wins
    assert config.http_port == 8000  # a flag left unset keeps the file's or default value
    assert config.etcd_endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert config.discovery == "etcd"
    assert config.socket_path == Path("/tmp/x.sock")
    assert config.timeouts == Timeouts(heartbeat_interval_s=2.0, drain_s=5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("block_sise = 16", "unknown setting in .*: block_sise"),
        ("block_size = 24", "block_size must be a power of two"),
        ('device = "tpu"', "device must be"),
        ("kv_pool_blocks = 10\nkv_pool_bytes = 10", "not both"),
        ("kv_pool_blocks = 0", "kv_pool_blocks must be >= 1"),
        ("instance_id = 0", "instance_id must be >= 1, got 0"),  # the gManager numbers instances from 1
        ("http_port = 70000", r"http_port must be in \[0, 65535\]"),
        ("max_num_seqs = true", "max_num_seqs must be an integer"),
        ("[timeouts]\npeer_request_s = -1", "timeouts.peer_request_s must be a finite number of seconds"),
        ("[timeouts]\ndrain_s = inf", "timeouts.drain_s must be a finite number of seconds"),
        ("[timeouts]\netcd_lease_s = nan", "timeouts.etcd_lease_s must be a finite number of seconds"),
        ("[timeouts]\nheartbeat_interval_s = 1e-9", r"timeouts.heartbeat_interval_s must be a finite number of seconds >= 0.01"),
        ("[timeouts]\nretry = 1", r"unknown setting in .*\[timeouts\]: retry"),
        ("block_size = ", "invalid TOML"),
    ],
)
def test_bad_values_are_refused_with_the_reason(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/infinited.toml")


def test_daemon_with_unreachable_etcd_says_so_before_loading_the_model(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "infinite_llm.daemon", "--etcd-endpoints", f"127.0.0.1:{port}", "--http-port", "0",
         "--etcd-request-s", "1", "--socket-path", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"infinited: no etcd answers within 1 s: 127.0.0.1:{port}: "), result.stderr
    assert time.monotonic() - started < 30  # the import of torch and friends, then one bounded try


@pytest.mark.parametrize("overrides, message", [
    ({"etcd_endpoints": "10.0.0.1"}, "etcd_endpoints: etcd endpoint must be host:port"),
    ({"etcd_endpoints": "10.0.0.1:2379", "etcd_prefix": "cluster"}, "etcd_prefix must start with '/'"),
    ({"timeouts.etcd_lease_s": 1.0}, "etcd_lease_s must be at least 2 s"),
])
def test_bad_etcd_settings(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_daemon_bad_flag_is_a_usage_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "infinite_llm.daemon", "--block-size", "24"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "block_size must be a power of two" in result.stderr


def test_peer_spin_defaults_by_device_and_can_be_set(tmp_path: Path) -> None:
    from infinite_llm.daemon.config import CPU_PEER_SPIN_S, GPU_PEER_SPIN_S, peer_spin_for

    assert load_config().peer_spin_s is None
    assert peer_spin_for(None, "cuda") == GPU_PEER_SPIN_S > peer_spin_for(None, "cpu") == CPU_PEER_SPIN_S
    path = tmp_path / "infinited.toml"
    path.write_text("peer_spin_s = 0.005\n")
    assert peer_spin_for(load_config(path).peer_spin_s, "cuda") == 0.005
    assert load_config(None, {"peer_spin_s": 0}).peer_spin_s == 0
    with pytest.raises(ConfigError, match="peer_spin_s"):
        load_config(None, {"peer_spin_s": 2.0})
    with pytest.raises(ConfigError, match="peer_spin_s"):
        load_config(None, {"peer_spin_s": True})


@pytest.mark.parametrize("name", ["share_kv", "creditor_cuda_graphs", "peer_device_pools", "peer_pull_graphs"])
def test_switches_from_toml_and_flags(tmp_path: Path, name: str) -> None:
    """On/off settings: true by default, from the file, overridden by --x / --no-x; a value
    that is not a TOML boolean is refused."""
    from infinite_llm.daemon.main import parse_args

    flag = "--" + name.replace("_", "-")
    assert getattr(load_config(), name) is True
    path = tmp_path / "infinited.toml"
    path.write_text(f"{name} = false\n")
    assert getattr(load_config(path), name) is False
    assert getattr(load_config(path, parse_args([flag])[1]), name) is True
    assert getattr(load_config(None, parse_args([flag.replace("--", "--no-")])[1]), name) is False
    assert getattr(load_config(path, parse_args([])[1]), name) is False  # no flag: the file holds
    for bad in ('"no"', "1"):
        path.write_text(f"{name} = {bad}\n")
        with pytest.raises(ConfigError, match=f"{name} must be true or false"):
            load_config(path)


def test_queue_bypass_limit_from_flags_and_its_bounds() -> None:
    from infinite_llm.daemon.main import parse_args

    assert load_config().queue_bypass_limit == 0
    assert load_config(None, parse_args(["--queue-bypass-limit", "8"])[1]).queue_bypass_limit == 8
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="queue_bypass_limit"):
            load_config(None, {"queue_bypass_limit": bad})


def test_peer_header_ring_bytes_from_flags_and_its_bounds() -> None:
    from infinite_llm.daemon.config import MIN_HEADER_RING_BYTES
    from infinite_llm.daemon.main import parse_args
    from infinite_llm.transport.header_ring import MIN_DATA_BYTES

    assert MIN_HEADER_RING_BYTES == MIN_DATA_BYTES
    assert load_config().peer_header_ring_bytes == 2 << 20
    assert load_config(None, parse_args(["--peer-header-ring-bytes", "0"])[1]).peer_header_ring_bytes == 0
    assert load_config(None, {"peer_header_ring_bytes": MIN_DATA_BYTES}).peer_header_ring_bytes == MIN_DATA_BYTES
    for bad in (-1, MIN_DATA_BYTES - 8, 2.5, True):
        with pytest.raises(ConfigError, match="peer_header_ring_bytes"):
            load_config(None, {"peer_header_ring_bytes": bad})


def test_split_decode_interval_from_flags_and_its_bounds() -> None:
    from infinite_llm.daemon.main import parse_args

    assert load_config().split_decode_interval == 1
    assert load_config(None, parse_args(["--split-decode-interval", "4"])[1]).split_decode_interval == 4
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="split_decode_interval"):
            load_config(None, {"split_decode_interval": bad})


def test_cpu_affinity_from_toml_and_flags(tmp_path: Path) -> None:
    from infinite_llm.daemon.main import parse_args

    assert load_config().cpu_affinity == ()
    path = tmp_path / "infinited.toml"
    path.write_text('cpu_affinity = "0-3,8,10-11"\n')
    assert load_config(path).cpu_affinity == (0, 1, 2, 3, 8, 10, 11)
    path.write_text("cpu_affinity = [5, 1]\n")
    assert load_config(path).cpu_affinity == (5, 1)
    assert load_config(None, parse_args(["--cpu-affinity", "2-3"])[1]).cpu_affinity == (2, 3)
    for bad, message in (('"3-1"', "'3-1' is not a CPU id or a range"), ('"x"', "'x' is not a CPU id"),
                         ("[-1]", "cpu_affinity must list CPU ids >= 0")):
        path.write_text(f"cpu_affinity = {bad}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_the_daemon_runs_on_its_cpus_and_refuses_cpus_it_may_not_use(monkeypatch, capsys) -> None:
    import os

    from infinite_llm.daemon import main as daemon_main

    seen: list[set[int]] = []

    class Recorder:
        def __init__(self, config, gmanager_token=None) -> None:
            pass

        async def run(self) -> None:
            seen.append(os.sched_getaffinity(0))

    import torch

    monkeypatch.setattr(daemon_main, "InstanceDaemon", Recorder)
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first = min(allowed)
    try:
        assert daemon_main.main(["--cpu-affinity", str(first)]) == 0
        assert seen == [{first}]
        assert torch.get_num_threads() == 1  # torch's CPU pool fits the CPUs given
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
    assert daemon_main.main(["--cpu-affinity", str(max(allowed) + 1)]) == 2
    assert "names CPUs outside those this process may use" in capsys.readouterr().err


def _daemon(args: list[str], env: dict | None = None, **kwargs):
    """Run ``infinited`` with ``args``, bounded; its CompletedProcess."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "infinite_llm.daemon", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, **kwargs)


def _one_line_refusal(result, message: str) -> None:
    """The daemon exited 2 with one ``infinited: ...`` line naming ``message``, no traceback."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infinited: ") and message in lines[0], result.stderr


def test_config_files_that_cannot_be_read_as_text_are_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "a-directory.toml").mkdir()
    with pytest.raises(ConfigError, match="a-directory.toml: is a directory, not a config file"):
        load_config(tmp_path / "a-directory.toml")
    binary = tmp_path / "latin1.toml"
    binary.write_bytes(b'served_model_name = "caf\xe9"\n')  # Latin-1: TOML files are UTF-8
    with pytest.raises(ConfigError, match=r"latin1.toml: not UTF-8 text \(byte 0xe9 at offset 24\)"):
        load_config(binary)
    _one_line_refusal(_daemon(["--config", str(tmp_path / "a-directory.toml")]), "is a directory")
    _one_line_refusal(_daemon(["--config", str(binary)]), "not UTF-8 text")


def test_a_config_file_the_daemons_user_may_not_read_is_refused_with_the_reason(tmp_path: Path) -> None:
    """As under systemd: the daemon runs as its own user, the file is root's, mode 0600."""
    import os
    import shutil
    import sys
    import tempfile

    if os.geteuid() != 0:
        path = tmp_path / "private.toml"
        path.write_text("block_size = 16\n")
        path.chmod(0)
        with pytest.raises(ConfigError, match=f"private.toml: permission denied \\(reading as uid {os.geteuid()}\\)"):
            load_config(path)
        return
    folder = Path(tempfile.mkdtemp(prefix="infllm-config-"))  # pytest's tmp_path is root's alone
    try:
        folder.chmod(0o755)
        path = folder / "private.toml"
        path.write_text("block_size = 16\n")
        path.chmod(0o600)
        nobody = 65534
        result = _run_as(nobody, [sys.executable, "-c", "import sys; from infinite_llm.daemon.main import main; "
                                  f"sys.exit(main(['--config', {str(path)!r}]))"])
        _one_line_refusal(result, f"private.toml: permission denied (reading as uid {nobody})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_as(uid: int, command: list[str]):
    """``command`` as ``uid`` with no supplementary group, through setpriv: ``subprocess``'s own
    ``user=`` fails to exec the venv's python here, a link into root's home (mode 0700)."""
    import shutil
    import subprocess

    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run a process as another user")
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *command],
                          capture_output=True, text=True, timeout=120, cwd="/")


def test_timeouts_given_as_a_scalar_are_refused_with_a_timeout_flag_too(tmp_path: Path) -> None:
    path = tmp_path / "infinited.toml"
    path.write_text("timeouts = 5\n")
    for flags in ({}, {"timeouts.drain_s": 10.0}):
        with pytest.raises(ConfigError, match=r"\[timeouts\] must be a table, got 5"):
            load_config(path, flags)
    _one_line_refusal(_daemon(["--config", str(path), "--drain-s", "10"]), "[timeouts] must be a table")


def test_a_pool_size_flag_replaces_the_files_pool_size(tmp_path: Path) -> None:
    """Flags override the file, for the pool's size too, whichever of its two keys each uses;
    two sizes from the same place stay an error."""
    from infinite_llm.daemon.main import parse_args

    example = Path(__file__).parents[2] / "systemd" / "etc" / "infinited.toml.example"
    config = load_config(example, parse_args(["--kv-pool-blocks", "4096"])[1])
    assert (config.kv_pool_blocks, config.kv_pool_bytes) == (4096, None)
    path = tmp_path / "infinited.toml"
    path.write_text("kv_pool_blocks = 64\n")
    config = load_config(path, parse_args(["--kv-pool-bytes", "1000000"])[1])
    assert (config.kv_pool_blocks, config.kv_pool_bytes) == (None, 1_000_000)
    assert load_config(path, parse_args([])[1]).kv_pool_blocks == 64  # no flag: the file holds
    with pytest.raises(ConfigError, match="give kv_pool_blocks or kv_pool_bytes, not both"):
        load_config(path, parse_args(["--kv-pool-blocks", "8", "--kv-pool-bytes", "1000000"])[1])
    path.write_text("kv_pool_blocks = 64\nkv_pool_bytes = 1000000\n")
    with pytest.raises(ConfigError, match="not both"):
        load_config(path, parse_args([])[1])


def test_a_gpu_the_host_lacks_is_refused(monkeypatch) -> None:
    import torch

    from infinite_llm.daemon.config import check_device_present

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    check_device_present("cpu")
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=f"device '{device}': no CUDA device is usable on this host"):
            check_device_present(device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("cpu", "cuda", "cuda:0", "cuda:1"):
        check_device_present(device)
    with pytest.raises(ConfigError, match=r"device 'cuda:2': this host has 2 CUDA devices visible \(cuda:0 to cuda:1"):
        check_device_present("cuda:2")


def test_the_daemon_refuses_a_gpu_the_host_lacks_before_loading_the_model(tmp_path: Path) -> None:
    import time

    started = time.monotonic()
    result = _daemon(["--device", "cuda:99", "--state-dir", str(tmp_path / "state"), "--http-port", "0",
                      "--socket-path", str(tmp_path / "s.sock")])
    _one_line_refusal(result, "device 'cuda:99': ")
    assert time.monotonic() - started < 60  # the imports, no model load


def test_an_unknown_log_level_is_refused_in_one_line(monkeypatch, capsys) -> None:
    from infinite_llm.daemon import main as daemon_main

    monkeypatch.setenv("INFLLM_LOG_LEVEL", "verbose")  # what the unit passes on
    assert daemon_main.main([]) == 2
    assert capsys.readouterr().err == ("infinited: --log-level (or INFLLM_LOG_LEVEL) must be one of DEBUG, INFO, "
                                       "WARNING, ERROR, CRITICAL, got 'verbose'\n")
    assert daemon_main.main(["--log-level", "loud"]) == 2
    assert "got 'loud'" in capsys.readouterr().err
    _one_line_refusal(_daemon([], env={"INFLLM_LOG_LEVEL": "verbose"}), "must be one of DEBUG")
