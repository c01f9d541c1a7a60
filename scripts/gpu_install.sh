#!/usr/bin/env bash
# On the GPU machine (no network): install what `make gpu-bundle` packed here (scripts/gpu_bundle.py).
# Each device call carries .whl/site.parts and one or more of .whl/site.tar.xz.N and runs this
# script; the parts wait in /tmp/miles-bundle (a warm machine keeps /tmp about 30 s after a call).
# Once every part is there (sha256 checked): unpacked into /tmp/site, then `gpu_bundle.py install`
# puts /tmp/site and this checkout on python3's path, writes `miles`, `ray`, ... beside python3
# and checks every requirement and import. Run again with everything in place, it only re-checks.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
keep=/tmp/miles-bundle site=/tmp/site
mkdir -p "$keep"
cp "$root"/.whl/site.parts "$root"/.whl/site.tar.xz.* "$keep"/ 2>/dev/null || true
cd "$keep"
[ -f site.parts ] || { echo "gpu_install: no .whl/site.parts (carry it in every call)" >&2; exit 1; }
parts=$(awk '{print $2}' site.parts)
missing=$(for p in $parts; do [ -f "$p" ] || echo "$p"; done)
if [ -n "$missing" ]; then
    echo "gpu_install: parts here: $(ls site.tar.xz.* 2>/dev/null | xargs); carry next (within 30 s):" $missing
    exit 0
fi
if ! cmp -s site.parts "$site/site.parts"; then
    sha256sum --quiet -c site.parts
    rm -rf "$site" && mkdir -p "$site"
    # shellcheck disable=SC2086
    cat $parts | python3 -c 'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="tar")' "$site"
    cp site.parts "$site/"
    echo "gpu_install: unpacked $(du -sh "$site" | cut -f1) into $site"
fi
exec python3 "$root/scripts/gpu_bundle.py" install --site "$site"
