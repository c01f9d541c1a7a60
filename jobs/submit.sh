#!/usr/bin/env bash
# Submit a job file to the cluster: `jobs/submit.sh JOB.yaml [KEY=VALUE ...] [--no-wait]`, which is
# `miles submit` with the repository's Python. The cluster is $RAY_ADDRESS (source
# ~/.miles/cluster/cluster.env after cluster/up.sh), --address, or a local one started for the job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${MILES_PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m miles.cli submit "$@"
