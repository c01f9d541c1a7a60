"""A Ray cluster on this machine for `miles submit` without an address (`make demo`, tests):
a head node on 127.0.0.1 with token authentication, its dashboard (the job server) on a
free local port, stopped with everything it started when the context ends.

The token is a fresh random one in a private file of a temporary directory
(RAY_AUTH_TOKEN_PATH), never in the repository; `env` carries it to `ray job submit`, with
the same settings as cluster/up.sh's clusters (miles.cluster.bringup.ray_env). The
cluster's files (session logs, its address file) live in that directory too and go with it.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from miles.cluster.bringup import State, marked, own_ports, ray_bin, ray_env, stop_cluster, stop_pids
from miles.cluster.node import free_ports

START_TIMEOUT = 120.0


@dataclass
class LocalCluster:
    address: str  # the job server, http://127.0.0.1:<port>
    gcs: str  # 127.0.0.1:<port>, for ray.init(address=...)
    env: dict[str, str]  # this process's environment plus the cluster's auth settings


@contextlib.contextmanager
def local_cluster(num_cpus: int | None = None, log=print):
    # A private temp dir: Ray writes the cluster's address file (ray_current_cluster) and
    # session there, so a later plain ray.init() on this machine never finds this cluster.
    with tempfile.TemporaryDirectory(prefix="miles-ray-", ignore_cleanup_errors=True) as tmp:
        state = State(Path(tmp))
        state.ensure_token()
        env = ray_env(state, None)  # token auth; jobs' `python` is this one
        for attempt in range(1, START_ATTEMPTS + 1):
            head, cluster, gcs_port, out = _start_head(tmp, env, num_cpus)
            try:
                _wait_ready(cluster, head, Path(tmp) / "head.log")
                break
            except BaseException as e:
                _stop(head, tmp, gcs_port)
                out.close()
                if not isinstance(e, PortTaken) or attempt == START_ATTEMPTS:
                    raise
        try:
            log(f"miles: started a local Ray cluster (token auth) at {cluster.gcs}, job server {cluster.address}")
            yield cluster
        finally:
            _stop(head, tmp, gcs_port)
            out.close()


# A port picked free can be bound by another process before Ray binds it: the head then exits
# naming the port, and a new pick starts it again.
START_ATTEMPTS = 3
PORT_TAKEN = ("already occupied", "is trying to use a port number", "Address already in use")


class PortTaken(RuntimeError):
    pass


def _start_head(tmp: str, env: dict[str, str], num_cpus: int | None):
    gcs_port, dash_port = free_ports(2)
    cmd = [ray_bin(), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
           *own_ports("127.0.0.1", (gcs_port, dash_port)), f"--temp-dir={tmp}", "--disable-usage-stats"]
    cmd += [f"--num-cpus={num_cpus}"] if num_cpus else []
    out = open(Path(tmp) / "head.log", "w")  # noqa: SIM115 (closed by the caller)
    # Its own process group: stopping the head signals every process it started.
    head = subprocess.Popen(cmd, env=marked(env, tmp), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return head, LocalCluster(f"http://127.0.0.1:{dash_port}", f"127.0.0.1:{gcs_port}", env), gcs_port, out


def _wait_ready(cluster: LocalCluster, head: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if head.poll() is not None:
            text = log.read_text()
            error = PortTaken if any(m in text for m in PORT_TAKEN) else RuntimeError
            raise error(f"`ray start --head` exited with {head.returncode}:\n{text[-3000:]}")
        try:
            urllib.request.urlopen(f"{cluster.address}/api/version", timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # the server answers (e.g. 401 without the token): it is up
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise RuntimeError(f"the local Ray cluster did not come up in {START_TIMEOUT:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(head: subprocess.Popen, tmp: str, gcs_port: int) -> None:
    """Every process of the cluster (its temp dir or GCS address on the command line, its mark
    in the environment, and their descendants, as cluster/down.sh finds them): SIGTERM, a
    second to exit, then SIGKILL. A throwaway cluster holds nothing worth a longer wait (Ray's
    GCS ignores SIGTERM for seconds)."""
    stop_pids({head.pid}, grace=1.0)
    stop_cluster(tmp, gcs_port, grace=1.0)
    head.wait()
