"""sd_notify over a real AF_UNIX datagram socket, path and abstract namespace."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from orin.serve.sdnotify import Notifier, format_message, socket_address, watchdog_interval


@pytest.fixture()
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(2)
    yield path, sock
    sock.close()


def _recv(sock) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


def test_ready_status_watchdog_stopping_over_a_path_socket(listener):
    path, sock = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("serving tiny on http://127.0.0.1:1234")
    assert _recv(sock) == {"READY": "1", "STATUS": "serving tiny on http://127.0.0.1:1234", "MAINPID": str(os.getpid())}
    assert notifier.watchdog()
    assert _recv(sock) == {"WATCHDOG": "1"}
    assert notifier.stopping("bye\nnow")
    assert _recv(sock) == {"STOPPING": "1", "STATUS": "bye now"}


def test_abstract_namespace_socket():
    name = f"orin-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        assert Notifier.from_env({"NOTIFY_SOCKET": "@" + name}).status("loading")
        assert _recv(sock) == {"STATUS": "loading"}
    finally:
        sock.close()


def test_without_systemd_nothing_is_sent(tmp_path):
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert notifier.ready("x") is False
    assert notifier.watchdog_s is None


def test_a_missing_socket_is_logged_not_raised(tmp_path, caplog):
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.watchdog() is False
    assert "could not notify systemd" in caplog.text


def test_unsupported_socket_kinds_are_skipped(caplog):
    assert socket_address("vsock:2:1234") is None
    assert Notifier(socket_path="vsock:2:1234").watchdog() is False
    assert "not a unix socket path" in caplog.text


def test_watchdog_interval_is_half_of_watchdog_usec():
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    # Meant for another process (e.g. inherited from a parent): not ours to ping.
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


def test_format_message():
    assert format_message({"READY": 1, "STATUS": "a\nb"}) == b"READY=1\nSTATUS=a b"
