"""`miles` command line: parse, validate, hand over. Every command has --help.

    miles run JOB.yaml [KEY=VALUE ...]     run a job (the controller, in this process)
    miles sft JOB.yaml [KEY=VALUE ...]     the same, for SFT jobs (data.source: chat)
    miles rl JOB.yaml [KEY=VALUE ...]      an RL job (DAPO / GRPO: data.source: prompts, algo.loss: policy)
    miles submit JOB.yaml [KEY=VALUE ...]  submit a job with `ray job submit` (to --address, or
                                           to a local cluster started and stopped for it)
    miles report RUN_DIR                   PNG plots of a run's logged curves
    miles check-alignment RUN_A RUN_B      compare two runs' loss and gradient checksums
"""

from __future__ import annotations

import argparse
import sys

RUN_EPILOG = """\
overrides are dotted KEY=VALUE pairs applied on top of the job file, values read as YAML:
  miles run jobs/demo_tiny.yaml train.steps=20 train.optim.lr=1e-3 log.wandb.mode=disabled

The job runs against a Ray cluster: --address (or cluster.address, or $RAY_ADDRESS), else a
local one started for the job on 127.0.0.1. Everything the run writes goes to log.run_dir
(default runs/<name>-<time>): config.yaml, metrics.jsonl, the wandb run, plots.
exit status: 0 done, 1 the job failed, 2 the job file or an override is invalid."""


def _load(prog: str, job_path: str, overrides: list[str]):
    from miles.config import JobConfigError, load_job

    try:
        return load_job(job_path, overrides)
    except JobConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _run(argv: list[str], command: str = "run") -> None:
    prog = f"miles {command}"
    what = {"sft": "an SFT job file (data.source: chat)", "rl": "an RL job file (data.source: prompts)"}.get(
        command, "a job file")
    ap = argparse.ArgumentParser(prog=prog, description=f"Run {what} through the miles controller.",
                                 epilog=RUN_EPILOG.replace("miles run", prog),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", help="a job file (YAML), e.g. " + {"sft": "jobs/sft_tiny.yaml", "rl": "jobs/dapo_tiny.yaml"}
                    .get(command, "jobs/demo_tiny.yaml"))
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=20")
    ap.add_argument("--address", help="Ray cluster to run on (default: cluster.address, $RAY_ADDRESS, or local)")
    ap.add_argument("--check", action="store_true", help="validate the job and print it resolved; run nothing")
    ap.add_argument("--report", action="store_true", help="render the PNG plots when the run has finished")
    args = ap.parse_args(argv)
    job = _load(prog, args.job, args.overrides)
    if command == "sft" and job.data.source != "chat":
        print(f"{prog}: {args.job}: data.source is {job.data.source}; SFT trains on conversations "
              "(data.source: chat). Use `miles run` for other jobs.", file=sys.stderr)
        raise SystemExit(2)
    if (command == "rl") != (job.data.source == "prompts"):
        right = "miles rl" if job.data.source == "prompts" else "miles run` or `miles sft"
        print(f"{prog}: {args.job}: data.source is {job.data.source}; use `{right}` for this job", file=sys.stderr)
        raise SystemExit(2)
    if args.address:
        job.cluster.address = args.address  # taken as given (not read as YAML)
    if args.check:
        import yaml

        print(yaml.safe_dump(job.resolved(), sort_keys=False), end="")
        return
    from miles.algo.sampling import DynamicSamplingError
    from miles.ckpt.store import CheckpointError
    from miles.controller import JobError, run
    from miles.data.dataset import DataError
    from miles.rl import run_rl

    try:
        result = run_rl(job) if command == "rl" else run(job)
    except (JobError, DataError, CheckpointError, DynamicSamplingError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"run directory: {result.run_dir}")
    if job.log.wandb.mode != "disabled":
        print(f"wandb run: {result.run_dir / 'wandb'} (view offline: wandb leet {result.run_dir / 'wandb'})")
    if args.report:
        from miles.observe.report import render

        print(f"plots: {render(result.run_dir)[0].parent}")
    else:
        print(f"plots: miles report {result.run_dir}")


SUBMIT_EPILOG = """\
The job file is validated here first; then `ray job submit` runs `miles sft` (SFT jobs),
`miles rl` (RL jobs) or `miles run` on the cluster, in this directory, with this Python, and streams its output.
Without --address a local cluster (127.0.0.1, token auth, cluster.num_cpus CPUs) is started
for the job and stopped after it. The run directory is fixed here (log.run_dir) and printed.
exit status: 0 done, 1 the job failed, 2 the job file or an override is invalid."""


def _submit(argv: list[str]) -> None:
    import os
    import shlex
    import subprocess

    ap = argparse.ArgumentParser(prog="miles submit", description="Submit a job with `ray job submit`.",
                                 epilog=SUBMIT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", help="a job file (YAML), e.g. jobs/sft_tiny.yaml")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=20")
    ap.add_argument("--address", help="the cluster's job server, e.g. http://127.0.0.1:8265 (default: a local "
                                      "cluster started for this job)")
    ap.add_argument("--report", action="store_true", help="render the PNG plots when the run has finished")
    args = ap.parse_args(argv)
    job = _load("miles submit", args.job, args.overrides)
    run_dir = os.path.abspath(job.log.run_dir)
    command = {"chat": "sft", "prompts": "rl"}.get(job.data.source, "run")
    entry = [sys.executable, "-m", "miles.cli", command, os.path.abspath(args.job), *args.overrides,
             f"log.run_dir={run_dir}"] + (["--report"] if args.report else [])
    entrypoint = f"cd {shlex.quote(os.getcwd())} && {shlex.join(entry)}"

    from miles.cluster.local import local_cluster, ray_bin

    def submit(address: str, env: dict[str, str]) -> int:
        print(f"miles submit: {job.name} -> {address}; run directory {run_dir}", flush=True)
        cmd = [ray_bin(), "job", "submit", "--address", address, "--", "sh", "-c", entrypoint]
        return subprocess.run(cmd, env=env).returncode

    if args.address:
        rc = submit(args.address, dict(os.environ))
    else:
        with local_cluster(job.cluster.num_cpus) as cluster:
            rc = submit(cluster.address, cluster.env)
    if rc != 0:
        print(f"miles submit: the job failed; what it wrote is in {run_dir}", file=sys.stderr)
        raise SystemExit(1)
    print(f"\nrun directory: {run_dir} (metrics.jsonl, config.yaml, summary.json)")
    if job.log.wandb.mode != "disabled":
        print(f"wandb run:     {run_dir}/wandb")
    print(f"plots:         {run_dir}/report" if args.report else f"plots:         miles report {run_dir}")


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
            "submit": (_submit, "submit a job file with `ray job submit` (local cluster by default)"),
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
