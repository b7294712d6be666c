#!/usr/bin/env python3
"""The HTTP API against what a probe of the front end sent, over raw sockets where a client
library would tidy the bad input away, with the demo model (no token, loopback, max_open_calls
20, max_batch 32):

  clients that never read their streams do not hold the decode slots others wait for;
  silent connections at max_open_calls give way to requests;
  a cross-origin text/plain POST (415), a foreign Host or Origin (403) on loopback without a token;
  no or two Host, two Authorization, obs-fold (400), Content-Encoding gzip (415);
  a body nested 1,000,000 levels deep (400, no memory kept);
  a half-closed client gets its answer; max_tokens 4294967299 is named as sent;
  and afterwards the server serves, with every KV block back; with a token, names are not checked.

Exits non-zero on the first failure."""
import argparse
import json
import os
import socket
import sys
import time

from openai_client_test import Server, check, fail, metric

HOST = "127.0.0.1"


def connect(port, timeout=10.0, rcvbuf=0):
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect((HOST, port))
    return s


def read_all(s):
    data = b""
    while True:
        try:
            piece = s.recv(65536)
        except (socket.timeout, ConnectionResetError):
            return data
        if not piece:
            return data
        data += piece


def exchange(port, raw_request, half_close=False):
    """(status, parsed JSON body or text) of one raw request the server answers and closes."""
    s = connect(port)
    s.sendall(raw_request)
    if half_close:
        s.shutdown(socket.SHUT_WR)
    data = read_all(s)
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        return 0, ""
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        return status, body.decode(errors="replace")
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def post(port, path, body, headers=None, host=None, version="1.1", close=True):
    body = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [f"POST {path} HTTP/{version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    for name, value in (headers if headers is not None else
                        [("Content-Type", "application/json")]):
        lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def expect(status_body, status, needle, what):
    status_got, body = status_body
    message = body["error"]["message"] if isinstance(body, dict) and "error" in body else str(body)
    shaped = isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param",
                                                                      "code"}
    check(status_got == status and needle in message and shaped,
          f"{what}: {status_got} {message[:120]!r}")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def completion(port, max_tokens=4, timeout=30.0):
    """Seconds one 4-token completion takes, end to end, on a fresh connection."""
    start = time.time()
    s = connect(port, timeout=timeout)
    s.sendall(post(port, "/v1/completions", {"model": "demo", "prompt": "Hello",
                                             "max_tokens": max_tokens, "temperature": 0},
                   host=f"{HOST}:{port}"))
    data = read_all(s)
    s.close()
    check(data.startswith(b"HTTP/1.1 200") and b'"finish_reason":"length"' in data,
          f"a {max_tokens}-token completion is answered ({data[:60]!r})")
    return time.time() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--scratch", required=True)
    args = ap.parse_args()
    os.makedirs(args.scratch, exist_ok=True)
    server = Server(args.server, ["--demo-model", "--kv-memory", "64MiB", "--max-open-calls", "20",
                                  "--http-unread-stream-bytes", "16KiB"], args.scratch, "probe")
    port = server.http_port
    hostport = f"{HOST}:{port}"
    base = f"http://{hostport}"
    ok_body = {"model": "demo", "prompt": "Hi", "max_tokens": 2}
    try:
        baseline = completion(port)

        # --- content type, Host and Origin on a loopback bind without a token ---
        expect(exchange(port, post(port, "/v1/completions", json.dumps(ok_body).encode(),
                                   headers=[("Content-Type", "text/plain")], host=hostport)),
               415, "Content-Type: 'text/plain'", "a text/plain POST")
        expect(exchange(port, post(port, "/v1/completions", ok_body, headers=[], host=hostport)),
               415, "Content-Type: missing", "a POST without Content-Type")
        expect(exchange(port, post(port, "/v1/completions", ok_body, host="evil.example:80")),
               403, "Host 'evil.example:80'", "a foreign Host")
        expect(exchange(port, post(port, "/v1/completions", ok_body, host=hostport,
                                   headers=[("Content-Type", "application/json"),
                                            ("Origin", "http://evil.example")])),
               403, "Origin 'http://evil.example'", "a foreign Origin")
        status, _ = exchange(port, post(port, "/v1/completions", ok_body, host=f"localhost:{port}",
                                        headers=[("Content-Type", "application/json; charset=utf-8"),
                                                 ("Origin", f"http://localhost:{port}")]))
        check(status == 200, f"localhost Host and Origin, JSON with a charset: {status}")
        status, _ = exchange(port, f"GET /health HTTP/1.1\r\nHost: [::1]:{port}\r\n"
                             "Connection: close\r\n\r\n".encode())
        check(status == 200, f"Host [::1]: {status}")

        # --- ambiguous headers ---
        expect(exchange(port, b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n"), 400,
               "needs a Host header", "HTTP/1.1 without Host")
        expect(exchange(port, f"GET /v1/models HTTP/1.1\r\nHost: {hostport}\r\nHost: "
                        f"{hostport}\r\n\r\n".encode()), 400, "more than one Host", "two Host")
        expect(exchange(port, post(port, "/v1/completions", ok_body, host=hostport,
                                   headers=[("Content-Type", "application/json"),
                                            ("Authorization", "Bearer a"),
                                            ("Authorization", "Bearer b")])),
               400, "more than one Authorization", "two Authorization headers")
        expect(exchange(port, post(port, "/v1/completions", ok_body, host=hostport,
                                   headers=[("Content-Type", "application/json"),
                                            ("X-Folded", "one"), (" two", "")])),
               400, "obs-fold", "an obs-folded header line")
        expect(exchange(port, post(port, "/v1/completions", ok_body, host=hostport,
                                   headers=[("Content-Type", "application/json"),
                                            ("Content-Encoding", "gzip")])),
               415, "Content-Encoding 'gzip'", "Content-Encoding gzip")

        # --- a body 1,000,000 levels deep: refused, and its tree never built ---
        rss_before = rss_kib(server.proc.pid)
        levels = 1_000_000
        deep = (b'{"model": "demo", "prompt": "Hi", "user": ' + b"[" * levels + b"]" * levels + b"}")
        expect(exchange(port, post(port, "/v1/completions", deep, host=hostport)), 400,
               "deeper than 128 levels", "a body nested 1,000,000 levels")
        grown = (rss_kib(server.proc.pid) - rss_before) / 1024
        check(grown < 24, f"the deep body left {grown:.1f} MiB more RSS (its tree: ~75 MiB)")

        # --- a value beyond int32 is named as sent ---
        expect(exchange(port, post(port, "/v1/completions", dict(ok_body, max_tokens=4294967299),
                                   host=hostport)),
               400, "got 4294967299", "max_tokens 4294967299")

        # --- a half-closed client gets its answer, streamed or not ---
        status, body = exchange(port, post(port, "/v1/completions", dict(ok_body, max_tokens=16),
                                           host=hostport, close=False), half_close=True)
        check(status == 200 and body["usage"]["completion_tokens"] == 16,
              f"half-closed after the request: {status}, all 16 tokens")
        status, body = exchange(port, post(port, "/v1/completions",
                                           dict(ok_body, max_tokens=16, stream=True),
                                           host=hostport, close=False), half_close=True)
        check(status == 200 and "data: [DONE]" in body, f"half-closed stream: {status}, to [DONE]")

        # --- silent connections at max_open_calls (20) ---
        silent = [connect(port) for _ in range(30)]
        took = completion(port)
        check(took < baseline + 1.0, f"30 silent sockets: a completion took {took:.2f} s "
              f"(alone {baseline:.2f} s)")
        for s in silent:
            s.close()

        # --- clients that never read their streams ---
        stalled = []
        for _ in range(16):  # 64 sequences for 32 decode slots; full buffers after ~20 KiB
            s = connect(port, rcvbuf=4096)
            s.sendall(post(port, "/v1/completions",
                           {"model": "demo", "prompt": "Hello", "n": 4, "stream": True,
                            "max_tokens": 4000, "ignore_eos": True, "temperature": 0},
                           host=hostport, close=False))
            stalled.append(s)
        time.sleep(0.5)
        took = completion(port, timeout=60)
        check(took < baseline + 3.0, f"16 streams nobody reads (n 4): a 4-token completion took "
              f"{took:.2f} s (alone {baseline:.2f} s; before: 60 s)")
        # Read again: a paused stream goes on (its buffers held ~20 KiB of it).
        s = stalled[0]
        s.settimeout(15)
        received = 0
        deadline = time.time() + 15
        while received < 64 * 1024 and time.time() < deadline:
            piece = s.recv(1 << 20)
            if not piece:
                break
            received += len(piece)
        check(received >= 64 * 1024, f"a paused stream, read again, goes on ({received} bytes)")
        for s in stalled:
            s.close()

        # --- afterwards: serving, every block back ---
        deadline = time.time() + 20
        while time.time() < deadline:
            used = metric(base, "dropkv_kv_blocks_used")
            if used == 0:
                break
            time.sleep(0.2)
        check(used == 0, f"every KV block back ({used} used)")
        completion(port)
    finally:
        code = server.stop()
    check(code == 0, f"exit code {code} after SIGTERM")

    # With a bearer token, names are not checked (the token guards the API; proxies rename).
    token_file = os.path.join(args.scratch, "token.txt")
    with open(token_file, "w") as f:
        f.write("probe-token\n")
    server = Server(args.server, ["--demo-model", "--kv-memory", "64MiB",
                                  "--auth-token-file", token_file], args.scratch, "probe_token")
    try:
        status, body = exchange(server.http_port, post(
            server.http_port, "/v1/completions", ok_body, host="api.example.com",
            headers=[("Content-Type", "application/json"), ("Origin", "https://app.example.com"),
                     ("Authorization", "Bearer probe-token")]))
        check(status == 200, f"with a token, Host api.example.com and a foreign Origin: {status}")
    finally:
        code = server.stop()
    check(code == 0, f"token server exit code {code} after SIGTERM")
    print("PASS")


if __name__ == "__main__":
    main()
