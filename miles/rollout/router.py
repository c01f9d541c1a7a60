"""SGLang's own router (`sglang-router`, a Rust binary) in front of the engines: started,
watched and stopped here; workers added and removed through its HTTP API."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from miles.cluster.node import free_port, free_ports
from miles.subprocs import popen_tied


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str, log_file=None,
                 poll: float = 1.0) -> None:
    """Until GET url answers 200; an error if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}: {' '.join(map(str, proc.args))}"
                               + (f" (log: {log_file})" if log_file else ""))
        try:
            if httpx.get(url, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")
        time.sleep(poll)


ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")


def _plain_lines(stream, path: Path) -> None:
    """Copy the router's output into `path` line by line, without its terminal color codes."""
    with stream, open(path, "ab") as f:
        for line in stream:
            f.write(ANSI.sub(b"", line))
            f.flush()


class Router:
    def __init__(self, worker_urls: list[str], policy: str = "cache_aware", host: str = "127.0.0.1",
                 port: int = 0, request_timeout: float = 600, health_interval: float = 5,
                 extra_args: list[str] | None = None, log_file: str | Path | None = None,
                 api_key: str | None = None):
        """api_key: the router then takes Authorization: Bearer <it> from its clients and sends
        it to the engines (sglang-router's --api-key)."""
        self.host, self.port = host, port or free_port(host)
        self.cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(self.port),
                    "--policy", policy, "--request-timeout-secs", str(int(request_timeout)),
                    "--health-check-interval-secs", str(max(1, int(health_interval))),
                    "--prometheus-host", host, "--prometheus-port", str(free_ports(1, host, (self.port,))[0]),
                    "--log-level", "warn", *([f"--api-key={api_key}"] if api_key else []), *(extra_args or [])]
        if worker_urls:
            self.cmd += ["--worker-urls", *worker_urls]
        self.proc = popen_tied(self.cmd, stdout=subprocess.PIPE if log_file else subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)  # dies with this process
        if log_file:  # its lines come colored (ANSI codes, whatever NO_COLOR says): plain text in the file
            threading.Thread(target=_plain_lines, args=(self.proc.stdout, Path(log_file)), daemon=True,
                             name="router-log").start()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, timeout=10, headers=self.headers)
        try:
            wait_healthy(self.proc, f"{self.url}/health", 60, "sglang-router", log_file, poll=0.2)
        except RuntimeError:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def workers(self) -> list[dict]:
        """The router's workers: {"id", "url", "is_healthy", "load", ...}."""
        return self.client.get("/workers").json().get("workers", [])

    def add(self, url: str, timeout: float = 60) -> None:
        """Register an engine and wait until the router lists it (it reads /model_info first)."""
        r = self.client.post("/workers", json={"url": url})
        if r.status_code >= 400:
            raise RuntimeError(f"sglang-router refused worker {url}: {r.status_code} {r.text[:200]}")
        deadline = time.monotonic() + timeout
        while url not in [w["url"] for w in self.workers()]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router did not list worker {url} within {timeout:.0f} s")
            time.sleep(0.1)

    def remove(self, url: str) -> None:
        for w in self.workers():
            if w["url"] == url:
                self.client.delete(f"/workers/{w['id']}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()
