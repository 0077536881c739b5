"""Start a real `memfit serve` subprocess on a free port (--port 0; the port is read from its
"listening on" line) and wait until /health answers 200."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx


class ServerProcess:
    def __init__(self, args: list[str], env: dict | None = None, timeout: float = 90.0):
        cmd = [sys.executable, "-m", "memfit", "serve", *args]
        if "--port" not in args:
            cmd += ["--port", "0"]
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})})
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("memfit serve did not start:\n" + "".join(self.lines))
        while True:  # /health is 503 while the model loads
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("memfit serve did not become healthy:\n" + "".join(self.lines))
            time.sleep(0.1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+?:\d+)", line)
            if m:
                self.url = m.group(1)
                self._listening.set()

    def wait_for(self, text: str, timeout: float = 30.0) -> str:
        """The output so far once it contains ``text`` (the reader thread may lag behind the
        server: a line printed before /health turned 200 can arrive after); AssertionError
        with the output after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while text not in (out := "".join(self.lines)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert text in out, out
        return out

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics, e.g. {"memfit_kv_blocks_used": 0.0}."""
        r = httpx.get(self.url + "/metrics", timeout=10, headers=getattr(self, "headers", None))
        r.raise_for_status()
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True,
                          text=True, timeout=timeout)
