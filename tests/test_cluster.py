"""cluster/up.sh, status.sh, down.sh and `miles submit | jobs | logs | stop` against a real Ray
cluster the scripts start: a head (`up.sh --local`) plus a second node on this machine
(`up.sh --join`, loopback address 127.0.0.2, its own CPUs), token auth on. A DP=2 SFT job spans
both nodes; it is followed, detached with Ctrl-C, stopped, and continued with ckpt.load=auto.
At the end down.sh must leave no process of the cluster (PIDs compared)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from miles.cluster import bringup  # noqa: E402
from miles.cluster.node import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# sft_tiny shortened: 8 steps of DP=2 (2 CPUs per worker: one rank per 2-CPU node), a checkpoint
# every 4 steps, no evaluation.
FLOW = ["train.steps=8", "train.optim.warmup_steps=1", "data.eval_interval=0", "ckpt.save_interval=4",
        "ckpt.save_hf=false", "train.parallel.dp=2", "cluster.cpus_per_worker=2", "log.interval=1",
        "log.wandb.mode=offline"]
# The detach test interrupts `miles submit` once step 5 is logged and stops the job before step
# 8 (its driver held meanwhile), on 64 conversations a step (~4 s here).
DETACH_FLOW = [*FLOW, "train.global_batch_size=64"]


def _step_logged(run: Path, step: int) -> bool:
    path = run / "metrics.jsonl"
    return path.is_file() and any(json.loads(x)["step"] >= step for x in path.read_text().splitlines() if x.strip())


def sh(*cmd: str, env=None, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def family(roots: set[int]) -> set[int]:
    """`roots` and every live descendant of them (by the parent in /proc/<pid>/stat)."""
    parent = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                parent[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    out = set(roots)
    while more := {p for p, pp in parent.items() if pp in out} - out:
        out |= more
    return out


def ray_processes(token: Path | None = None) -> set[int]:
    """Every live process of any Ray cluster on this machine (and routers), by PID; with
    `token`, only those that inherited RAY_AUTH_TOKEN_PATH=token from the `ray start` of
    up.sh's cluster (most of its processes; not those that clear their environment)."""
    mark = f"RAY_AUTH_TOKEN_PATH={token}\0".encode() if token else None
    out = set()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and re.search(r"ray::|raylet|gcs_server|/ray/|miles-ray|sglang::", cmd):
            try:
                if mark is None or mark in Path(f"/proc/{p}/environ").read_bytes():
                    out.add(int(p))
            except OSError:
                continue
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("cluster")
    port, dash = free_ports(2)
    before = ray_processes()
    common = ["--state-dir", str(state)]
    up = sh("cluster/up.sh", "--local", "--port", str(port), "--dashboard-port", str(dash), "--num-cpus", "2",
            *common)
    join = sh("cluster/up.sh", "--join", f"127.0.0.1:{port}", "--node-ip", "127.0.0.2", "--num-cpus", "2", *common)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    for line in (state / "cluster.env").read_text().splitlines():
        if line.startswith("export "):
            k, v = line[len("export "):].split("=", 1)
            env[k] = v
    info = {"state": state, "port": port, "dash": dash, "env": env, "before": before, "up": up.stdout + join.stdout,
            "common": common}
    try:
        yield info
    finally:
        sh("cluster/down.sh", *common, check=False)  # the last test checks it; this only cleans up


