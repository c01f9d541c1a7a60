"""`miles` command line: parse, validate, hand over. Every command has --help.

    miles run JOB.yaml [KEY=VALUE ...]     run a job (the controller, in this process)
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


def _run(argv: list[str]) -> None:
    from miles.config import JobConfigError, load_job

    ap = argparse.ArgumentParser(prog="miles run", description="Run a job file through the miles controller.",
                                 epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", help="a job file (YAML), e.g. jobs/demo_tiny.yaml")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=20")
    ap.add_argument("--address", help="Ray cluster to run on (default: cluster.address, $RAY_ADDRESS, or local)")
    ap.add_argument("--check", action="store_true", help="validate the job and print it resolved; run nothing")
    ap.add_argument("--report", action="store_true", help="render the PNG plots when the run has finished")
    args = ap.parse_args(argv)
    try:
        job = load_job(args.job, args.overrides)
    except JobConfigError as e:
        print(f"miles run: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.address:
        job.cluster.address = args.address  # taken as given (not read as YAML)
    if args.check:
        import yaml

        print(yaml.safe_dump(job.resolved(), sort_keys=False), end="")
        return
    from miles.controller import JobError, run

    try:
        result = run(job)
    except JobError as e:
        print(f"miles run: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.report:
        from miles.observe.report import render

        print(f"plots: {render(result.run_dir)[0].parent}")
    else:
        print(f"plots: miles report {result.run_dir}")


def _report(argv: list[str]) -> None:
    from miles.observe.report import main

    main(argv)


def _check_alignment(argv: list[str]) -> None:
    from miles.observe.alignment import main

    main(argv)


COMMANDS = {"run": (_run, "run a job file"), "report": (_report, "plot a run's logged curves as PNG files"),
            "check-alignment": (_check_alignment, "compare two runs' loss and gradient checksums")}


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
