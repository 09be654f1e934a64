#!/usr/bin/env bash
# Wheels of the packages kvwire's GPU check needs that a GPU machine's own Python (3.12, CUDA torch,
# no network) may lack, into .whl/ (git-ignored) for bench/gpu/run.sh to install from. Run here, where
# the package index is reachable; the versions are the ones the test requirements resolve to.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
py=${GPU_PYTHON_VERSION:-3.12}
rm -rf .whl && mkdir .whl
# kvwire's own needs (gguf), the transformers CI tests against, and the server's stack (kvwire serve --device)
# (with the needs of each that the machine's image lacks or holds at a version too old for it)
packages=(gguf==0.19.0
          transformers==5.25.0 huggingface-hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5
          hf-xet==1.8.0 kernels==0.19.1 tomlkit==0.15.3 regex==2026.12.2
          fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
          typing-inspection==0.4.5 opentelemetry-api==1.45.2 uvicorn==0.55.0 fastapi-offline==1.7.7
          llguidance==1.9.1)
platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" -d .whl "${packages[@]}"
du -sh .whl
