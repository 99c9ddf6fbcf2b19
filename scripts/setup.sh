#!/usr/bin/env bash
# One-time, idempotent set-up of a machine for dtensor: Debian packages, a project-local
# Python venv (.venv) holding the pinned LibTorch (torch wheel), Meson and ninja.
# A second run only checks stamps and returns within seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${DTENSOR_VENV:-$root/.venv}
torch_version=2.9.1          # LibTorch pin; see docs/build.md before changing
meson_version=1.9.1
ninja_version=1.13.0
numpy_version=2.3.5          # for the conformance suite's oracle (torch.distributed.tensor.debug)
expecttest_version=0.3.0     # ... and its test models (torch.testing._internal imports it)
safetensors_version=0.8.0    # checkpoint interop tests (PyTorch's HuggingFaceStorageReader/Writer)

log() { printf '[setup] %s\n' "$*"; }

# --- Debian packages ---------------------------------------------------------------------
apt_pkgs=(build-essential pkg-config python3-venv ccache catch2 libfmt-dev libgloo-dev
          nlohmann-json3-dev libxxhash-dev)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# --- Python venv with torch, meson, ninja ------------------------------------------------
# Wheels are kept in a machine-wide wheelhouse, so a fresh clone on the same machine (CI)
# installs without downloading; the venv itself stays project-local.
# numpy, expecttest: what torch.distributed.tensor.debug (CommDebugMode) and
# torch.testing._internal (PyTorch's test models) import; the conformance suite
# (test/conformance) runs PyTorch as its oracle.
reqs=("torch==$torch_version" "meson==$meson_version" "ninja==$ninja_version" "numpy==$numpy_version" "expecttest==$expecttest_version" "safetensors==$safetensors_version")
wheelhouse=${DTENSOR_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtensor/wheels}
tag="torch${torch_version}-meson${meson_version}-ninja${ninja_version}-numpy${numpy_version}-expecttest${expecttest_version}-safetensors${safetensors_version}"
stamp="$venv/.dtensor-setup-$tag"
if [[ ! -f $stamp ]]; then
  python=${PYTHON:-python3}
  if [[ ! -f $wheelhouse/.complete-$tag ]]; then
    log "downloading ${reqs[*]} (with dependencies) into $wheelhouse"
    mkdir -p "$wheelhouse"
    "$python" -m pip download -q -d "$wheelhouse" "${reqs[@]}"
    touch "$wheelhouse/.complete-$tag"
  fi
  [[ -x $venv/bin/python ]] || { log "creating venv $venv"; "$python" -m venv "$venv"; }
  log "installing ${reqs[*]} into $venv from $wheelhouse"
  "$venv/bin/python" -m pip install -q --no-index --find-links "$wheelhouse" "${reqs[@]}"
  touch "$stamp"
fi
log "ready: torch $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'), meson $("$venv/bin/meson" --version)"
