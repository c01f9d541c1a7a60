#!/usr/bin/env bash
# Start (or complete) the Ray cluster miles jobs are submitted to: --local, or a head here and --hostfile workers.
# Options: cluster/up.sh --help. The logic is miles/cluster/bringup.py; this runs it with the
# repository's Python ($MILES_PYTHON, else .venv/bin/python, else python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${MILES_PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m miles.cluster.bringup up "$@"
