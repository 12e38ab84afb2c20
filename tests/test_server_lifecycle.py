"""The server's life under systemd and at startup: notify READY/WATCHDOG/STOPPING, SIGTERM, startup errors, the
served model name, and quiet logs."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
import server_kit as kit

from orin.runtime.engine import EngineConfig
from orin.serve.app import ServeConfig, Server

# --------------------------------------------------------------------------- systemd: notify, watchdog, SIGTERM


def test_watchdog_pings_stop_while_a_request_is_stuck(engine, quantized_dir, tmp_path):
    from orin.serve.sdnotify import Notifier

    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    notify.bind(path)
    notify.settimeout(10)

    def drain() -> list[bytes]:
        notify.setblocking(False)
        out = []
        try:
            while True:
                out.append(notify.recv(4096))
        except BlockingIOError:
            pass
        notify.settimeout(10)
        return out

    hook = kit.Holder()
    cfg = ServeConfig(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"), port=0, warmup=False,
                      stall_s=0.3)
    srv = Server(cfg, engine=engine, hook=hook, notifier=Notifier(socket_path=path, watchdog_s=0.05)).start()
    results: list = []
    try:
        assert notify.recv(4096).startswith(b"READY=1")
        assert notify.recv(4096) == b"WATCHDOG=1"
        t = kit.post_in_thread(srv, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, results, "r")
        assert hook.admitted.wait(30)
        time.sleep(0.6)  # no progress for longer than stall_s
        assert not srv.healthy()
        status, _, body = kit.http_request(srv, "GET", "/health")
        assert status == 503 and body["status"] == "unhealthy"
        drain()
        time.sleep(0.3)
        assert b"WATCHDOG=1" not in drain()  # systemd will restart a stuck server
        hook.release.set()
        t.join(60)
        assert results[0][1] == 200
        assert notify.recv(4096) == b"WATCHDOG=1"  # healthy again
    finally:
        hook.release.set()
        srv.stop()
        notify.close()


def test_systemd_notify_ready_watchdog_and_sigterm(quantized_dir, tmp_path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = str(tmp_path / "notify.sock")
    notify.bind(notify_path)
    notify.settimeout(120)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000", "PYTHONUNBUFFERED": "1"}
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orin.cli", "serve", "--model-dir", quantized_dir, "--port", "0", "--device", "cpu",
         "--power-backend", "none", "--drain-seconds", "5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    messages: list[dict] = []

    def receive_until(key: str) -> dict:
        while True:
            msg = dict(line.split("=", 1) for line in notify.recv(4096).decode().split("\n"))
            messages.append(msg)
            if key in msg:
                return msg

    try:
        ready = receive_until("READY")
        assert ready["MAINPID"] == str(proc.pid)
        url = ready["STATUS"].rsplit(" on ", 1)[1]
        port = int(url.rsplit(":", 1)[1])
        statuses = [m.get("STATUS", "") for m in messages]
        assert any(s.startswith("loading") for s in statuses) and "warming up" in statuses
        receive_until("WATCHDOG")  # pinged every 0.1 s once ready
        receive_until("WATCHDOG")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        proc.send_signal(signal.SIGTERM)
        stopping = receive_until("STOPPING")
        assert stopping["STOPPING"] == "1"
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "SIGTERM received" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


# --------------------------------------------------------------------------- startup errors (no model loaded)


def test_startup_errors_fail_fast_with_usage_errors(tmp_path):
    from click.testing import CliRunner

    from orin.cli import cli

    runner = CliRunner()
    empty = tmp_path / "empty-key"
    empty.write_text("\n# only a comment\n")
    result = runner.invoke(cli, ["serve", "--model-dir", str(tmp_path), "--api-key-file", str(empty)])
    assert result.exit_code == 2 and "holds no key" in result.output
    result = runner.invoke(cli, ["serve", "--model-dir", str(tmp_path), "--api-key-file", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "cannot read it" in result.output
    # A taken port fails at once, before any model load.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(cli, ["serve", "--model-dir", str(tmp_path), "--port", str(port)])
        assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output
    # A missing model: the server bound, then the engine refused the directory, and the error says so.
    result = runner.invoke(cli, ["serve", "--model-dir", str(tmp_path), "--port", "0", "--device", "cpu",
                                 "--power-backend", "none"])
    assert result.exit_code == 1 and "manifest.json" in result.output


def test_journald_log_lines_carry_priorities():
    import logging

    from orin.serve.app import _JournalFormatter

    fmt = _JournalFormatter("%(name)s: %(message)s")
    for level, prio in ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6), (logging.DEBUG, 7)):
        record = logging.LogRecord("orin.serve.app", level, __file__, 1, "hello", None, None)
        assert fmt.format(record) == f"<{prio}>orin.serve.app: hello"


# --------------------------------------------------------------------------- the model's name, and quiet logs


def test_served_name_comes_from_the_manifest_not_the_directory(engine, quantized_dir, tmp_path):
    import shutil

    # A copy under another directory name still answers to the name recorded at quantize time.
    copy = tmp_path / "whatever-dir-name"
    shutil.copytree(quantized_dir, copy)
    from orin.checkpoint.manifest import read_manifest

    assert read_manifest(copy).model_name == "qwen3-omni-int4" == engine.model_name
    srv = kit.start_server(engine, str(copy))
    try:
        assert [m.id for m in kit.client(srv).models.list().data] == ["qwen3-omni-int4"]
    finally:
        srv.stop()
    named = kit.start_server(engine, quantized_dir, served_model_name="robot-brain")
    try:
        client = kit.client(named)
        assert [m.id for m in client.models.list().data] == ["robot-brain"]
        reply = client.chat.completions.create(model="robot-brain", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
        assert reply.model == "robot-brain"
        with pytest.raises(openai.NotFoundError, match="robot-brain"):
            client.chat.completions.create(model="qwen3-omni-int4", messages=[{"role": "user", "content": "hi"}])
    finally:
        named.stop()


def test_a_bad_served_name_is_a_usage_error(quantized_dir):
    from click.testing import CliRunner

    from orin.cli import cli

    result = CliRunner().invoke(cli, ["serve", "--model-dir", quantized_dir, "--served-model-name", "two words",
                                      "--port", "0"])
    assert result.exit_code == 2 and "served model name 'two words'" in result.output


def test_a_client_reset_is_not_a_traceback_and_probes_are_not_logged(server, caplog, capfd):
    import logging
    import struct

    caplog.set_level(logging.DEBUG, logger="orin.serve.app")
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in sock.recv(65536)
    sock.sendall(b"GET /heal")  # the server now waits for the rest of the request line
    time.sleep(0.2)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a TCP reset
    sock.close()
    kit.wait_for(lambda: any("closed the connection" in r.getMessage() for r in caplog.records), what="the reset")
    assert kit.http_request(server, "GET", "/metrics")[0] == 200
    kit.wait_for(lambda: any("GET /metrics 200" in r.getMessage() for r in caplog.records), what="the probe line")
    assert kit.http_request(server, "GET", "/v1/models")[0] == 200
    # The access line is written after the response is sent: wait for it rather than race it.
    kit.wait_for(lambda: any("GET /v1/models 200" in r.getMessage() for r in caplog.records), what="the access line")
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("GET /v1/models 200" in m for m in info)
    assert not any("/health" in m or "/metrics" in m for m in info)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("GET /health 200" in m for m in debug) and any("GET /metrics 200" in m for m in debug)


def test_no_rope_parameters_warning_on_any_command(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "orin.cli", "plan", tiny_model_dir], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "rope_parameters" not in result.stderr and "Unrecognized keys" not in result.stderr
