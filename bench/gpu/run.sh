#!/usr/bin/env bash
# kvwire's check on a GPU machine, in at most ~5 minutes: the accelerator tests, then bench/devices.py,
# each result written into OUT as it comes.
#
#     bash bench/gpu/run.sh OUT [BUDGET_SECONDS]     (default budget 300)
#
# For a machine with its own Python and CUDA build of torch and no network: run from a checkout of this
# repository; packages that Python lacks come from .whl/ when present (bench/gpu/wheels.sh makes it,
# where the package index is reachable) and are installed into a folder of their own, never over the
# machine's torch. requirements.txt is never installed here (it pins the CPU build of torch). Random
# weights with the presets' configurations stand in for the model files, which do not travel.
#
# OUT/env.txt (GPU, Python, torch), OUT/info.txt (kvwire info), OUT/tests.txt (tests/test_cuda.py and
# the device-agnostic tests/test_devices.py),
# OUT/bench.txt and OUT/results.jsonl (bench/devices.py). Exit status: the tests' (the bench runs
# whatever they say).
set -u
out=${1:?usage: bash bench/gpu/run.sh OUT [BUDGET_SECONDS]}
budget=${2:-300}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # before the cd below: a relative OUT is the caller's
cd "$(dirname "$0")/../.."
start=$SECONDS
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "nvidia-smi: none"
    "$python" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| available', torch.cuda.is_available())"
} > "$out/env.txt" 2>&1
wheels=${KVWIRE_WHEELS:-.whl}  # the folder of wheels to install, when it holds any
if compgen -G "$wheels/*.whl" > /dev/null; then
    site=${TMPDIR:-/tmp}/kvwire-site
    if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$wheels"/*.whl >> "$out/env.txt" 2>&1; then
        cat "$out/env.txt"; echo "bench/gpu/run.sh: the wheels in $wheels did not install (above)" >&2; exit 3
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # kvwire from this checkout
# what kvwire and the tests import, with the versions found (a missing one is said here, not in every test)
"$python" - >> "$out/env.txt" 2>&1 <<'PY'
import importlib, importlib.metadata
for name in ("kvwire", "gguf", "tokenizers", "transformers", "fastapi", "pydantic", "uvicorn", "httpx"):
    try:
        module = importlib.import_module(name)
    except Exception as e:
        print(f"{name}: cannot import ({type(e).__name__}: {e})")
        continue
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # e.g. kvwire from the checkout, not installed
        version = getattr(module, "__version__", "(version unknown)")
    print(f"{name} {version}")
PY
cat "$out/env.txt"
"$python" -m kvwire.cli info > "$out/info.txt" 2>&1
# the tests first: half the budget at most
timeout -k 10 $((budget / 2)) "$python" -m pytest -v tests/test_cuda.py tests/test_devices.py -p no:cacheprovider \
    -rs 2>&1 | tee "$out/tests.txt"
status=${PIPESTATUS[0]}
# the bench: what is left, less a minute for a measurement that starts just inside its budget
left=$((budget - (SECONDS - start) - 60))
if [ "$left" -gt 0 ]; then
    timeout -k 10 $((left + 50)) "$python" bench/devices.py --device "${KVWIRE_TEST_DEVICE:-cuda}" --out "$out" \
        --budget "$left" 2>&1 | tee "$out/bench.txt"
else
    echo "bench/devices.py: no time left in the ${budget} s budget" | tee "$out/bench.txt"
fi
echo "done in $((SECONDS - start)) s; tests exit status $status" | tee -a "$out/bench.txt"
exit "$status"
