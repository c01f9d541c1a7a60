#!/usr/bin/env bash
# Stop the cluster cluster/up.sh started: its processes on every node, found by PID; none is left behind.
# Options: cluster/down.sh --help. The logic is miles/cluster/bringup.py; this runs it with the
# repository's Python ($MILES_PYTHON, else .venv/bin/python, else python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${MILES_PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m miles.cluster.bringup down "$@"
