#!/usr/bin/env bash
# Second CI stage: the vllm-omni patches (tests/omni) against the real vllm-omni, in its own environment.
# Run after .ci/run built .venv. Fails on any test failure, on zero tests run, and on a timeout.
#
# The environment (about a minute to build on 2 cores, ~70 MB): a venv (OMNI_VENV, default .venv-omni) from
# the main venv's base interpreter, whose site-packages holds
#   - a .pth that adds the main venv's site-packages (vLLM 0.33, torch, diffusers, pytest, this plugin in
#     editable mode) *after* its own, so nothing of the 9.5 GB main environment is copied;
#   - vllm-omni==$OMNI_VERSION installed with --no-deps;
#   - the three small pure-Python packages vllm-omni's package import needs and the main venv lacks
#     (aenum at vllm-omni's pin, omegaconf, prettytable; their own dependencies resolved normally).
# Why --no-deps: vllm-omni 0.30.0 pins transformers<5.15 and diffusers==0.40.0 (the main venv, which this
# plugin is tested with, has 5.20.2 and 0.42.1) and is aligned with vLLM 0.30, while this plugin requires
# vLLM 0.33; its diffusion loader imports and runs with vLLM 0.33 (one vLLM 0.30 name is bridged in
# tests/omni/conftest.py). `pip check` is therefore not run here: vllm-omni's pins are knowingly unmet.
set -euo pipefail
script="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$script")/.."

MAIN_VENV=${MAIN_VENV:-.venv}
OMNI_VENV=${OMNI_VENV:-.venv-omni}
OMNI_VERSION=${OMNI_VERSION:-0.30.0}
EXTRA_PACKAGES=(aenum==3.1.16 omegaconf==2.4.0 prettytable==3.19.0)
BUILD_TIMEOUT=${OMNI_BUILD_TIMEOUT:-300}   # seconds for building the environment
TEST_TIMEOUT=${OMNI_TEST_TIMEOUT:-420}     # seconds for the test run

main_python="$MAIN_VENV/bin/python"
[ -x "$main_python" ] || { echo "omni-env: $main_python not found; run .ci/run first" >&2; exit 1; }
base_python=$("$main_python" -c 'import sys; print(sys._base_executable)')
main_site=$("$main_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stamp="vllm-omni==$OMNI_VERSION ${EXTRA_PACKAGES[*]} main=$main_site"

build() {
    rm -rf "$OMNI_VENV"
    "$base_python" -m venv --without-pip "$OMNI_VENV"
    echo '*' > "$OMNI_VENV/.gitignore"  # keep the environment out of git status
    local site
    site=$("$OMNI_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import site; site.addsitedir('$main_site')" > "$site/zz_main_venv.pth"
    # pip comes from the main venv through the .pth and installs into this venv (sys.prefix)
    "$OMNI_VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "vllm-omni==$OMNI_VERSION"
    "$OMNI_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${EXTRA_PACKAGES[@]}"
    echo "$stamp" > "$OMNI_VENV/.omni-env-stamp"
}

if [ "${1:-}" = "--build" ]; then  # the time-bounded build step, run by the lines below
    build
    exit 0
fi

start=$(date +%s)
if [ "$(cat "$OMNI_VENV/.omni-env-stamp" 2>/dev/null)" != "$stamp" ]; then
    echo "omni-env: building $OMNI_VENV (vllm-omni $OMNI_VERSION over $MAIN_VENV)"
    timeout "$BUILD_TIMEOUT" bash "$script" --build || {
        echo "omni-env: building the environment failed or exceeded ${BUILD_TIMEOUT}s" >&2; exit 1; }
else
    echo "omni-env: reusing $OMNI_VENV ($stamp)"
fi
echo "omni-env: environment ready in $(( $(date +%s) - start ))s"

report="$OMNI_VENV/omni-junit.xml"
set +e
OMNI_TESTS_REQUIRED=1 VLLM_TARGET_DEVICE=cpu timeout "$TEST_TIMEOUT" \
    "$OMNI_VENV/bin/python" -m pytest tests/omni -p no:cacheprovider -W "ignore::DeprecationWarning" \
    --junitxml="$report"
status=$?
set -e
if [ "$status" -eq 124 ]; then
    echo "omni-env: tests/omni exceeded ${TEST_TIMEOUT}s" >&2
    exit 1
fi
if [ "$status" -ne 0 ]; then
    [ "$status" -eq 5 ] && echo "omni-env: pytest collected no tests: failing" >&2
    exit "$status"
fi
ran=$("$OMNI_VENV/bin/python" - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET

suites = ET.parse(sys.argv[1]).getroot()
suites = [suites] if suites.tag == "testsuite" else list(suites)
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))
PY
)
if [ "$ran" -le 0 ]; then
    echo "omni-env: no test of tests/omni ran (all skipped?): failing" >&2
    exit 1
fi
echo "omni-env: $ran tests ran against vllm-omni $OMNI_VERSION in $(( $(date +%s) - start ))s"
