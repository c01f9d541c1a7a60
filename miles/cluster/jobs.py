"""Jobs on a Ray cluster, through Ray's job server: `miles submit`, `miles jobs`, `miles stop`,
`miles logs`.

A submission is `ray job submit` of `python -m miles.cli sft|rl|run JOB.yaml ...` with this
directory as the job's working_dir: uploaded to the cluster without .git, environments, runs,
checkpoints and data (EXCLUDES; Ray also leaves out what .gitignore names), so the job runs
this checkout's code against the cluster's Python. Runs and checkpoints go to log.run_dir and
ckpt.save_dir, which on a multi-node cluster belong on a filesystem every node shares.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

from miles.cluster.node import ray_bin

# gitignore patterns, relative to the working directory (a leading / anchors at its top).
EXCLUDES = ["/.git", "/.venv", "/venv", "/runs", "/checkpoints", "/data", "/wandb", "/.whl", "/.device",
            "__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".ruff_cache"]


AGENT_WAIT_S = 60.0  # how long a fresh cluster may take to accept jobs


class SubmitError(RuntimeError):
    """The job cannot be submitted as asked; the message says why."""


def job_id(name: str) -> str:
    return f"miles-{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


# Job keys naming files or directories the job reads, and the one it writes (log.run_dir is
# made absolute by `miles submit` itself).
INPUT_KEYS = ("model.config", "data.path", "data.eval_path", "data.tokenizer", "ckpt.hf", "ckpt.load")
OUTPUT_KEYS = ("ckpt.save_dir",)


def path_overrides(job, working_dir: Path) -> list[str]:
    """KEY=VALUE for each path the validated job names, as seen from here. An input inside
    what is uploaded stays relative to the working directory (it travels with the job); any
    other path becomes absolute, outputs always (the uploaded copy is discarded). The job runs
    in that copy, so a relative path into runs/, checkpoints/ or data/ (never uploaded) would
    name nothing there, e.g. `make demo`'s `ckpt.hf=runs/<sft>/hf`. On a multi-node cluster
    such paths must be on a filesystem every node shares."""
    root = working_dir.resolve()
    not_uploaded = {e.strip("/") for e in EXCLUDES if e.startswith("/")}
    out = []
    for key in INPUT_KEYS + OUTPUT_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(job, section), name)
        if value is None or (key, str(value)) in (("ckpt.load", "auto"), ("data.tokenizer", "tiny")):
            continue
        path = Path(os.path.abspath(value))
        rel = path.relative_to(root) if path.is_relative_to(root) else None
        uploaded = key in INPUT_KEYS and rel is not None and rel.parts and rel.parts[0] not in not_uploaded
        out.append(f"{key}={rel if uploaded else path}")
    return out


def entrypoint(command: str, job_file: Path, overrides: list[str], run_dir: str, report: bool,
               working_dir: Path, paths: list[str] = ()) -> list[str]:
    """The job's command on the cluster, run in the uploaded working directory; `paths`
    (path_overrides) replace the user's overrides of the same keys."""
    try:
        rel = job_file.resolve().relative_to(working_dir.resolve())
    except ValueError:
        raise SubmitError(f"{job_file} is outside {working_dir}, the directory uploaded to the cluster: put the "
                          "job file under it (or submit from a directory that holds it)") from None
    resolved = {"log.run_dir", *(p.split("=", 1)[0] for p in paths)}
    kept = [o for o in overrides if o.split("=", 1)[0] not in resolved]  # replaced by the resolved ones
    return ["python", "-m", "miles.cli", command, str(rel), *kept, *paths, f"log.run_dir={run_dir}",
            *(["--report"] if report else [])]


def submit(address: str, env: dict[str, str], jid: str, command: list[str], working_dir: Path,
           metadata: dict[str, str], excludes: list[str] = EXCLUDES) -> None:
    runtime_env = {"working_dir": str(working_dir), "excludes": excludes}
    cmd = [ray_bin(), "job", "submit", "--address", address, "--submission-id", jid, "--no-wait",
           "--runtime-env-json", json.dumps(runtime_env), "--metadata-json", json.dumps(metadata), "--", *command]
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        # A cluster that has just started may answer before its job agent has registered; Ray
        # says "try again later", and the same submission id cannot start the job twice.
        if p.returncode == 0 or "No available agent" not in p.stdout + p.stderr or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if p.returncode != 0:
        raise SubmitError(f"`ray job submit` to {address} failed (exit {p.returncode}):\n"
                          + explain((p.stdout + p.stderr)[-3000:]))


