#!/usr/bin/env bash
# The wheels a GPU call carries (`carry: [".whl"]`) for what the device lacks: xgrammar
# (structured output), FastAPI + uvicorn (serve), the openai client (httpx2 since 3.x),
# jsonschema, gguf (converting the demo model, see demo_model_chunks.sh). Run here,
# in the checkout's root (.whl/ is ignored through .git/info/exclude), then start the
# device command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -eu
cd "$(dirname "$0")/../.."
mkdir -p .git/info && grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PLATFORMS=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014; do PLATFORMS="$PLATFORMS --platform ${p}_x86_64"; done
for pkg in xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 anyio==4.16.0 \
    sniffio==1.3.1 h11==0.16.0 click==8.5.1 idna==3.21 openai==3.63.0 distro==1.9.0 \
    jiter==0.19.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 \
    gguf==0.19.0 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 \
    charset-normalizer opentelemetry-api==1.45.3 annotated-doc==0.0.7; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d .whl "$pkg" 2>&1 | grep -v "^WARNING: Location" || true
done
du -sh .whl
