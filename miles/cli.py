"""`miles` command line: parse, validate, hand over. Every command has --help.

    miles run JOB.yaml [KEY=VALUE ...]     run a job (the controller, in this process; RL jobs too)
    miles sft JOB.yaml [KEY=VALUE ...]     the same, for SFT jobs (data.source: chat)
    miles rl JOB.yaml [KEY=VALUE ...]      an RL job (DAPO / GRPO: data.source: prompts, algo.loss: policy)
    miles submit JOB.yaml [KEY=VALUE ...]  submit a job with `ray job submit` (to --address or
                                           $RAY_ADDRESS, or to a local cluster started for it)
    miles jobs | stop ID | logs ID         the cluster's jobs; stop one; its output
    miles report RUN_DIR                   PNG plots of a run's logged curves
    miles check-alignment RUN_A RUN_B      compare two runs' loss and gradient checksums
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

RUN_EPILOG = """\
overrides are dotted KEY=VALUE pairs applied on top of the job file, values read as YAML:
  miles run jobs/demo_tiny.yaml train.steps=20 train.optim.lr=1e-3 log.wandb.mode=disabled

The job runs against a Ray cluster: --address (or cluster.address, or $RAY_ADDRESS), else a
local one started for the job on 127.0.0.1. Everything the run writes goes to log.run_dir
(default runs/<name>-<time>): config.yaml, metrics.jsonl, the wandb run, plots, and failed.txt
saying why when the job fails.
exit status: 0 done, 1 the job failed, 2 the job file or an override is invalid."""


def wandb_note(job, run_dir: Path) -> str:
    """Where the run's wandb files are and, offline, how to look at them and upload them."""
    w = run_dir / "wandb"
    if job.log.wandb.mode == "offline" or not os.environ.get("WANDB_API_KEY"):
        return f"wandb run: {w} (offline; view it with `wandb leet {w}`, upload it with `wandb sync {w}/offline-run-*`)"
    return f"wandb run: {w} (online)"


EXAMPLE_JOB = {"run": "jobs/demo_tiny.yaml", "sft": "jobs/sft_tiny.yaml", "rl": "jobs/dapo_tiny.yaml"}


def _load(prog: str, job_path: str, overrides: list[str]):
    from miles.config import JobConfigError, load_job

    try:
        job = load_job(job_path, overrides)
    except JobConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for note in job.notes:
        print(f"{prog}: {note}", file=sys.stderr)
    return job


