#!/usr/bin/env bash
# The GPU checks (benchmarks/gpu_checks.py says what they check):
#   bash benchmarks/gpu_checks.sh wheels           # with network: what an offline GPU machine lacks, as Python 3.12
#                                                  # wheels in .whl/ (about 30 MiB; .git/info/exclude lists /.whl/)
#   bash benchmarks/gpu_checks.sh [ARGS]           # on the GPU machine, .whl/ copied with the checkout: installs it
#                                                  # into /tmp/site, then python -m benchmarks.gpu_checks ARGS with
#                                                  # results in $OUT (default benchmarks/results/gpu_checks; 540 s)
#   bash benchmarks/gpu_checks.sh rehearse [VENV]  # on a CPU: the GPU image's Python and packages (IMAGE; CUDA
#                                                  # build, about 5 GB, runs on the CPU) in VENV, then --cpu-dry-run
# WHEELS is what a `comera fit` with the MLflow logger imports beyond the image's packages. galore-torch imports
# bitsandbytes for its 8-bit optimiser only (a 43 MiB wheel): a stand-in that raises on use is written instead.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  tensorly==0.10.0 jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 galore-torch==1.0
  mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 sqlparse==0.6.1
  cachetools==7.3.3 databricks-sdk==0.167.0 google-auth==2.63.0 cryptography==50.0.2 cffi==2.1.1
  GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4
  pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 importlib_metadata==9.1.0 dill==0.4.1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2 truststore==0.10.5
)

IMAGE=(
  torch==2.11.0 numpy==2.5.2 lightning==2.6.6 torchmetrics==1.9.0 transformers==5.17.0 tokenizers==0.23.2
  safetensors==0.8.0 scipy pandas pyarrow matplotlib rich pyyaml protobuf psutil requests pytest click jinja2
  opt-einsum werkzeug markdown python-dateutil six packaging
)

if [[ "${1:-}" == "rehearse" ]]; then
  venv="${2:-/tmp/gpu_image}"
  if [[ ! -x "$venv/bin/python3" ]]; then
    "${PYTHON312:-python3.12}" -m venv "$venv"
    "$venv/bin/pip" install -q "${IMAGE[@]}"
  fi
  rm -rf /tmp/site
  PATH="$venv/bin:$PATH" OUT="${OUT:-/tmp/gpu_rehearsal}" exec bash "$0" --cpu-dry-run
fi

if [[ "${1:-}" == "wheels" ]]; then
  mkdir -p .whl
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$p")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${WHEELS[@]}"
  du -sh .whl
  exit 0
fi

OUT="${OUT:-benchmarks/results/gpu_checks}"
mkdir -p "$OUT"
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  if ! python3 -c "import bitsandbytes" 2>/dev/null; then
    mkdir -p /tmp/site/bitsandbytes/optim
    touch /tmp/site/bitsandbytes/__init__.py /tmp/site/bitsandbytes/optim/__init__.py
    cat > /tmp/site/bitsandbytes/optim/optimizer.py <<'EOF'
class Optimizer2State:
    """Stand-in written by benchmarks/gpu_checks.sh: galore-torch imports this for GaLoreAdamW8bit only."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("bitsandbytes is not installed (gpu_checks.sh carries no 43 MiB wheel for the 8-bit "
                           "optimiser the checks do not use): pip install bitsandbytes")
EOF
  fi
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'lightning', lightning.__version__)" | tee "$OUT/versions.txt"
exec python3 -m benchmarks.gpu_checks --out "$OUT" "$@"
