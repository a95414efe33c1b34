"""The harness of the server tests: ``python -m powerpy serve`` on a loopback port in its own
process, with raw-HTTP and ``openai`` clients."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ServerProcess:
    """``python -m powerpy serve ARGS --port 0``, started and waited for (its stderr line
    ``listening on http://HOST:PORT``)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "powerpy", "-v", "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            line = self.proc.stderr.readline()
            if not line or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start:\n{''.join(self.lines)}")
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            url = m and m.group(1)
        self.url = url
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def client(self, api_key: str = "none", timeout: float = 60):
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout
        )

    def connect(self, method: str, path: str, body=None, headers=None):
        """Send a request; returns (connection, response) with the body unread."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        conn.request(
            method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        return conn, conn.getresponse()

    def request(self, method: str, path: str, body=None, headers=None):
        """(status, lower-cased headers, JSON or text) of one request."""
        conn, resp = self.connect(method, path, body, headers)
        try:
            text = resp.read().decode("utf-8", "replace")
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed
        finally:
            conn.close()

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def next_data(resp) -> str | None:
    """The payload of the next ``data:`` line of an event stream (None at its end)."""
    while True:
        line = resp.readline()
        if not line:
            return None
        line = line.decode().strip()
        if line.startswith("data:"):
            return line[5:].strip()


def assert_error(status, body, want_status, param=None):
    assert status == want_status, body
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error" if want_status < 500 else True
    if param is not None:
        assert body["error"]["param"] == param, body
