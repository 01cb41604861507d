#!/usr/bin/env bash
# What a user sees when they open the link `comera fit` prints: a tiny quickstart fit in a scratch folder, `mlflow ui`
# on its store, and a headless Chromium screenshot of the printed run link (the training view: the run's metric
# charts, not MLflow 3's GenAI overview).
#   bash docs/tools/mlflow_view.sh [out.png]        # default docs/img/mlflow_run.png
# Needs chromium (Debian: apt-get install chromium) and the project's environment (comera, mlflow on PATH).
set -euo pipefail
out=$(realpath -m "${1:-docs/img/mlflow_run.png}")
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
    echo "mlflow_view.sh needs a Chromium-based browser: apt-get install chromium (or put one on PATH)" >&2
    exit 2
fi
work=$(mktemp -d)
port=${MLFLOW_VIEW_PORT:-5077}
cleanup() { [ -n "${ui_pid:-}" ] && kill "$ui_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
cd "$work"
comera fit --config quickstart --trainer.max_steps 30 --trainer.val_check_interval 10 \
    --trainer.limit_val_batches 2 --trainer.enable_progress_bar false > fit.log 2>&1
link=$(grep -o 'http://[^ ]*workflowType=machine_learning' fit.log | tail -1)
if [ -z "$link" ]; then
    echo "the fit printed no MLflow run link; its output is below" >&2
    cat fit.log >&2
    exit 1
fi
mlflow ui --backend-store-uri "sqlite:///$work/mlflow.db" --host 127.0.0.1 --port "$port" > ui.log 2>&1 &
ui_pid=$!
up=""
for _ in $(seq 240); do
    python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null \
        && up=1 && break
    sleep 1
done
if [ -z "$up" ]; then
    echo "mlflow ui did not answer on port $port within 4 minutes; its log is below" >&2
    cat ui.log >&2
    exit 1
fi
page=${link/127.0.0.1:5000/127.0.0.1:$port}
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1500,1000 \
    --virtual-time-budget=20000 --screenshot="$out" "$page" > browser.log 2>&1
echo "opened $page"
echo "screenshot: $out"
