#!/usr/bin/env bash
# One-time, idempotent set-up of a machine for dtensor: Debian packages, a project-local
# Python venv (.venv) holding the pinned LibTorch (torch wheel), Meson and ninja, and a
# second one (.venv-torch2.9.1) with the older LibTorch dtensor also supports.
# A second run only checks stamps and returns within seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${DTENSOR_VENV:-$root/.venv}
venv_old_torch=${DTENSOR_VENV_OLD_TORCH:-$root/.venv-torch2.9.1}  # as in env.sh
torch_version=2.15.0         # LibTorch pin (the default); see docs/build.md before changing
old_torch_version=2.9.1      # the older LibTorch that dtensor keeps building against
meson_version=1.9.1
ninja_version=1.13.0
numpy_version=2.3.5          # for the conformance suite's oracle (torch.distributed.tensor.debug)
expecttest_version=0.3.0     # ... and its test models (torch.testing._internal imports it)
safetensors_version=0.8.0    # checkpoint interop tests (PyTorch's HuggingFaceStorageReader/Writer)
transformers_version=5.24.0  # the judge of the Llama-3 model's Hugging Face exchange (tests only)
matplotlib_version=3.11.2    # the main job's loss curve (scripts/plot_metrics.py)
tabulate_version=0.9.0       # what PyTorch's visualize_sharding prints with (its judge in tests)
torchao_version=0.18.0       # the judge of the float8 linears' numerics (tests only)
torchtitan_version=0.3.0     # the judge of the learning-rate schedule (tests only), without its
spmd_types_version=0.2.3     # dependencies but what its schedule's module imports: these two
tyro_version=1.0.17
tensorboard_version=2.21.0   # the judge of the main job's TensorBoard event files (tests only)

log() { printf '[setup] %s\n' "$*"; }

# --- Debian packages ---------------------------------------------------------------------
apt_pkgs=(build-essential pkg-config cmake python3-venv ccache catch2 libfmt-dev libgloo-dev
          nlohmann-json3-dev libxxhash-dev libsentencepiece-dev libtomlplusplus-dev
          libpcre2-dev fortunes libisal-dev)
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

# --- Python venvs: LibTorch (torch wheels), Meson, ninja -----------------------------------
# [Note: two LibTorch versions] dtensor builds against LibTorch 2.15.0 (the default, in .venv,
# with Meson, ninja and the conformance oracle's modules) and 2.9.1 (in .venv-torch2.9.1:
# torch alone; the test command builds the library against it and runs a smoke subset).
# Wheels are kept in a machine-wide wheelhouse, so a fresh clone on the same machine (CI)
# installs without downloading; the venvs themselves stay project-local.
# numpy, expecttest: what torch.distributed.tensor.debug (CommDebugMode) and
# torch.testing._internal (PyTorch's test models) import; the conformance suite
# (test/conformance) runs PyTorch as its oracle.
wheelhouse=${DTENSOR_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtensor/wheels}
python=${PYTHON:-python3}

# install_venv DIR REQUIREMENT...: downloads once into the wheelhouse, installs from it.
install_venv() {
  local dir=$1
  shift
  local tag
  tag=$(printf '%s-' "$@" | tr -c 'A-Za-z0-9.=_-' '_')
  local stamp="$dir/.dtensor-setup-$tag"
  [[ -f $stamp ]] && return 0
  if [[ ! -f $wheelhouse/.complete-$tag ]]; then
    log "downloading $* into $wheelhouse"
    mkdir -p "$wheelhouse"
    "$python" -m pip download -q -d "$wheelhouse" "$@"
    touch "$wheelhouse/.complete-$tag"
  fi
  [[ -x $dir/bin/python ]] || { log "creating venv $dir"; "$python" -m venv "$dir"; }
  log "installing $* into $dir from $wheelhouse"
  # --no-compile: compiling all of torch's files at install took about a minute per venv; the
  # scripts have Python write the bytecode of what is imported instead ([Note: Python's
  # bytecode] in env.sh).
  "$dir/bin/python" -m pip install -q --no-compile --no-index --find-links "$wheelhouse" "$@"
  touch "$stamp"
}

install_venv "$venv" "torch==$torch_version" "meson==$meson_version" "ninja==$ninja_version" \
  "numpy==$numpy_version" "expecttest==$expecttest_version" "safetensors==$safetensors_version" \
  "transformers==$transformers_version" "matplotlib==$matplotlib_version" \
  "tabulate==$tabulate_version" "torchao==$torchao_version" "tyro==$tyro_version"
# torchtitan's own dependencies (datasets, wandb, ...) are not needed by the part the tests
# import: it and spmd_types come without them.
install_venv "$venv" --no-deps "torchtitan==$torchtitan_version" "spmd_types==$spmd_types_version"
# TensorBoard (and its own dependencies: grpcio, protobuf, werkzeug, ...) reads the event files
# the main job writes (test/tensorboard_check.py) and serves them (docs/observability.md).
install_venv "$venv" "tensorboard==$tensorboard_version"
if [[ ${DTENSOR_SKIP_OLD_TORCH:-0} != 1 ]]; then
  install_venv "$venv_old_torch" "torch==$old_torch_version"
fi
version_of() { "$1/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'; }
log "ready: torch $(version_of "$venv") in $venv, meson $("$venv/bin/meson" --version)$(
  [[ -x $venv_old_torch/bin/python ]] && printf '; torch %s in %s' "$(version_of "$venv_old_torch")" "$venv_old_torch")"