def explain(output: str) -> str:
    """Ray's output, with the fix for the failures users meet most."""
    hints = [("Authentication required", "the cluster wants its token: source <state dir>/cluster.env (or set "
                                         "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<token file>)"),
             ("Connection refused", "no job server at that address: cluster/status.sh, or --address"),
             ("exceeds the maximum size", "the upload is too big: move large files out of the working directory "
                                          "or list them in .rayignore")]
    return output + "".join(f"\nhint: {fix}" for needle, fix in hints if needle in output)


# Ray's own lines at the head of every job's log (its job manager setting the job up)
RAY_SETUP = re.compile(r"^\S+ \S+\s+INFO job_manager\.py:\d+ -- Runtime env is setting up\.$"
                       r"|^Running entrypoint for job ")


def follow(address: str, env: dict[str, str], jid: str) -> None:
    """Stream the job's output until it ends (Ctrl-C stops following, not the job), line by
    line also into a pipe (`miles submit ... | tee`). The job's lines alone: not Ray's set-up
    lines nor its CLI's banners (colored, timestamped before the lines they follow)."""
    import asyncio
    import logging

    c = client(address, env)
    logging.getLogger(type(c).__module__).setLevel(logging.WARNING)  # its "WebSocket closed ..." at the end

    async def tail() -> None:
        rest = ""
        async for chunk in c.tail_job_logs(jid):
            *lines, rest = (rest + chunk).split("\n")
            for line in lines:
                if not RAY_SETUP.match(line):
                    print(line, flush=True)
        if rest and not RAY_SETUP.match(rest):
            print(rest, flush=True)

    sys.stdout.flush()
    asyncio.run(tail())


def client(address: str, env: dict[str, str]):
    """Ray's job SDK for the cluster at `address`, authenticated with the token `env` names
    (RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH). The token goes in the request header:
    Ray's own loader reads it once per process, so a process that talks to two clusters (or
    outlives one) would send a stale token, and this process's environment stays untouched."""
    from ray.job_submission import JobSubmissionClient

    token = env.get("RAY_AUTH_TOKEN")
    if token is None and env.get("RAY_AUTH_TOKEN_PATH"):
        try:
            token = Path(env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        except OSError as e:
            raise SubmitError(f"cannot read the cluster's token {env['RAY_AUTH_TOKEN_PATH']}: {e.strerror}") from None
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except Exception as e:  # connection refused, 401, ...: Ray raises plain exceptions
        raise SubmitError(explain(f"cannot reach the job server at {address}: {e}")) from None


def status(address: str, env: dict[str, str], jid: str) -> str:
    """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    return client(address, env).get_job_status(jid).value


def why(address: str, env: dict[str, str], jid: str) -> str:
    """Ray's message on how the job ended (a failed runtime environment, the entrypoint's exit
    code): not part of the job's log."""
    return client(address, env).get_job_info(jid).message or ""


def stop(address: str, env: dict[str, str], jid: str, timeout: float = 120.0) -> str:
    """Ray's stop: SIGTERM to the job's processes (the driver unwinds: actors, engines and
    router stopped), SIGKILL after the cluster's stop window. Waits until the job has ended;
    returns its final status."""
    c = client(address, env)
    c.stop_job(jid)
    deadline = time.monotonic() + timeout
    while (st := c.get_job_status(jid).value) in ("PENDING", "RUNNING"):
        if time.monotonic() > deadline:
            raise SubmitError(f"job {jid} still {st} {timeout:.0f} s after it was asked to stop")
        time.sleep(0.5)
    return st


def logs(address: str, env: dict[str, str], jid: str) -> str:
    return client(address, env).get_job_logs(jid)


def print_jobs(address: str, env: dict[str, str], out=sys.stdout) -> None:
    """The cluster's jobs, newest last: id, status, the miles job's name and run directory."""
    jobs = sorted(client(address, env).list_jobs(), key=lambda j: j.start_time or 0)
    if not jobs:
        print("no jobs", file=out)
        return
    print(f"{'job id':<44} {'status':<10} {'started':<19} {'name':<20} run directory", file=out)
    for j in jobs:
        meta = j.metadata or {}
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.start_time / 1000)) if j.start_time else ""
        print(f"{j.submission_id or j.job_id:<44} {j.status.value:<10} {started:<19} {meta.get('miles_job', ''):<20} "
              f"{meta.get('run_dir', '')}", file=out)
