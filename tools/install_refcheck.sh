#!/usr/bin/env bash
# Install the environment of tools/official_reference.py into DEST (default .refcheck/venv, ignored by git).
#
#   tools/install_refcheck.sh [DEST]
#
# - The official BAGEL code needs transformers 4.49.0, older than what the project may use: it gets a venv of its
#   own, never the project venv.
# - torch: the venv reuses the project venv's pinned pair (torch==2.14.1 torchvision==0.29.1) and its other
#   packages through a site-packages link (.pth, as tools/install_comfyhost.sh does), so nothing large is
#   downloaded. The venv's own packages come first on sys.path, so its pins win over the project's versions.
# - The packages of tools/requirements-refcheck.txt, all pinned, installed without dependencies (pip never
#   resolves anything else into the venv).
# Idempotent: a second run checks the stamp and exits at once.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$HERE/.refcheck/venv}
REQS="$HERE/tools/requirements-refcheck.txt"
PROJECT_PY=${PROJECT_PY:-$HERE/.venv/bin/python}
PYTHON=${PYTHON:-python3.11}
STAMP="$DEST/.installed"
want_stamp="$(sha256sum "$REQS" | cut -c1-16)"

if ! "$PROJECT_PY" -c '
import sys, torch, torchvision
sys.exit(0 if (torch.__version__.split("+")[0], torchvision.__version__.split("+")[0]) == ("2.14.1", "0.29.1") else 1)
' 2>/dev/null; then
  echo "refcheck: $PROJECT_PY must have torch 2.14.1 and torchvision 0.29.1 (make setup)" >&2
  exit 1
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] && [ -x "$DEST/bin/python" ]; then
  echo "refcheck: already installed in $DEST"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$DEST/bin/python" ] || "$PYTHON" -m venv "$DEST"
PY="$DEST/bin/python"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PROJECT_SITE=$("$PROJECT_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$PROJECT_SITE')" > "$SITE/zz_project_venv.pth"
"$PY" -m pip install -q --no-deps -r "$REQS" 2>&1 | { grep -v '^WARNING: Location .* is ignored' || true; }
"$PY" -c 'import torch, transformers, cv2, einops; print("refcheck: torch", torch.__version__, "transformers", transformers.__version__)'
echo "$want_stamp" > "$STAMP"
echo "refcheck: installed in $DEST"