def _run(argv: list[str], command: str = "run") -> None:
    prog = f"miles {command}"
    what = {"sft": "an SFT job file (data.source: chat)", "rl": "an RL job file (data.source: prompts)"}.get(
        command, "a job file")
    example = EXAMPLE_JOB[command]  # one this command runs
    ap = argparse.ArgumentParser(prog=prog, description=f"Run {what} through the miles controller.",
                                 epilog=RUN_EPILOG.replace("miles run jobs/demo_tiny.yaml", f"{prog} {example}"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", help=f"a job file (YAML), e.g. {example}")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=20")
    ap.add_argument("--address", help="Ray cluster to run on (default: cluster.address, $RAY_ADDRESS, or local)")
    ap.add_argument("--check", action="store_true", help="validate the job and print it resolved; run nothing")
    ap.add_argument("--report", action="store_true", help="render the PNG plots when the run has finished")
    args = ap.parse_intermixed_args(argv)  # options anywhere among the overrides
    job = _load(prog, args.job, args.overrides)
    if command == "sft" and job.data.source != "chat":
        print(f"{prog}: {args.job}: data.source is {job.data.source}; SFT trains on conversations "
              "(data.source: chat). Use `miles run` for other jobs.", file=sys.stderr)
        raise SystemExit(2)
    if command == "rl" and job.data.source != "prompts":
        print(f"{prog}: {args.job}: data.source is {job.data.source}; use `miles run` or `miles sft` for this job",
              file=sys.stderr)
        raise SystemExit(2)
    if args.address:
        job.cluster.address = args.address  # taken as given (not read as YAML)
    if args.check:
        import yaml

        print(yaml.safe_dump(job.shown(), sort_keys=False), end="")
        return
    from miles.algo.rewards import RewardError
    from miles.algo.sampling import DynamicSamplingError
    from miles.ckpt.store import CheckpointError
    from miles.controller import run
    from miles.data.dataset import DataError
    from miles.observe import records
    from miles.rl.loop import run_rl
    from miles.rollout.manager import RolloutError
    from miles.rollout.weights import WeightSyncError
    from miles.session import JobError

    try:
        result = run_rl(job) if job.data.source == "prompts" else run(job)
    except (JobError, DataError, CheckpointError, DynamicSamplingError, RolloutError, WeightSyncError,
            RewardError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        records.record_failure(job.log.run_dir, f"{prog}: {e}")
        raise SystemExit(1) from None
    except Exception:  # unexpected: the traceback to the terminal and into the run directory
        import traceback

        records.record_failure(job.log.run_dir, traceback.format_exc())
        raise
    except KeyboardInterrupt as e:
        why = str(e) or "interrupted"
        print(f"{prog}: {why}; the workers, engines and router are stopped. Continue from the last checkpoint with "
              f"ckpt.load=auto log.run_dir={job.log.run_dir}", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"run directory: {result.run_dir}")
    if job.log.wandb.mode != "disabled":
        print(wandb_note(job, result.run_dir))
    if args.report:
        from miles.observe.report import render

        print(f"plots: {render(result.run_dir)[0].parent}")
    else:
        print(f"plots: miles report {result.run_dir}")


SUBMIT_EPILOG = """\
The job file is validated here first (a bad one fails with exit 2, nothing uploaded). Then
`ray job submit` runs `miles sft` (SFT jobs), `miles rl` (RL jobs) or `miles run` on the
cluster, with this directory uploaded as the job's working directory (no .git, environments,
runs, checkpoints or data). The cluster: --address, else $RAY_ADDRESS (what `source
~/.miles/cluster/cluster.env` sets after cluster/up.sh), else a local one (127.0.0.1, token
auth) started for this job and stopped after it. The run directory is fixed here
(log.run_dir) and printed. Without --no-wait the job's output streams here; Ctrl-C stops
following and leaves a cluster's job running (a local cluster stops, and its job with it).
exit status: 0 succeeded (or submitted, --no-wait), 1 failed or stopped, 2 invalid job file,
130 Ctrl-C."""


def _address(given: str | None) -> str | None:
    """The job server to use: --address, else $RAY_ADDRESS when it is one (http://...)."""
    import os

    env = os.environ.get("RAY_ADDRESS", "")
    return given or (env if env.startswith(("http://", "https://")) else None)


def _submit(argv: list[str]) -> None:
    import os
    import shlex
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="miles submit", description="Submit a job with `ray job submit`.",
                                 epilog=SUBMIT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", help="a job file (YAML) under this directory, e.g. jobs/sft_tiny.yaml")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=20")
    ap.add_argument("--address", help="the cluster's job server, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS, "
                                      "else a local cluster started for this job)")
    ap.add_argument("--no-wait", action="store_true", help="submit, print the job id and how to follow it, return")
    ap.add_argument("--report", action="store_true", help="render the PNG plots when the run has finished")
    args = ap.parse_intermixed_args(argv)  # options anywhere among the overrides
    job = _load("miles submit", args.job, args.overrides)
    from miles.cluster import jobs
    from miles.cluster.local import local_cluster

    run_dir = os.path.abspath(job.log.run_dir)
    command = {"chat": "sft", "prompts": "rl"}.get(job.data.source, "run")
    workdir = Path.cwd()
    try:
        entry = jobs.entrypoint(command, Path(args.job), args.overrides, run_dir, args.report, workdir,
                                jobs.path_overrides(job, workdir))
    except jobs.SubmitError as e:
        print(f"miles submit: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    jid = jobs.job_id(job.name)
    kept = [o for o in args.overrides if not o.startswith(("log.run_dir=", "ckpt.load="))]
    meta = {"miles_job": job.name, "run_dir": run_dir}

    def go(address: str, env: dict[str, str], detach: bool) -> tuple[str, str]:
        """The job's final status and, when it did not succeed, Ray's reason."""
        jobs.submit(address, env, jid, entry, workdir, meta)
        print(f"miles submit: {job.name} submitted to {address} as {jid}; run directory {run_dir}", flush=True)
        if args.no_wait:
            a = f" --address {address}" if address != _address(None) else ""
            print(f"  follow:   ray job logs --follow {jid}{a}   (or miles logs {jid}{a})\n"
                  f"  status:   miles jobs{a}\n  stop:     miles stop {jid}{a}\n"
                  f"  continue: miles submit {shlex.join([args.job, *kept])} log.run_dir={run_dir} "
                  f"ckpt.load=auto{a}")
            return "SUBMITTED", ""
        try:
            jobs.follow(address, env, jid)
        except KeyboardInterrupt:
            if detach:
                print(f"\nmiles submit: stopped following; {jid} keeps running on {address}. Follow it with `ray "
                      f"job logs --follow {jid}`, stop it with `miles stop {jid}`.", file=sys.stderr)
            raise
        final = jobs.status(address, env, jid)
        return final, ("" if final in ("SUCCEEDED", "RUNNING", "PENDING") else jobs.why(address, env, jid))

    try:
        address = _address(args.address)
        if address:
            final, why = go(address, dict(os.environ), detach=True)
        else:
            with local_cluster(job.cluster.num_cpus) as cluster:
                try:
                    final, why = go(cluster.address, cluster.env, detach=False)
                except KeyboardInterrupt:
                    print("\nmiles submit: stopping the local cluster started for this job (and the job)",
                          file=sys.stderr)
                    raise
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except jobs.SubmitError as e:
        print(f"miles submit: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if final == "SUBMITTED":
        return
    if final != "SUCCEEDED":
        reason = f" ({why})" if why else ""
        print(f"miles submit: job {jid} {final}{reason}; what it wrote is in {run_dir}", file=sys.stderr)
        raise SystemExit(1)
    print(f"miles submit: job {jid} SUCCEEDED")  # the job's own last lines name its run directory, wandb run, plots


def _job_command(argv: list[str], name: str) -> None:
    """miles jobs | stop JOB_ID | logs JOB_ID [--follow]: the cluster at --address or $RAY_ADDRESS."""
    import os

    helps = {"jobs": "List the cluster's jobs (id, status, start, miles job name, run directory).",
             "stop": "Stop a job: SIGTERM to its processes, which shut down its workers, engines and router; it "
                     "ends STOPPED and can continue with ckpt.load=auto.",
             "logs": "Print a job's output (--follow: until it ends)."}
    ap = argparse.ArgumentParser(prog=f"miles {name}", description=helps[name])
    if name != "jobs":
        ap.add_argument("job_id", help="the id `miles submit` printed (miles jobs lists them)")
    if name == "logs":
        ap.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
    ap.add_argument("--address", help="the cluster's job server (default $RAY_ADDRESS)")
    args = ap.parse_args(argv)
    from miles.cluster import jobs

    address = _address(args.address)
    if address is None:
        print(f"miles {name}: no cluster: give --address http://HOST:8265, or `source ~/.miles/cluster/cluster.env` "
              "after cluster/up.sh", file=sys.stderr)
        raise SystemExit(2)
    env = dict(os.environ)
    try:
        if name == "jobs":
            jobs.print_jobs(address, env)
        elif name == "stop":
            print(f"miles stop: {args.job_id} {jobs.stop(address, env, args.job_id)}")
        elif args.follow:
            jobs.follow(address, env, args.job_id)
        else:
            print(jobs.logs(address, env, args.job_id), end="")
    except jobs.SubmitError as e:
        print(f"miles {name}: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def _report(argv: list[str]) -> None:
    from miles.observe.report import main

    main(argv)


def _check_alignment(argv: list[str]) -> None:
    from miles.observe.alignment import main

    main(argv)


def _convert(argv: list[str]) -> None:
    from miles.ckpt.convert import main

    main(argv)


def _serve(argv: list[str]) -> None:
    from miles.rollout.serve import main

    main(argv)


COMMANDS = {"run": (_run, "run a job file"), "sft": (lambda a: _run(a, "sft"), "run an SFT job file"),
            "rl": (lambda a: _run(a, "rl"), "run an RL job file (DAPO / GRPO)"),
            "submit": (_submit, "submit a job file with `ray job submit` ($RAY_ADDRESS, or a local cluster)"),
            "jobs": (lambda a: _job_command(a, "jobs"), "list the cluster's jobs"),
            "stop": (lambda a: _job_command(a, "stop"), "stop a submitted job (it can continue: ckpt.load=auto)"),
            "logs": (lambda a: _job_command(a, "logs"), "a submitted job's output"),
            "report": (_report, "plot a run's logged curves as PNG files"),
            "check-alignment": (_check_alignment, "compare two runs' loss and gradient checksums"),
            "convert": (_convert, "HF checkpoint <-> sharded checkpoint (hf-to-dist, dist-to-hf)"),
            "serve": (_serve, "serve a checkpoint with SGLang's HTTP API (embedded engine + sglang-router)")}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        usage = "usage: miles COMMAND [--help]\n\ncommands:\n" + "".join(
            f"  {name:<{width}}  {help_}\n" for name, (_, help_) in COMMANDS.items())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"miles: unknown command '{argv[0]}'\n\n{usage}", file=sys.stderr, end="")
            raise SystemExit(2)
        print(usage, end="", file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    main()
