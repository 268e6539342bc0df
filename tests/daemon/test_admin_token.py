"""The admin API's bearer token: read from a file that must keep it secret, checked in constant time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infinite_llm.daemon.admin_token import bearer_header, bearer_matches, read_admin_token
from infinite_llm.daemon.config import ConfigError, InstanceConfig, read_gmanager_token

TOKEN = "0123456789abcdef0123"


def token_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "admin-token"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_the_token_is_read_without_its_surrounding_whitespace(tmp_path):
    assert read_admin_token(token_file(tmp_path, f"  {TOKEN}\n")) == TOKEN
    assert read_admin_token(token_file(tmp_path, TOKEN, mode=0o640)) == TOKEN  # the service's group may read it


@pytest.mark.parametrize("text, mode, reason", [
    (TOKEN, 0o644, "readable or writable by every user"),
    (TOKEN, 0o602, "readable or writable by every user"),  # anyone could put their own token there
    ("short", 0o600, "at least 16 characters"),
    ("", 0o600, "at least 16 characters"),
    ("0123456789 abcdef0123", 0o600, "printable ASCII with no spaces"),
    ("0123456789abcdéf0123", 0o600, "printable ASCII with no spaces"),
    ("x" * 5000, 0o600, "over 4096 bytes"),
])
def test_a_token_file_that_cannot_keep_or_carry_the_token_is_refused(tmp_path, text, mode, reason):
    path = token_file(tmp_path, text, mode)
    with pytest.raises(ValueError, match=reason) as refused:
        read_admin_token(path)
    assert str(path) in str(refused.value)


def test_a_missing_file_a_folder_or_a_fifo_is_refused_with_its_path(tmp_path):
    with pytest.raises(ValueError, match="admin token file .*missing: No such file"):
        read_admin_token(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a regular file"):
        read_admin_token(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="not a regular file"):  # at once: no writer is waited for
        read_admin_token(fifo)


def test_the_bearer_header_carries_the_token_and_only_it_matches():
    header = bearer_header(TOKEN)["Authorization"]
    assert bearer_matches(header, TOKEN)
    assert bearer_matches(f"bearer {TOKEN}", TOKEN)  # the scheme is case-insensitive (RFC 9110)
    assert not bearer_matches(None, TOKEN)
    assert not bearer_matches(f"Bearer {TOKEN}x", TOKEN)
    assert not bearer_matches(f"Basic {TOKEN}", TOKEN)
    assert not bearer_matches("Bearer", TOKEN)
    assert not bearer_matches(f"Bearer {TOKEN[:-1]}é", TOKEN)
    assert not bearer_matches("Bearer \udcff\udcfe", TOKEN)  # bytes that are not UTF-8, as aiohttp hands them
    assert not bearer_matches("Bearer ", "") and not bearer_matches("Bearer", "")  # an empty token opens nothing


def test_an_instance_reads_its_gmanager_token_at_start_or_refuses_to_start(tmp_path):
    assert read_gmanager_token(InstanceConfig(instance_id=1)) is None
    config = InstanceConfig(instance_id=1, gmanager_token_file=token_file(tmp_path, TOKEN))
    assert read_gmanager_token(config) == TOKEN
    os.chmod(config.gmanager_token_file, 0o604)
    with pytest.raises(ConfigError, match="gmanager_token_file: admin token file .* readable or writable by every user"):
        read_gmanager_token(config)


def test_infinited_with_a_token_file_it_cannot_use_exits_2_with_one_line(tmp_path, capsys):
    from infinite_llm.daemon import main as daemon_main

    path = token_file(tmp_path, "too-short")
    assert daemon_main.main(["--gmanager-token-file", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"infinited: gmanager_token_file: admin token file {path}: the token must be at least 16 characters")
