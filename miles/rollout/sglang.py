"""The SGLang engine (GPU clusters): `python -m sglang.launch_server` with the model path and
every `rollout.sglang.*` option passed through unchanged, used through the same HTTP API and
router as the embedded engine. SGLang cannot run on the CPU machines: its command line is
snapshot-tested, and the client and router are tested against the embedded engine."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from miles.cluster.node import free_port
from miles.rollout.router import wait_healthy
from miles.subprocs import popen_tied

OWN_FLAGS = ("model_path", "host", "port", "api_key")  # set by the launcher


def launch_command(model_path: str, host: str, port: int, options: dict, api_key: str | None = None) -> list[str]:
    """The server's argv: each option `key: value` becomes `--key value` (underscores to dashes),
    `key: true` a bare flag, `key: false`/None is left out, a list gives one value each.
    `api_key`: the run's key (SGLang's --api-key: every endpoint but /health* then wants
    Authorization: Bearer <it>), given as --api-key=KEY (a key may start with '-')."""
    clash = sorted(k for k in options if k.replace("-", "_") in OWN_FLAGS)
    if clash:
        raise ValueError(f"rollout.sglang: {clash} are set by miles (the model path, host, port and the run's key)")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
           "--port", str(port), *([f"--api-key={api_key}"] if api_key else [])]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            cmd += [flag, *map(str, value)]
        else:
            cmd += [flag, str(value)]
    return cmd


class SGLangClient:
    """What miles asks of a running SGLang server besides generation (which goes through the
    router): loading a weight version from disk. The embedded engine serves the same call;
    the tests drive this client against it."""

    def __init__(self, url: str, api_key: str | None = None):
        self.base = url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def update_from_disk(self, path: str, version: int | None = None) -> dict:
        body = {"model_path": path} | ({"weight_version": str(version)} if version is not None else {})
        r = httpx.post(f"{self.base}/update_weights_from_disk", json=body, headers=self.headers, timeout=3600)
        try:
            out = r.json()
        except ValueError:
            out = r.text
        if r.status_code != 200 or not isinstance(out, dict) or not out.get("success", False):
            raise RuntimeError(f"SGLang refused the weights at {path}: HTTP {r.status_code}: {out}")
        return out


class SGLangEngine:
    """One SGLang server process (a Ray actor on a GPU node, or in the driver)."""

    def __init__(self, model_path: str, options: dict, host: str | None = None, port: int = 0,
                 startup_timeout: float = 1800, log_file: str | None = None, api_key: str | None = None):
        from miles.cluster.node import node_address

        self.host = host or node_address()  # the router may run on another node
        self.port = port or free_port(self.host)
        self.cmd = launch_command(model_path, self.host, self.port, options, api_key)
        self.client = SGLangClient(self.url(), api_key)
        self._log = open(log_file, "ab") if log_file else None  # noqa: SIM115
        self.proc = popen_tied(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)  # dies with this process
        try:
            wait_healthy(self.proc, f"{self.url()}/health_generate", startup_timeout, "sglang.launch_server",
                         log_file, poll=2)
        except RuntimeError:
            self.shutdown()
            raise

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def pid(self) -> int:
        return os.getpid()

    def update_from_disk(self, path: str, version: int | None = None) -> dict:
        return self.client.update_from_disk(path, version)

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
