#!/usr/bin/env bash
# Run the SPIN model of kvfence's transfer protocol and its mutants; see formal/README.md.
set -euo pipefail
exec python3 "$(dirname "$0")/run.py" "$@"
