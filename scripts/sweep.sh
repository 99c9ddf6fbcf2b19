#!/usr/bin/env bash
# The whole operator sweep (test/conformance/sc_sweep.py, docs/conformance.md "Operator
# sweep"): two OpInfo calls per overload, on 2 ranks (1-D mesh) and 4 ranks (1-D and 2x2
# meshes), judged against the plain op; then the table in docs/conformance.md.
# CI runs the one-call subset on 2 ranks (meson test conformance_sweep-w2).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$root/scripts/setup.sh" >/dev/null
configure "$root/build" -Dcuda=disabled -Dbuildtype=debugoptimized
ninja -C "$root/build" test/conformance/conformance
summary="$root/build/sweep-summary"
rm -rf "$summary"
status=0
for n in 2 4; do
  "$root/.venv/bin/python" "$root/test/conformance/run.py" sweep_full "$n" \
    --program "$root/build/test/conformance/conformance" --summary "$summary" --timeout 1800 || status=1
done
"$root/.venv/bin/python" "$root/test/conformance/docs.py" "$summary" --sweep "$root/docs/conformance.md"
echo "[sweep] table written to docs/conformance.md (section 'Operator sweep')"
exit $status
