"""Hostfile, --include/--exclude and .flowtrain_env parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowtrain.launch.envfile import load_env_files, parse_env_file, remote_exports
from flowtrain.launch.hostfile import (
    LaunchInputError,
    apply_filters,
    is_local_host,
    parse_hostfile,
    read_hostfile,
)
from flowtrain.netaddr import all_loopback, is_loopback


def test_parse_slots_comments_and_blank_lines() -> None:
    text = "# cluster\n\nworker-0 slots=8   # the big one\n  worker-1 slots=4\n"
    assert parse_hostfile(text) == {"worker-0": 8, "worker-1": 4}


def test_order_is_file_order() -> None:
    assert list(parse_hostfile("b slots=1\na slots=1\n")) == ["b", "a"]


def test_duplicate_host_names_both_lines() -> None:
    with pytest.raises(LaunchInputError, match=r"line 3.*'a' is listed twice \(first on line 1\)"):
        parse_hostfile("a slots=1\nb slots=1\na slots=2\n", "hosts")


@pytest.mark.parametrize("line", ["a slots=0", "a slots=-1", "a slots=x", "a slots="])
def test_bad_slots_names_line(line: str) -> None:
    with pytest.raises(LaunchInputError, match=r"hostfile hosts line 2: slots must be a positive"):
        parse_hostfile(f"ok slots=1\n{line}\n", "hosts")


@pytest.mark.parametrize("line", ["a", "a 4", "a slots=1 extra", "a gpus=2"])
def test_malformed_line(line: str) -> None:
    with pytest.raises(LaunchInputError, match=r"line 1: expected 'HOST slots=N'"):
        parse_hostfile(line + "\n", "hosts")


def test_empty_hostfile() -> None:
    with pytest.raises(LaunchInputError, match="lists no hosts"):
        parse_hostfile("# nothing\n\n")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(LaunchInputError, match="cannot read hostfile .*missing"):
        read_hostfile(tmp_path / "missing")


HOSTS = {"a": 4, "b": 4, "c": 2}


def test_include_hosts_and_slots() -> None:
    assert apply_filters(HOSTS, "c@a:0,2", None) == {"a": [0, 2], "c": [0, 1]}


def test_exclude_hosts_and_slots() -> None:
    assert apply_filters(HOSTS, None, "b@a:3") == {"a": [0, 1, 2], "c": [0, 1]}
    assert apply_filters(HOSTS, None, "c:0,1") == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}


def test_filter_errors() -> None:
    with pytest.raises(LaunchInputError, match="cannot be used together"):
        apply_filters(HOSTS, "a", "b")
    with pytest.raises(LaunchInputError, match="'z', which is not in the hostfile"):
        apply_filters(HOSTS, "z", None)
    with pytest.raises(LaunchInputError, match="slot 5 of 'c', which has only 2 slots"):
        apply_filters(HOSTS, "c:5", None)
    with pytest.raises(LaunchInputError, match="leaves no hosts"):
        apply_filters(HOSTS, None, "a@b@c")
    with pytest.raises(LaunchInputError, match="slot 'x'"):
        apply_filters(HOSTS, "a:x", None)


def test_local_names() -> None:
    assert is_local_host("localhost") and is_local_host("127.0.0.2")
    assert all_loopback(["localhost", "127.0.0.1"]) and not all_loopback(["localhost", "node7"])


def test_env_file_parsing() -> None:
    text = "# comment\nA=1\nexport B = two words \nC='quoted = x'\nD=\n\n"
    assert parse_env_file(text) == {"A": "1", "B": "two words", "C": "quoted = x", "D": ""}
    with pytest.raises(LaunchInputError, match=r"envf line 2: expected KEY=VALUE, got 'no equals'"):
        parse_env_file("A=1\nno equals\n", "envf")
    with pytest.raises(LaunchInputError, match="line 1"):
        parse_env_file("1BAD=x\n", "envf")


def test_env_files_cwd_wins_over_home(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir(), cwd.mkdir()
    (home / ".flowtrain_env").write_text("A=home\nB=home\n")
    (cwd / ".flowtrain_env").write_text("B=cwd\n")
    assert load_env_files(cwd, home) == {"A": "home", "B": "cwd"}
    assert load_env_files(tmp_path, None) == {}


def test_remote_exports() -> None:
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "FLOWTRAIN_SSH": "ssh", "HOME": "/h",
               "FLOWTRAIN_JOB_SECRET": "ab", "PATH": "/bin"}
    out = remote_exports(environ, {"MY_VAR": "1"})
    assert out == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "FLOWTRAIN_SSH": "ssh", "MY_VAR": "1"}


@pytest.mark.parametrize("host,literal,resolved", [
    ("localhost", True, True), ("localhost.localdomain", True, True),
    ("127.0.0.1", True, True), ("127.0.1.1", True, True), ("::1", True, True),
    ("[::1]", True, True), ("10.1.2.3", False, False), ("node7.invalid", False, False),
])
def test_is_loopback_literal_and_resolved(host: str, literal: bool, resolved: bool) -> None:
    assert is_loopback(host) is literal
    assert is_loopback(host, resolve=True) is resolved


def test_is_loopback_resolves_a_name_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert not is_loopback("myhost") and is_loopback("myhost", resolve=True)
