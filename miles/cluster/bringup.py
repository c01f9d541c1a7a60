"""`cluster/up.sh`, `cluster/down.sh`, `cluster/status.sh`: a Ray cluster that miles jobs are
submitted to, with token authentication always on.

    cluster/up.sh --local                  a head on this machine, its job server on 127.0.0.1
    cluster/up.sh --hostfile hosts.txt     a head here and a worker node per line, started over ssh
    cluster/up.sh --join HEAD:PORT --node-ip IP    one worker node (what up.sh runs on each host)
    cluster/down.sh                        stop every node up.sh started (processes found by PID)
    cluster/status.sh                      nodes with their CPUs and GPUs, and the jobs

The cluster's state lives in one directory (--state-dir, default ~/.miles/cluster):
`token` (0600, made once), `cluster.env` (what clients source: RAY_ADDRESS, the auth settings),
`head.json` (addresses, ports, the Ray temp dir, the worker hosts) and `logs/`. Running up.sh
on a cluster that is up changes nothing (worker hosts missing from it are started); down.sh
with nothing up is a no-op. Before anything starts, preflight checks name what is wrong:
Python and package versions differing between nodes, ports in use, a shared path that is not
writable or not shared, fewer GPUs than --gpus-per-node.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from miles.cluster.node import free_ports, ray_bin

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "cluster" / "env"
PACKAGES = ("ray", "torch", "megatron-core", "miles", "sglang-router")
STOP_WAIT_S = 30  # `ray job stop`: SIGTERM, then this long for the job to clean up, then SIGKILL


class ClusterError(RuntimeError):
    """A preflight check or a start failed; the message says what and how to fix it."""


@dataclass
class State:
    dir: Path

    @property
    def token(self) -> Path:
        return self.dir / "token"

    @property
    def env_file(self) -> Path:
        return self.dir / "cluster.env"

    @property
    def head_file(self) -> Path:
        return self.dir / "head.json"

    def head(self) -> dict | None:
        return json.loads(self.head_file.read_text()) if self.head_file.is_file() else None

    def ensure_token(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not self.token.is_file():
            fd = os.open(self.token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        os.chmod(self.token, 0o600)


# --------------------------------------------------------------------------- environment
def ray_env(state: State, preset: str | None) -> dict[str, str]:
    """What every Ray process of the cluster starts with: token auth, this Python first on PATH
    (jobs' entrypoints run `python`), a graceful-stop window, and the hardware preset."""
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(state.token),
               RAY_JOB_STOP_WAIT_TIME_S=str(STOP_WAIT_S),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("RAY_AUTH_TOKEN", None)  # the file is the one source of the token
    env.pop("RAY_ADDRESS", None)
    return env | (read_preset(preset) if preset else {})


def read_preset(name: str) -> dict[str, str]:
    """cluster/env/<name>.env (or a path): KEY=VALUE lines, # comments."""
    path = Path(name) if ("/" in name or name.endswith(".env")) else PRESETS / f"{name}.env"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.env")))
        raise ClusterError(f"--env {name}: no preset {path} (presets: {known})")
    out = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if not m:
            raise ClusterError(f"{path}:{i}: expected KEY=VALUE, got {line!r}")
        out[m[1]] = m[2]
    return out


def own_ports(host: str, avoid: tuple[int, ...] = ()) -> list[str]:
    """`ray start` flags for the ports Ray would otherwise take at fixed defaults (the dashboard
    agent's 52365, the client server's 10001), where a second cluster on the same machine (a
    test's, `make demo` beside cluster/up.sh's) would collide and never accept a job: two free
    ports, distinct from each other and from `avoid` (the node's GCS and dashboard ports)."""
    agent, client = free_ports(2, host, avoid)
    return [f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}"]


def temp_dir(gcs_port: int) -> str:
    """Ray's files (sessions, sockets, logs) of the cluster on this machine: short (socket paths
    are limited to 107 bytes) and unique per cluster, so its processes can be found by it."""
    return f"/tmp/miles-ray-{os.getuid()}-{gcs_port}"


# --------------------------------------------------------------------------- preflight
def fingerprint() -> dict[str, str]:
    """Python and the packages a job imports, as versions: equal on every node."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "not installed"
    return out


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def check_port_free(host: str, port: int, flag: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT does not count
        try:
            s.bind((host, port))
        except OSError:
            raise ClusterError(f"{flag} {port}: in use on {host} (another Ray cluster? cluster/status.sh; or choose "
                               f"another: {flag} N)") from None


def check_shared(path: Path) -> str:
    """Write a marker file under `path` (the run and checkpoint directories' filesystem); its
    name is returned so that other nodes can be asked to read it."""
    marker = path / f".miles-shared-check-{secrets.token_hex(4)}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        marker.write_text(marker.name)
    except OSError as e:
        raise ClusterError(f"--shared {path}: not writable ({e.strerror})") from None
    return marker.name


def compare_versions(here: dict, there: dict, host: str) -> None:
    diff = [f"{k}: {there.get(k)} on {host}, {v} here" for k, v in here.items() if there.get(k) != v]
    if diff:
        raise ClusterError(f"{host} differs from this node (install the same environment on every node):\n  "
                           + "\n  ".join(diff))


# --------------------------------------------------------------------------- the cluster's processes
# Every process `ray start` launches inherits this variable (and nothing else sets it), so a
# process of the cluster is found by it even when its command line names neither the temp dir
# nor the GCS and its parent is gone: the dashboard's forkserver, restarted by a dashboard that
# is stopping, is orphaned with neither. Its value is the cluster's temp dir (the head's; a
# node's own dir starts with it): a local cluster's is a fresh directory, so clusters that
# happen to share a port number are still told apart by it.
CLUSTER_MARK = "MILES_CLUSTER_TEMP_DIR"


def marked(env: dict[str, str], tmp: str) -> dict[str, str]:
    """`env` for the `ray start` of the cluster whose temp dir is `tmp` (a mark inherited from
    an enclosing cluster is replaced: the inner cluster's stop must find its own)."""
    return env | {CLUSTER_MARK: tmp}


def cluster_procs(tmp: str, gcs_port: int) -> dict[int, str]:
    """Live processes of the cluster on this machine (pid -> command line): those naming its
    temp dir or its GCS address on their command line or carrying its mark in their
    environment, and every descendant of those (actors, job entrypoints)."""
    procs, mark = {}, f"{CLUSTER_MARK}={tmp}\0".encode()
    ours = set()
    gcs = re.compile(rf"address=\S*:{gcs_port}\b")
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] == "Z":  # zombies hold nothing; a container's init may never reap them
            continue
        procs[int(p)] = (int(stat[1]), cmd)
        if tmp in cmd or gcs.search(cmd):
            ours.add(int(p))
            continue
        try:
            env = Path(f"/proc/{p}/environ").read_bytes()  # NAME=value\0 ...
            if env.startswith(mark) or b"\0" + mark in env:
                ours.add(int(p))
        except OSError:  # another user's process
            continue
    while more := {p for p, (ppid, _) in procs.items() if ppid in ours} - ours:
        ours |= more
    return {p: procs[p][1] for p in ours}


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.add(p)
        except OSError:
            pass
    return out


def stop_pids(pids: set[int], grace: float = 5.0) -> None:
    """SIGTERM, up to `grace` seconds to exit, then SIGKILL (Ray's GCS and a raylet that lost it
    ignore SIGTERM; they hold nothing a SIGKILL at shutdown loses)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for p in alive(pids):
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not alive(pids):
            return


# --------------------------------------------------------------------------- HTTP checks
def dashboard_status(url: str, token: str | None) -> int | None:
    """HTTP status of the job server's /api/jobs/ (with the token if given); None: no answer."""
    req = urllib.request.Request(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def wait_dashboard(url: str, token: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dashboard_status(url, token) == 200:
            return
        time.sleep(0.5)
    raise ClusterError(f"the job server at {url} did not answer in {timeout:.0f} s")


# --------------------------------------------------------------------------- up
def run_logged(cmd: list[str], env: dict, log: Path, what: str) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise ClusterError(f"{what} failed (exit {rc}); its output, {log}:\n" + log.read_text()[-3000:])


def read_hostfile(path: Path) -> list[tuple[str, str]]:
    """`host [ip]` per line (# comments): ssh to host, the node registers as ip (default host)."""
    hosts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) > 2:
            raise ClusterError(f"{path}:{i}: expected `host [ip]`, got {line.strip()!r}")
        hosts.append((parts[0], parts[-1]))
    return hosts


def outside_address() -> str:
    """This machine's address towards the others (the one a UDP socket routes from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def script(command: str, *args: str) -> str:
    """A shell command running `command` of this module on another host: the repository at the
    same path there (a shared filesystem, or the same checkout), its Python as here."""
    if command == "fingerprint":
        return f"PYTHONPATH={shlex.quote(str(ROOT))} {shlex.quote(sys.executable)} -m miles.cluster.bringup fingerprint"
    return f"MILES_PYTHON={shlex.quote(sys.executable)} " + shlex.join([str(ROOT / "cluster" / f"{command}.sh"), *args])


def remote(args, host: str, command: str, stdin: str | None = None) -> str:
    cmd = [*shlex.split(args.ssh), host, command]
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise ClusterError(f"on {host}: `{command}` failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-2000:]}")
    return p.stdout


def up(args) -> None:
    state = State(args.state_dir)
    if args.join:
        return join(args, state)
    head = state.head()
    if head and dashboard_status(head["dashboard"], state.token.read_text()) == 200:
        print(f"cluster/up.sh: the cluster in {state.dir} is up (job server {head['dashboard']}); nothing to start")
        hosts = read_hostfile(Path(args.hostfile)) if args.hostfile else []
        missing = [h for h in hosts if h[0] not in {x["host"] for x in head["workers"]}]
        if missing:
            start_workers(args, state, head, missing)
        return
    node_ip = "127.0.0.1" if args.local else (args.node_ip or outside_address())
    hosts = [] if args.local else (read_hostfile(Path(args.hostfile)) if args.hostfile else [])
    here = fingerprint()
    check_port_free(node_ip, args.port, "--port")
    dash_host = "0.0.0.0" if args.public else "127.0.0.1"
    check_port_free(dash_host, args.dashboard_port, "--dashboard-port")
    marker = check_shared(Path(args.shared)) if args.shared else None
    for host, _ in hosts:
        compare_versions(here, json.loads(remote(args, host, script("fingerprint"))), host)
        if marker and remote(args, host, f"cat {shlex.quote(str(Path(args.shared) / marker))}").strip() != marker:
            raise ClusterError(f"--shared {args.shared}: {host} does not see this node's files there (not shared)")
    if args.gpus_per_node:
        counts = {"this node": gpu_count()} | {h: int(remote(args, h, "nvidia-smi -L | grep -c '^GPU '").strip() or 0)
                                              for h, _ in hosts}
        short = {h: n for h, n in counts.items() if n < args.gpus_per_node}
        if short:
            raise ClusterError(f"--gpus-per-node {args.gpus_per_node}: " + ", ".join(
                f"{h} has {n}" for h, n in short.items()))
    if marker:
        (Path(args.shared) / marker).unlink()
    if args.public:
        print("cluster/up.sh: WARNING: --public: the job server listens on every interface; anyone who can reach "
              f"port {args.dashboard_port} and holds the token can run code on this cluster", file=sys.stderr)
    state.ensure_token()
    env = ray_env(state, args.env)
    tmp = temp_dir(args.port)
    cmd = [ray_bin(), "start", "--head", f"--node-ip-address={node_ip}", f"--port={args.port}",
           "--include-dashboard=true", f"--dashboard-host={dash_host}", f"--dashboard-port={args.dashboard_port}",
           *own_ports(node_ip, (args.port, args.dashboard_port)), f"--temp-dir={tmp}", "--disable-usage-stats"]
    cmd += [f"--num-cpus={args.num_cpus}"] if args.num_cpus is not None else []
    cmd += [f"--num-gpus={args.num_gpus}"] if args.num_gpus is not None else []
    print(f"cluster/up.sh: starting the head on {node_ip}:{args.port} (token auth; job server on "
          f"{dash_host}:{args.dashboard_port})", flush=True)
    run_logged(cmd, marked(env, tmp), state.dir / "logs" / "head.log", "`ray start --head`")
    dashboard = f"http://127.0.0.1:{args.dashboard_port}"
    wait_dashboard(dashboard, state.token.read_text())
    head = {"gcs": f"{node_ip}:{args.port}", "gcs_port": args.port, "dashboard": dashboard, "temp_dir": tmp,
            "public": args.public, "env": args.env, "workers": []}
    state.head_file.write_text(json.dumps(head, indent=1))
    state.env_file.write_text(f"# source this file to submit to the cluster started by cluster/up.sh\n"
                              f"export RAY_ADDRESS={dashboard}\nexport RAY_AUTH_MODE=token\n"
                              f"export RAY_AUTH_TOKEN_PATH={state.token}\n")
    if hosts:
        start_workers(args, state, head, hosts)
    print(f"cluster/up.sh: up. Submit with:\n  source {state.env_file}\n  miles submit jobs/sft_tiny.yaml\n"
          f"Status: cluster/status.sh; stop: cluster/down.sh" + ("" if args.state_dir == default_state_dir() else
                                                                  f" (both with --state-dir {state.dir})"))


def start_workers(args, state: State, head: dict, hosts: list[tuple[str, str]]) -> None:
    """The token over ssh (0600), then `cluster/up.sh --join` on each host."""
    for host, ip in hosts:
        remote(args, host, f"umask 077 && mkdir -p {shlex.quote(str(state.dir))} && cat > "
                           f"{shlex.quote(str(state.token))}", stdin=state.token.read_text())
        print(f"cluster/up.sh: starting a worker node on {host} ({ip})", flush=True)
        remote(args, host, script("up", "--join", head["gcs"], "--node-ip", ip, "--state-dir", str(state.dir),
                                  *(["--env", head["env"]] if head.get("env") else [])))
        head["workers"].append({"host": host, "ip": ip})
        state.head_file.write_text(json.dumps(head, indent=1))


def join(args, state: State) -> None:
    """This machine joins the cluster at args.join as a worker node."""
    if not state.token.is_file():
        raise ClusterError(f"--join: no token at {state.token} (the head's cluster/up.sh copies it there)")
    gcs_port = int(args.join.rsplit(":", 1)[1])
    ip = args.node_ip or outside_address()
    # A directory of its own: two nodes on one machine (tests) must not unpack jobs' working
    # directories into the same place; the head's prefix still finds its processes.
    tmp = f"{temp_dir(gcs_port)}-{ip}"
    if any(f"--node_ip_address={ip}" in cmd for cmd in cluster_procs(temp_dir(gcs_port), gcs_port).values()):
        print(f"cluster/up.sh: a node on {ip} is already in the cluster at {args.join}; nothing to start")
        return
    cmd = [ray_bin(), "start", f"--address={args.join}", f"--node-ip-address={ip}", f"--temp-dir={tmp}",
           *own_ports(ip, (gcs_port,)), "--disable-usage-stats"]
    cmd += [f"--num-cpus={args.num_cpus}"] if args.num_cpus is not None else []
    cmd += [f"--num-gpus={args.num_gpus}"] if args.num_gpus is not None else []
    env = marked(ray_env(state, args.env), temp_dir(gcs_port))  # the head's dir: down.sh --this-node looks for it
    run_logged(cmd, env, state.dir / "logs" / f"node-{ip}.log", f"`ray start` on {ip}")
    print(f"cluster/up.sh: node {ip} joined the cluster at {args.join}")


# --------------------------------------------------------------------------- down, status
def down(args) -> None:
    """The worker hosts (over ssh), then every process of the cluster on this machine."""
    if args.this_node is not None:  # on a worker host, for the head's down.sh
        return stop_here(temp_dir(args.this_node), args.this_node, "this node's part of the cluster")
    state = State(args.state_dir)
    head = state.head()
    if head is None:
        print(f"cluster/down.sh: no cluster recorded in {state.dir}; nothing to stop")
        return
    for w in head["workers"]:
        remote(args, w["host"], script("down", "--this-node", str(head["gcs_port"])))
    stop_here(head["temp_dir"], head["gcs_port"], f"the cluster at {head['gcs']}")
    state.head_file.unlink(missing_ok=True)
    state.env_file.unlink(missing_ok=True)


def stop_here(tmp: str, gcs_port: int, what: str) -> None:
    print(f"cluster/down.sh: stopped {len(stop_cluster(tmp, gcs_port))} processes of {what}")


def stop_cluster(tmp: str, gcs_port: int, grace: float = 5.0) -> set[int]:
    """Stop every process of the cluster on this machine, scanning again until none is found
    (a component may still be starting while the others stop). Returns the PIDs stopped."""
    stopped: set[int] = set()
    for _ in range(5):
        pids = set(cluster_procs(tmp, gcs_port))
        if not pids:
            return stopped
        stop_pids(pids, grace)
        if left := alive(pids):
            raise ClusterError(f"processes {sorted(left)} of the cluster survived SIGKILL")
        stopped |= pids
    raise ClusterError(f"processes of the cluster keep starting: {sorted(cluster_procs(tmp, gcs_port))}")


def status(args) -> None:
    state = State(args.state_dir)
    head = state.head()
    if head is None:
        raise ClusterError(f"no cluster recorded in {state.dir} (cluster/up.sh starts one)")
    token = state.token.read_text()
    code = dashboard_status(head["dashboard"], token)
    if code != 200:
        raise ClusterError(f"the cluster in {state.dir} does not answer at {head['dashboard']} "
                           f"({'no answer' if code is None else f'HTTP {code}'}): cluster/down.sh, then cluster/up.sh")
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(state.token))
    from ray.util.state import list_nodes

    print(f"cluster {head['gcs']}, job server {head['dashboard']} (token auth"
          f"{', public' if head['public'] else ', 127.0.0.1 only'}), state {state.dir}")
    print(f"{'node':<18} {'state':<6} {'CPUs':>5} {'GPUs':>5}")
    for n in list_nodes(address=head["dashboard"]):
        res = n.resources_total or {}
        print(f"{n.node_ip:<18} {n.state:<6} {res.get('CPU', 0):>5g} {res.get('GPU', 0):>5g}")
    from miles.cluster.jobs import print_jobs

    print_jobs(head["dashboard"], dict(os.environ))


# --------------------------------------------------------------------------- command line
def default_state_dir() -> Path:
    return Path(os.environ.get("MILES_CLUSTER_DIR", Path.home() / ".miles" / "cluster"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="miles.cluster.bringup", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", type=Path, default=default_state_dir(),
                        help="the cluster's token, addresses and logs (default $MILES_CLUSTER_DIR or ~/.miles/cluster)")
    common.add_argument("--ssh", default="ssh -o BatchMode=yes", help="how to reach worker hosts (default: ssh)")
    u = sub.add_parser("up", parents=[common], prog="cluster/up.sh", help="start (or complete) the cluster")
    where = u.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true",
                       help="this machine only: node address and job server on 127.0.0.1 (Ray's own ports: the "
                            "README's Security)")
    where.add_argument("--hostfile", help="worker hosts, `host [ip]` per line, started over ssh")
    where.add_argument("--join", metavar="HEAD:PORT", help="join this machine to a cluster as a worker node")
    u.add_argument("--node-ip", help="this node's address in the cluster (default: its outside address)")
    u.add_argument("--port", type=int, default=6379, help="the GCS port (default 6379)")
    u.add_argument("--dashboard-port", type=int, default=8265, help="the job server's port (default 8265)")
    u.add_argument("--num-cpus", type=int, help="CPUs this node offers (default: all)")
    u.add_argument("--num-gpus", type=int, help="GPUs this node offers (default: all)")
    u.add_argument("--gpus-per-node", type=int, default=0, help="check every node has at least this many GPUs")
    u.add_argument("--shared", help="check this path (runs, checkpoints) is writable and the same on every node")
    u.add_argument("--env", help="a hardware preset of cluster/env/ (h100, h200, cpu) or a KEY=VALUE file")
    u.add_argument("--public", action="store_true", help="let the job server listen on every interface (warned)")
    sub.add_parser("down", parents=[common], prog="cluster/down.sh", help="stop the cluster").add_argument(
        "--this-node", type=int, metavar="GCS_PORT", help="stop only this machine's processes of the cluster with "
                                                          "this GCS port (what down.sh runs on worker hosts)")
    sub.add_parser("status", parents=[common], prog="cluster/status.sh", help="nodes, resources, jobs")
    sub.add_parser("fingerprint", help="this node's Python and package versions (JSON)")
    args = ap.parse_args(argv)
    try:
        if args.command == "fingerprint":
            print(json.dumps(fingerprint()))
        else:
            {"up": up, "down": down, "status": status}[args.command](args)
    except ClusterError as e:
        print(f"cluster/{args.command}.sh: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
