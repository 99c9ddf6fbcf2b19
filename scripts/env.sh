# Sourced by the scripts: paths and ccache settings shared by every build directory.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${DTENSOR_VENV:-$root/.venv}
# The older LibTorch dtensor also builds against ([Note: two LibTorch versions], setup.sh).
venv_old_torch=${DTENSOR_VENV_OLD_TORCH:-$root/.venv-torch2.9.1}
export PATH="$venv/bin:$PATH"
# Objects are shared between clones and between the CPU and CUDA build directories.
export CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
# [Note: precompiled headers] in meson.build: ccache caches units that use one only with
# this sloppiness (the header's own __DATE__/__TIME__ and its -D flags are checked by GCC).
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}
# [Note: Python's bytecode] Every torchrun and every judge imports torch: from source, that
# costs about 2 s of CPU more than from bytecode, and the suites start Python some hundreds of
# times. Environments that set PYTHONDONTWRITEBYTECODE (container images do) never keep the
# bytecode, and set-up installs with --no-compile (compiling all of torch takes a minute), so
# the scripts let Python write what it imports, into one folder inside the venv (not beside the
# sources: nothing outside what set-up made is written).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$venv/pycache}
unset PYTHONDONTWRITEBYTECODE
# One intra-op thread per rank: several ranks share the cores of one machine.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# configure BUILD_DIR [meson options...]: set up once, reconfigure when options change.
configure() {
  local dir=$1
  shift
  if [[ -f $dir/build.ninja ]]; then
    # b_ndebug: the default since [Note: NDEBUG] (meson.build), for directories set up before.
    meson configure "$dir" -Db_ndebug=true "$@" >/dev/null
    # Regenerate now if a meson.build changed, so that introspection sees the current
    # targets and tests (ninja would otherwise do it only at the next build).
    ninja -C "$dir" build.ninja >/dev/null
  else
    meson setup "$dir" "$@"
  fi
}
