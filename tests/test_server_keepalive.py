"""Keep-alive after every error status the server sends: a valid request follows each on the same connection, over a
raw socket and with the official client; the errors that must close the connection say so."""

from __future__ import annotations

import json
import socket
import threading

import openai
import pytest
import server_kit as kit

from orin.serve.metrics import parse_metrics

# --------------------------------------------------------------------------- keep-alive after every error


class _RawConnection:
    """One client connection over a raw socket: write a request as bytes, read exactly one response (a
    Content-Length body), so what the server leaves on the connection shows in the next exchange."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, method: str, path: str, body: bytes | None = b"", headers: dict | None = None,
             chunked: bool = False) -> None:
        head = [f"{method} {path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        if chunked:
            head.append("Transfer-Encoding: chunked")
            payload = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                               for i in range(0, len(body), 1000)) + b"0\r\n\r\n"
        elif body is None:
            payload = b""  # no Content-Length at all
        else:
            head.append(f"Content-Length: {len(body)}")
            payload = body
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            part = self.sock.recv(65536)
            assert part, "the server closed the connection"
            self.buf += part
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict, bytes]:
        while b"\r\n\r\n" not in self.buf:
            part = self.sock.recv(65536)
            assert part, "the server closed the connection"
            self.buf += part
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        body = self._read(int(headers.get("content-length", 0)))
        return status, headers, body

    def request(self, method: str, path: str, body: bytes | None = b"", headers: dict | None = None,
                chunked: bool = False) -> tuple[int, dict, bytes]:
        self.send(method, path, body, headers, chunked)
        return self.response()

    def closed_by_server(self) -> bool:
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


class _Switch:
    """A test hook: fails the next request once it holds the GPU, or holds it there until released."""

    def __init__(self):
        self.fail = False
        self.hold = False
        self.admitted = threading.Event()
        self.release = threading.Event()

    def __call__(self, stage, event, cancel):
        if stage != "admitted":
            return
        if self.fail:
            self.fail = False
            raise RuntimeError("injected failure")
        if self.hold:
            self.admitted.set()
            self.release.wait(30)


def _key_file(tmp_path, key: str = "secret-key") -> str:
    path = tmp_path / "keys"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return str(path)


def test_every_error_status_leaves_the_connection_usable_over_a_raw_socket(engine, quantized_dir, tmp_path):
    """The issue's bug: an error answered before the request body was read left the body on the connection,
    where it poisoned the next request (POST /v1/embeddings, then GET /v1/models answered 400)."""
    switch = _Switch()
    srv = kit.start_server(engine, quantized_dir, hook=switch, api_key_file=_key_file(tmp_path), max_body_bytes=4096,
                  max_queue=0)
    auth = {"Authorization": "Bearer secret-key", "Content-Type": "application/json"}
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    conn = _RawConnection(srv.port)
    seen = []

    def then_a_valid_request(name: str) -> None:
        status, _, body = conn.request("GET", "/v1/models", headers=auth)
        assert status == 200, (name, status, body)
        assert [m["id"] for m in json.loads(body)["data"]] == [engine.model_name], name

    def expect(name: str, status: int, method: str, path: str, body: bytes | None = b"",
               headers: dict | None = None, chunked: bool = False) -> None:
        got, got_headers, payload = conn.request(method, path, body, auth if headers is None else headers, chunked)
        assert got == status, (name, got, payload)
        assert got_headers["content-type"] == "application/json" and json.loads(payload)["error"]["message"], name
        assert got_headers.get("connection") != "close", name
        seen.append(status)
        then_a_valid_request(name)

    try:
        expect("malformed JSON", 400, "POST", "/v1/chat/completions", b'{"messages": [')
        expect("wrong key, with a body", 401, "POST", "/v1/chat/completions", chat,
               {"Authorization": "Bearer wrong", "Content-Type": "application/json"})
        expect("no key", 401, "GET", "/metrics", headers={})
        expect("unknown endpoint, with a body", 404, "POST", "/v1/embeddings", b'{"input": "x", "model": "m"}')
        expect("unknown model", 404, "POST", "/v1/chat/completions",
               json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}).encode())
        expect("wrong method, with a body", 405, "PUT", "/v1/models", b'{"x": 1}')
        expect("no Content-Length", 411, "POST", "/v1/chat/completions", None)
        expect("body over --max-body, sent whole", 413, "POST", "/v1/chat/completions", b" " * 5000)
        expect("chunked body over --max-body", 413, "POST", "/v1/chat/completions", b" " * 9000, chunked=True)
        expect("unknown method, with a body", 501, "BREW", "/pot", b"coffee")
        switch.fail = True
        expect("internal error", 500, "POST", "/v1/chat/completions", chat)
        srv.state = "warming up"
        try:
            expect("not ready yet", 503, "POST", "/v1/chat/completions", chat)
        finally:
            srv.state = "ready"
        switch.hold = True
        results: list = []
        holder = threading.Thread(target=lambda: results.append(kit.http_request(srv, "POST", "/v1/chat/completions", chat,
                                                                      headers=auth)[0]), daemon=True)
        holder.start()
        assert switch.admitted.wait(30)
        expect("queue full", 429, "POST", "/v1/chat/completions", chat)
        switch.release.set()
        holder.join(60)
        assert results == [200]
        # And the connection still carries a generation, streamed or not.
        status, _, body = conn.request("POST", "/v1/chat/completions", chat, auth)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1
        then_a_valid_request("after a completion")
        assert sorted(set(seen)) == [400, 401, 404, 405, 411, 413, 429, 500, 501, 503]
    finally:
        switch.release.set()
        conn.close()
        srv.stop()


def test_the_errors_that_close_the_connection_say_so(engine, quantized_dir):
    """Where the connection cannot carry another request, the response says `Connection: close` and the server
    closes it: a body that does not arrive in time (408), an oversized body whose client waits for
    `100 Continue` and so never sends it (413), and a request HTTP cannot parse (400)."""
    srv = kit.start_server(engine, quantized_dir, io_timeout_s=0.5, max_body_bytes=4096)
    try:
        slow = _RawConnection(srv.port)
        slow.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess")
        status, headers, body = slow.response()
        assert status == 408 and "timed out" in json.loads(body)["error"]["message"]
        assert headers["connection"] == "close" and slow.closed_by_server()
        waiting = _RawConnection(srv.port)
        waiting.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                             b"Content-Length: 5000\r\n\r\n")
        status, headers, body = waiting.response()  # the final status, never "100 Continue"
        assert status == 413 and headers["connection"] == "close" and waiting.closed_by_server()
        garbled = _RawConnection(srv.port)
        garbled.sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n")
        status, headers, body = garbled.response()
        assert status == 400 and headers["content-type"] == "application/json"
        assert json.loads(body)["error"]["message"].startswith("bad HTTP request")
        assert headers["connection"] == "close" and garbled.closed_by_server()
        assert kit.http_request(srv, "GET", "/health")[0] == 200
    finally:
        srv.stop()


def test_expect_100_continue_and_chunked_request_bodies(server, engine):
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    conn = _RawConnection(server.port)
    try:
        conn.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(chat))
        assert conn.response()[0] == 100  # sent when the server starts reading the body, not before
        conn.sock.sendall(chat)
        status, _, body = conn.response()
        assert status == 200 and json.loads(body)["model"] == engine.model_name
        status, _, body = conn.request("POST", "/v1/chat/completions", chat, chunked=True)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1
    finally:
        conn.close()


def test_errors_then_requests_reuse_one_connection_with_the_openai_client(engine, quantized_dir, tmp_path):
    """The issue's second form of the bug: with the official client, a wrong key and then models.list() on the
    same pooled connection answered 501. Every call below must go over one connection."""
    srv = kit.start_server(engine, quantized_dir, api_key_file=_key_file(tmp_path), max_body_bytes=64 * 1024)
    http_client = openai.DefaultHttpxClient()
    good = openai.OpenAI(base_url=srv.url + "/v1", api_key="secret-key", max_retries=0, timeout=120,
                         http_client=http_client)
    bad = good.with_options(api_key="wrong")
    hi = [{"role": "user", "content": "hi"}]
    try:
        before = srv.metrics.connections
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=engine.model_name, messages=hi, max_tokens=2)
        assert [m.id for m in good.models.list().data] == [engine.model_name]
        with pytest.raises(openai.NotFoundError):
            good.embeddings.create(model=engine.model_name, input="x")
        assert [m.id for m in good.models.list().data] == [engine.model_name]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            good.chat.completions.create(model="gpt-4o", messages=hi)
        with pytest.raises(openai.BadRequestError, match="not valid base64"):
            good.chat.completions.create(model=engine.model_name, messages=[
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}]}])
        with pytest.raises(openai.APIStatusError) as info:  # 100 kB of text, over the 64 kB --max-body
            good.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "x" * 100_000}])
        assert info.value.status_code == 413
        with pytest.raises(openai.APIStatusError) as info:
            good.delete("/models", cast_to=object)
        assert info.value.status_code == 405
        reply = good.chat.completions.create(model=engine.model_name, messages=hi, max_tokens=2)
        assert reply.usage.completion_tokens >= 1
        assert [m.id for m in good.models.list().data] == [engine.model_name]
        assert srv.metrics.connections - before == 1  # one connection for everything above
        status, _, text = kit.http_request(srv, "GET", "/metrics", headers={"Authorization": "Bearer secret-key"})
        assert status == 200 and parse_metrics(text)["orin_http_connections_total"] == srv.metrics.connections
    finally:
        http_client.close()
        srv.stop()


def test_the_app_takes_websocket_routes(engine, quantized_dir):
    """The stack speaks WebSocket (uvicorn with websockets) for a realtime API to come: a route added to the
    application's router answers, beside the HTTP API."""
    from starlette.routing import WebSocketRoute
    from websockets.sync.client import connect

    async def echo(ws) -> None:
        await ws.accept()
        await ws.send_text("echo: " + await ws.receive_text())
        await ws.close()

    srv = kit.start_server(engine, quantized_dir)
    srv.app.router.routes.append(WebSocketRoute("/v1/echo", echo))
    try:
        with connect(srv.url.replace("http://", "ws://") + "/v1/echo", open_timeout=30) as ws:
            ws.send("hi")
            assert ws.recv(timeout=30) == "echo: hi"
        assert kit.http_request(srv, "GET", "/v1/models")[0] == 200
    finally:
        srv.stop()