def miles(*args: str, env, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    return sh(sys.executable, "-m", "miles.cli", *args, env=env, check=check, timeout=timeout)


def test_up_starts_a_token_auth_head_idempotently_and_a_second_node(cluster):
    """up.sh --local: a head whose job server answers only on 127.0.0.1 and only with the token
    (a token file 0600, clients configured by cluster.env); up.sh and --join run again change
    nothing; status.sh lists both nodes with their CPUs."""
    state, dash = cluster["state"], cluster["dash"]
    token = state / "token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    env_file = (state / "cluster.env").read_text()
    assert f"RAY_ADDRESS=http://127.0.0.1:{dash}" in env_file and "RAY_AUTH_MODE=token" in env_file
    assert f"RAY_AUTH_TOKEN_PATH={token}" in env_file and token.read_text() not in env_file
    url = f"http://127.0.0.1:{dash}"
    assert bringup.dashboard_status(url, token.read_text()) == 200
    assert bringup.dashboard_status(url, None) == 401  # no token
    assert bringup.dashboard_status(url, "0" * 64) == 403  # a wrong one
    with socket.socket() as s:  # not on the outside address
        s.settimeout(2)
        assert s.connect_ex((bringup.outside_address(), dash)) != 0
    again = sh("cluster/up.sh", "--local", "--port", str(cluster["port"]), "--dashboard-port", str(dash),
               *cluster["common"]).stdout
    assert "is up" in again and "nothing to start" in again
    join = sh("cluster/up.sh", "--join", f"127.0.0.1:{cluster['port']}", "--node-ip", "127.0.0.2",
              *cluster["common"]).stdout
    assert "already in the cluster" in join
    status = sh("cluster/status.sh", *cluster["common"]).stdout
    nodes = re.findall(r"^(\S+)\s+ALIVE\s+(\S+)\s+(\S+)$", status, re.M)
    assert len(nodes) == 2 and "127.0.0.2" in {n[0] for n in nodes} and {n[1] for n in nodes} == {"2"}, status
    assert "token auth, 127.0.0.1 only" in status


def listening(pids: set[int]) -> list[tuple[str, int, str]]:
    """(address, port, command) of every TCP socket the processes `pids` listen on."""
    import ipaddress

    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                hexaddr, hexport = f[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                found[f[9]] = (str(ipaddress.ip_address(raw)), int(hexport, 16))
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in found:
                out.append((*found[target[8:-1]], cmd))
    return sorted(set(out))


# What Ray 2.60 listens on beyond loopback whatever --node-ip-address says: gRPC servers (GCS,
# raylets, agents) on every interface, the agents' HTTP and the Ray Client server on the
# machine's outside address, Prometheus metrics on 0.0.0.0. The README's security paragraph
# says so; the token guards all but the metrics.
RAY_EXPOSED = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray.util.client.server",
               "dashboard/dashboard.py", "autoscaler/_private/monitor.py")


def test_what_a_local_cluster_listens_on_beyond_loopback(cluster):
    """cluster/up.sh --local ("this machine only"): the job server and dashboard listen on
    127.0.0.1 alone; what listens beyond loopback is Ray's own (RAY_EXPOSED, no miles process),
    and each of those that speaks HTTP refuses a request without the token (401) or serves
    Prometheus metrics only. The GCS port is among what is found (the listing works)."""
    import ipaddress

    import httpx

    procs = bringup.cluster_procs(bringup.temp_dir(cluster["port"]), cluster["port"])
    socks = listening(set(procs))
    print("\n".join(f"{a:>16} {p:<6} {c[:100]}" for a, p, c in socks))
    assert any(p == cluster["port"] for _, p, _ in socks), "the GCS port is not among the listeners found"
    dashboard = [a for a, p, _ in socks if p == cluster["dash"]]
    assert dashboard and set(dashboard) == {"127.0.0.1"}, dashboard
    ips = [(ipaddress.ip_address(a), p, c) for a, p, c in socks]
    ips = [(getattr(ip, "ipv4_mapped", None) or ip, p, c) for ip, p, c in ips]  # ::ffff:a.b.c.d -> a.b.c.d
    outside = [(ip, p, c) for ip, p, c in ips if not ip.is_loopback]
    unexpected = [(str(ip), p, c) for ip, p, c in outside if not any(name in c for name in RAY_EXPOSED)]
    assert not unexpected, f"listening beyond loopback: {unexpected}"
    for ip, port, cmd in outside:
        host = "127.0.0.1" if ip.is_unspecified else (f"[{ip}]" if ip.version == 6 else str(ip))
        try:
            r = httpx.get(f"http://{host}:{port}/", timeout=5)
        except httpx.HTTPError:
            continue  # gRPC: not an HTTP/1.1 server
        assert r.status_code == 401 or r.text.startswith("# HELP"), (str(ip), port, cmd[:60], r.status_code,
                                                                     r.text[:200])


def test_a_submission_without_the_token_is_refused(cluster):
    env = {k: v for k, v in cluster["env"].items() if not k.startswith("RAY_AUTH")}
    p = miles("submit", "jobs/sft_tiny.yaml", *FLOW, "--address", f"http://127.0.0.1:{cluster['dash']}", env=env,
              check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "hint: the cluster wants its token" in p.stderr
    assert "no jobs" in miles("jobs", env=cluster["env"]).stdout


BAD = [("unknown key", "train:\n  stepz: 3\n", "train.stepz: unknown key"),
       ("wrong type", "train:\n  steps: three\n", "train.steps: Input should be a valid integer"),
       ("missing dataset", "data:\n  source: chat\n  path: nowhere/x.jsonl\n",
        "data.path: nowhere/x.jsonl: no such file or directory")]


@pytest.mark.parametrize("what,text,expect", BAD, ids=[b[0] for b in BAD])
def test_a_bad_job_file_fails_at_submit_naming_the_field_before_any_upload(cluster, tmp_path, what, text, expect):
    job = ROOT / "jobs" / f".test_bad_{os.getpid()}.yaml"  # under the working directory, as a real one is
    job.write_text(text)
    try:
        p = miles("submit", str(job.relative_to(ROOT)), env=cluster["env"], check=False)
    finally:
        job.unlink()
    assert p.returncode == 2 and expect in p.stderr, p.stderr
    assert "submitted" not in p.stdout
    assert "no jobs" in miles("jobs", env=cluster["env"]).stdout  # nothing reached the cluster


def job_pids(cluster) -> set[int]:
    """The job's driver and its workers, among the cluster's processes."""
    procs = bringup.cluster_procs(bringup.temp_dir(cluster["port"]), cluster["port"])
    return {p for p, cmd in procs.items() if "miles.cli sft" in cmd or cmd.startswith("ray::TrainWorker")}


def _wait_signalled(pids: list[int], deadline: float) -> None:
    """Until each stopped process has a SIGTERM or SIGINT pending (or has gone)."""
    want = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                waiting.discard(pid)
                continue
            pending = [int(x.split()[1], 16) for x in status.splitlines() if x.startswith(("SigPnd", "ShdPnd"))]
            if any(mask & want for mask in pending):
                waiting.discard(pid)
        time.sleep(0.01)
    assert not waiting, f"`miles stop` never signalled the driver {waiting}"


def test_a_dp2_job_spans_both_nodes_detaches_stops_cleanly_and_continues(cluster, tmp_path):
    """`miles submit` (from $RAY_ADDRESS) of a DP=2 job: one rank on each node; its output
    streams until Ctrl-C, which leaves it RUNNING; `miles logs` reads it; the upload holds the
    code and not .git, .venv or runs (and stays small); `miles stop` ends it STOPPED with its
    driver and workers gone, the driver having unwound; resubmitted with ckpt.load=auto it
    continues from the last checkpoint and its first step repeats the stopped run's bit for bit."""
    env, run = cluster["env"], tmp_path / "run"
    # As from a terminal: Ctrl-C's default action. (An ignored SIGINT is inherited through exec, and
    # Python then never raises KeyboardInterrupt: in the full suite something before this module
    # leaves SIGINT ignored in the pytest process, and the job ran to its end.)
    p = subprocess.Popen([sys.executable, "-m", "miles.cli", "submit", "jobs/sft_tiny.yaml", *DETACH_FLOW,
                          f"log.run_dir={run}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # Ctrl-C once the run directory shows step 5 (not when the streamed line arrives: the test
    # should not depend on how fast Ray's log stream delivers).
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(p.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not _step_logged(run, 5) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    # The driver is held (SIGSTOP) from here until `miles stop` has signalled it: on a fast host
    # the job would otherwise finish its 8 steps during the checks below (seen on a GPU host).
    drivers = [pid for pid, cmd in bringup.cluster_procs(bringup.temp_dir(cluster["port"]), cluster["port"]).items()
               if "miles.cli sft" in cmd]
    assert drivers, "no driver process found"
    for pid in drivers:
        os.kill(pid, signal.SIGSTOP)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    reader.join(timeout=60)
    out_all = "".join(seen)
    assert p.returncode == 130 and "keeps running" in out_all, out_all[-3000:]
    jid = re.search(r"submitted to \S+ as (\S+);", out_all)[1]
    listed = miles("jobs", env=env).stdout
    assert re.search(rf"^{re.escape(jid)}\s+RUNNING\s+.*sft_tiny\s+{re.escape(str(run))}$", listed, re.M), listed
    logged = miles("logs", jid, env=env).stdout
    assert "step     1/8" in logged
    assert re.search(r"on 2 nodes \((127\.0\.0\.2, \S+|\S+, 127\.0\.0\.2)\)", logged), logged[-3000:]

    pkgs = [d for d in (Path(bringup.temp_dir(cluster["port"])) / "session_latest" / "runtime_resources" /
                        "working_dir_files").glob("_ray_pkg_*") if d.is_dir()]
    assert len(pkgs) == 1
    files = [f for f in pkgs[0].rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    tops = {f.relative_to(pkgs[0]).parts[0] for f in files}
    assert {"miles", "plugins", "jobs", "cluster"} <= tops and not tops & {".git", ".venv", "runs"}, tops
    assert size < 8 << 20, f"uploaded {size / 2**20:.1f} MiB"  # about 3 MiB: code, docs and bundled data

    running = job_pids(cluster)
    assert len(running) >= 3, running  # the driver and two workers
    stop = subprocess.Popen([sys.executable, "-m", "miles.cli", "stop", jid], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_signalled(drivers, deadline=time.monotonic() + 120)  # the SIGTERM waits until the driver runs on
    for pid in drivers:
        os.kill(pid, signal.SIGCONT)
    assert stop.communicate(timeout=180)[0].strip().endswith("STOPPED")
    assert not bringup.alive(running), f"left behind: {bringup.alive(running)}"
    out = miles("logs", jid, env=env).stdout
    assert "the workers, engines and router are stopped" in out, out[-2000:]

    steps = {int(m[1]): m[2] for m in re.finditer(r"^step +(\d+)/8  loss (\S+)", out, re.M)}
    p = miles("submit", "jobs/sft_tiny.yaml", *DETACH_FLOW, f"log.run_dir={run}", "ckpt.load=auto", env=env)
    assert "SUCCEEDED" in p.stdout
    # Saved after steps 1 (warm-up save) and 4; stopped after step 5 was printed, before 8.
    assert "checkpoint: resumed from" in p.stdout and "iter_0000004" in p.stdout and "next step 5" in p.stdout
    again = {int(m[1]): m[2] for m in re.finditer(r"^step +(\d+)/8  loss (\S+)", p.stdout, re.M)}
    assert sorted(again) == [5, 6, 7, 8] and again[5] == steps[5], (steps, again)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(9))
    assert all(math.isfinite(v) for r in recs for v in r.values())


ON_SECOND_NODE = """
import json, sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from miles.rollout.embedded import EmbeddedEngine
from miles.train.worker import TrainWorker
from plugins.deepseek_v4.config import DeepSeekV4Config
ray.init(address=sys.argv[1], log_to_driver=False)
(second,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == "127.0.0.2"]
there = NodeAffinitySchedulingStrategy(second, soft=False)
worker = ray.remote(TrainWorker).options(num_cpus=1, scheduling_strategy=there).remote(0, 1)
spec = {"config": DeepSeekV4Config.tiny().to_dict(), "seed": 0, "max_running": 2, "max_len": 32}
engine = ray.remote(EmbeddedEngine).options(num_cpus=1, scheduling_strategy=there).remote(spec)
print(json.dumps({"rendezvous": ray.get(worker.rendezvous_address.remote()), "engine": ray.get(engine.url.remote())}))
ray.get(engine.shutdown.remote())
"""


def test_servers_listen_on_their_nodes_address_when_there_are_several(cluster):
    """With two nodes, rank 0's rendezvous and an engine's HTTP server on the second node use
    that node's address (127.0.0.2), where the other node reaches them; 127.0.0.1 there (the
    old rendezvous) would be another machine's loopback on a real cluster. (A process of its
    own: Ray reads the token settings when it is imported.)"""
    out = sh(sys.executable, "-c", ON_SECOND_NODE, f"127.0.0.1:{cluster['port']}", env=cluster["env"]).stdout
    got = json.loads(out.strip().splitlines()[-1])
    host, port = got["rendezvous"]
    assert host == "127.0.0.2" and port > 0, got
    assert got["engine"].startswith("http://127.0.0.2:"), got


def test_a_second_cluster_on_the_machine_accepts_jobs(cluster):
    """`make demo` (a local cluster per job) beside this one: Ray's fixed default ports (the
    dashboard agent's 52365) would leave the second job server with no agent to run jobs."""
    import time

    from miles.cluster import jobs
    from miles.cluster.local import local_cluster

    with local_cluster(2, log=lambda _: None) as other:
        # its processes carry its own mark, its temp dir (on the GCS's command line too)
        port = other.gcs.rsplit(":", 1)[1]
        (gcs,) = [p for p in ray_processes() if f"--gcs_server_port={port}\0" in Path(f"/proc/{p}/cmdline").read_text()]
        env = dict(x.split("=", 1) for x in Path(f"/proc/{gcs}/environ").read_text().split("\0") if "=" in x)
        assert env[bringup.CLUSTER_MARK] in Path(f"/proc/{gcs}/cmdline").read_text(), env.get(bringup.CLUSTER_MARK)
        jid = jobs.job_id("probe")
        jobs.submit(other.address, other.env, jid, ["python", "-c", "print('probe ran')"], ROOT, {})
        deadline = time.monotonic() + 60
        while (st := jobs.status(other.address, other.env, jid)) in ("PENDING", "RUNNING"):
            assert time.monotonic() < deadline, st
            time.sleep(0.5)
        assert st == "SUCCEEDED" and "probe ran" in jobs.logs(other.address, other.env, jid)


def test_down_leaves_no_process_of_the_cluster(cluster):
    """down.sh stops the head, the second node and everything under them (their processes found
    by the cluster's temp dir and GCS address, and their descendants); no Ray process is left
    of the cluster as found independently of down.sh (the Ray processes carrying its token path,
    and their descendants: the dashboard's forkserver children drop the environment), nor a new
    one with its token path; a second down.sh has nothing to stop. (Not "no new Ray process on
    the machine": under `pytest -n 2` another worker's clusters come and go meanwhile.)"""
    ours = set(bringup.cluster_procs(bringup.temp_dir(cluster["port"]), cluster["port"]))
    assert len(ours) > 10  # two raylets, the GCS, the dashboard, agents, workers
    # both nodes' `ray start` gave their processes the mark (down.sh finds orphans by it)
    mark = f"{bringup.CLUSTER_MARK}={bringup.temp_dir(cluster['port'])}\0".encode()
    raylets = {p for p in ours if "raylet/raylet" in Path(f"/proc/{p}/cmdline").read_text()}
    assert len(raylets) == 2 and all(mark in Path(f"/proc/{p}/environ").read_bytes() for p in raylets), raylets
    token = cluster["state"] / "token"
    mine = family(ray_processes(token))  # this cluster's, found by environment and ancestry
    assert ours & ray_processes() <= mine, "a process of the cluster the check below would not see"
    out = sh("cluster/down.sh", *cluster["common"]).stdout
    assert out.startswith("cluster/down.sh: stopped ")
    assert not bringup.alive(ours)
    left = bringup.alive(mine) | (ray_processes(token) - cluster["before"])
    assert not left, {p: Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in left}
    assert "nothing to stop" in sh("cluster/down.sh", *cluster["common"]).stdout
    assert not (cluster["state"] / "cluster.env").exists() and (cluster["state"] / "token").exists()


# --------------------------------------------------------------------------- preflight, without a cluster
def test_preflight_names_what_is_wrong(tmp_path):
    """Each check up.sh makes before starting anything fails with the flag or host and the fix."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(bringup.ClusterError, match=rf"--port {taken}: in use on 127.0.0.1 .*--port N"):
            bringup.check_port_free("127.0.0.1", taken, "--port")
    here = bringup.fingerprint()
    assert set(here) == {"python", *bringup.PACKAGES} and here["miles"] != "not installed"
    with pytest.raises(bringup.ClusterError, match=r"gpu-2 differs .*\n  torch: 2.0.0 on gpu-2, .* here"):
        bringup.compare_versions(here, {**here, "torch": "2.0.0"}, "gpu-2")
    bringup.compare_versions(here, dict(here), "gpu-3")
    hosts = tmp_path / "hosts"
    hosts.write_text("# workers\ngpu-2\ngpu-3 10.0.0.3  # by address\n")
    assert bringup.read_hostfile(hosts) == [("gpu-2", "gpu-2"), ("gpu-3", "10.0.0.3")]
    hosts.write_text("gpu-2 10.0.0.2 extra\n")
    with pytest.raises(bringup.ClusterError, match=r"hosts:1: expected `host \[ip\]`"):
        bringup.read_hostfile(hosts)
    assert bringup.read_preset("h100")["NCCL_NVLS_ENABLE"] == "0"
    with pytest.raises(bringup.ClusterError, match=r"--env a100: no preset .* \(presets: cpu, h100, h200\)"):
        bringup.read_preset("a100")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(bringup.ClusterError, match=r"--shared .*a_file/runs: not writable"):
        bringup.check_shared(tmp_path / "a_file" / "runs")
    assert bringup.check_shared(tmp_path / "runs").startswith(".miles-shared-check-")


def test_submit_names_paths_as_the_job_finds_them_in_its_upload(tmp_path, monkeypatch):
    """A submitted job runs in the uploaded copy of the working directory, which has no runs/,
    checkpoints/ or data/: `make demo`'s second stage, `miles submit jobs/dapo_tiny.yaml
    ckpt.hf=runs/<sft>/hf`, failed there ("no config.json"). The entrypoint keeps inputs inside
    the upload relative and makes inputs outside it and outputs absolute, after the user's
    overrides; loaded in a copy of the upload it names the same files as here."""
    import shutil

    from miles.cluster import jobs
    from miles.config import load_job

    here = tmp_path.resolve() / "checkout"
    (here / "jobs").mkdir(parents=True)
    shutil.copy(ROOT / "jobs" / "dapo_tiny.yaml", here / "jobs")
    (here / "prompts").mkdir()
    shutil.copy(ROOT / "miles" / "data" / "bundled" / "arith" / "train.jsonl", here / "prompts")
    (here / "runs" / "sft" / "hf").mkdir(parents=True)
    (here / "runs" / "sft" / "hf" / "config.json").write_text(  # the SFT run's model, as make demo's
        json.dumps(load_job(ROOT / "jobs" / "dapo_tiny.yaml").model.arch.to_dict()))
    outside = ROOT / "miles" / "data" / "bundled" / "arith" / "eval.jsonl"
    monkeypatch.chdir(here)
    given = ["data.path=prompts/train.jsonl", f"data.eval_path={outside}", "ckpt.hf=runs/sft/hf",
             "ckpt.save_dir=ckpts", "ckpt.load=auto"]
    job = load_job("jobs/dapo_tiny.yaml", given)
    paths = jobs.path_overrides(job, here)
    assert paths == ["data.path=prompts/train.jsonl", f"data.eval_path={outside}", f"ckpt.hf={here}/runs/sft/hf",
                     f"ckpt.save_dir={here}/ckpts"], paths
    entry = jobs.entrypoint("rl", Path("jobs/dapo_tiny.yaml"), given, "/runs/x", False, here, paths)
    assert entry[:5] == ["python", "-m", "miles.cli", "rl", "jobs/dapo_tiny.yaml"]
    assert entry[5:-1] == ["ckpt.load=auto", *paths], entry  # each path once, as resolved here
    assert entry[-1] == "log.run_dir=/runs/x"
    without = jobs.entrypoint("rl", Path("jobs/dapo_tiny.yaml"), given, "/runs/x", False, here)  # as before

    upload = tmp_path.resolve() / "upload"  # what the cluster unpacks: runs/ left out
    shutil.copytree(here, upload, ignore=shutil.ignore_patterns("runs"))
    monkeypatch.chdir(upload)
    there = load_job(entry[4], entry[5:])
    assert there.ckpt.hf == here / "runs" / "sft" / "hf" and there.ckpt.save_dir == here / "ckpts"
    assert (there.data.path, there.data.eval_path) == (str(upload / "prompts" / "train.jsonl"), str(outside))
    with pytest.raises(ValueError, match="ckpt.hf: runs/sft/hf: not an HF checkpoint directory"):
        load_job(without[4], without[5:])


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        p = sh("cluster/up.sh", "--local", "--port", str(s.getsockname()[1]), "--state-dir", str(tmp_path), check=False)
    assert p.returncode == 1 and "in use on 127.0.0.1" in p.stderr
    assert not (tmp_path / "head.json").exists() and not (tmp_path / "token").exists()


def test_jobs_submit_sh_is_miles_submit(tmp_path):
    p = sh("jobs/submit.sh", "--help")
    assert "usage: miles submit" in p.stdout and "--no-wait" in p.stdout


ORPHAN = """
import os, sys, time
if os.fork():  # the parent exits: the child is reparented, as a dying dashboard leaves its forkserver
    os._exit(0)
print(os.getpid(), flush=True)
os.close(1)  # the caller reads to the end of the pipe
time.sleep(120)
"""


def test_down_finds_an_orphan_of_the_cluster_by_its_environment(tmp_path):
    """A process `ray start` launched (its mark in the environment) whose command line names
    neither the cluster's temp dir nor its GCS, and whose parent has exited, is still the
    cluster's: the dashboard's forkserver, restarted while the dashboard was stopping, was left
    running this way by down.sh in CI. Another cluster's mark is not this one's, nor a variable
    whose name or value merely ends with it."""
    (port,) = free_ports(1)
    tmp, other = str(tmp_path / "ours"), str(tmp_path / "other")
    envs = [bringup.marked(dict(os.environ), tmp), bringup.marked(dict(os.environ), other),
            dict(os.environ, X=f"{bringup.CLUSTER_MARK}={tmp}"), dict(os.environ, **{f"X{bringup.CLUSTER_MARK}": tmp})]
    runs = [int(subprocess.run([sys.executable, "-c", ORPHAN], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, timeout=60).stdout.split()[0]) for env in envs]
    try:
        orphan, *not_ours = runs
        assert Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1] != str(os.getpid())
        found = bringup.cluster_procs(tmp, port)
        assert orphan in found and not set(not_ours) & set(found), (runs, found)
        assert bringup.stop_cluster(tmp, port, grace=1.0) == {orphan}
        assert not bringup.alive({orphan}) and bringup.alive(set(not_ours)) == set(not_ours)
    finally:
        bringup.stop_pids(set(runs), grace=0.0)


def test_free_ports_are_distinct_and_avoid_the_ports_given_out():
    """Every port a cluster's `ray start` is given is picked in one free_ports call (or kept
    out by `avoid`): one free_port() at a time, the OS handed a head the same port for its GCS
    and its client server, and it refused to start. 500 picks from ~12k ports would repeat one
    with probability ~99% if the sockets were closed in between. The picks lie below the OS's
    ephemeral range, where no outgoing connection takes them before the server binds them."""
    from miles.cluster.node import PICK_FROM, _ephemeral_low

    ports = free_ports(500)
    assert len(set(ports)) == 500 and all(PICK_FROM <= p < _ephemeral_low() for p in ports)
    taken = tuple(free_ports(2))
    assert not set(free_ports(300, avoid=taken)) & set(taken)
    flags = bringup.own_ports("127.0.0.1", taken)
    own = [int(f.rsplit("=", 1)[1]) for f in flags]
    assert len(set(own)) == 2 and not set(own) & set(taken), flags


def test_a_local_head_whose_port_was_taken_starts_again_on_new_ports(monkeypatch):
    """A port free when picked can be bound by another process before Ray binds it (under
    `pytest -n 2` a local head's dashboard port was): `ray start` exits naming the port, and
    local_cluster starts the head again on a new pick. Forced here: the first pick's dashboard
    port is one this test listens on."""
    from miles.cluster import local

    picks, pick = [], local.free_ports

    def racing(n, *args, **kwargs):
        ports = pick(n, *args, **kwargs)
        picks.append(ports if picks else [ports[0], taken])
        return picks[-1]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        monkeypatch.setattr(local, "free_ports", racing)
        with local.local_cluster(1, log=lambda _: None) as c:
            assert len(picks) == 2 and c.address == f"http://127.0.0.1:{picks[1][1]}", (picks, c.address)
