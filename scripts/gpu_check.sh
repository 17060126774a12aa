#!/usr/bin/env bash
# One command for a bare GPU machine with no network: install what nbaccel and its GPU
# tests need from the wheels carried in .gpu-wheels/ (scripts/gpu_wheels.sh fills it on a
# machine with PyPI), run the GPU tests and the GPU benchmark, and write the report
# (device, driver, torch, every test's result, the benchmark table) to bench/gpu/REPORT.md
# and report.json; with $OUT set (the device tool), copy the results there too.
#
#   bash scripts/gpu_check.sh                 # install, tests, bench, report
#   bash scripts/gpu_check.sh --tests-only    # one part per call: the device tool allows
#   bash scripts/gpu_check.sh --bench-only    #   10 minutes a command
#   bash scripts/gpu_check.sh --mesh-only     # the sharded bench (bench/mesh_parallel.py:
#                                             #   TP x FSDP2, HSDP, FSDP2 vs torch by hand)
#   bash scripts/gpu_check.sh --cluster-only  # one loopback Ray node lending the GPU
#                                             #   (--num-gpus=1), 1 node x 1 rank with
#                                             #   compute_device "auto": the rank's plan is
#                                             #   the GPU and it trains on cuda
#                                             #   (scripts/gpu_cluster_check.py; needs Ray)
#   bash scripts/gpu_check.sh --smoke         # on a CPU machine: plumbing only, no GPU
#
# The default run is tests + bench (250 s each, in the 10 minutes a command); the cluster
# step (Ray's start alone takes 20-60 s) does not fit beside them, so it runs on its own.
# Options also: --no-install. Environment: PYTHON (default python3, the image's torch),
# GPU_TEST_BUDGET / GPU_BENCH_BUDGET (seconds; default 250 each, 480 for a part run alone),
# GPU_MESH_BUDGET (seconds, default 480), GPU_MESH_STEPS (default 30),
# GPU_CLUSTER_BUDGET (seconds, default 300),
# PYTEST_ARGS, GPU_BENCH_ONLY (bench parts, e.g. "fp8,spawn"; default all: step,launch,fp8,spawn,pool,forkserver),
# NBACCEL_COMMIT (the commit to name in the report where the copy has no .git),
# GPU_CHECK_DIR (where the results go, default bench/gpu).
# Exit status: 0 when every step passed, else 1 (the report is written either way).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DIR=${GPU_CHECK_DIR:-bench/gpu}
WHEELS=.gpu-wheels
TESTS=1 BENCH=1 INSTALL=1 SMOKE=0 MESH=0 CLUSTER=0
for arg in "$@"; do
  case "$arg" in
    --tests-only) BENCH=0 ;;
    --bench-only) TESTS=0 ;;
    --mesh-only) TESTS=0 BENCH=0 MESH=1 ;;
    --cluster-only) TESTS=0 BENCH=0 CLUSTER=1 ;;
    --no-install) INSTALL=0 ;;
    --smoke) SMOKE=1 ;;
    *) echo "unknown option $arg (see the top of $0)" >&2; exit 2 ;;
  esac
done
# Seconds per part: both parts in one call must fit the device tool's 10 minutes a command.
if [ "$TESTS" = 1 ] && [ "$BENCH" = 1 ]; then share=250; else share=480; fi
TEST_BUDGET=${GPU_TEST_BUDGET:-$share}
BENCH_BUDGET=${GPU_BENCH_BUDGET:-$share}
mkdir -p "$DIR"
rm -f "$DIR/steps.txt"
FAILED=0
step() { echo "$1" >>"$DIR/steps.txt"; echo "== $1"; }

# the tree's nbaccel wins over anything installed (also in kernels and spawned workers)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "$INSTALL" = 1 ]; then
  if [ ! -f "$WHEELS/requirements.txt" ]; then
    step "install: FAILED: $WHEELS/requirements.txt missing (run scripts/gpu_wheels.sh here, carry $WHEELS)"
    FAILED=1
  elif "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt"; then
    step "install: ok (pip --no-index from $WHEELS)"
  elif "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$ROOT/.gpu-site" \
      -r "$WHEELS/requirements.txt"; then
    export PYTHONPATH="$PYTHONPATH:$ROOT/.gpu-site"  # site-packages not writable: a side folder
    step "install: ok (pip --no-index --target .gpu-site)"
  else
    step "install: FAILED (pip --no-index from $WHEELS; see the log above)"
    FAILED=1
  fi
  # nbaccel itself: editable when the interpreter allows it; PYTHONPATH covers it otherwise
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "(editable install of nbaccel skipped; PYTHONPATH=$ROOT is used)"
fi
if "$PY" -c "import nbaccel, ipykernel, jupyter_client, dill, pytest, pytest_timeout, sys;
assert nbaccel.__file__.startswith(sys.argv[1]), nbaccel.__file__" "$ROOT"; then
  step "imports: ok (nbaccel from $ROOT)"
else
  step "imports: FAILED (nbaccel, ipykernel, jupyter_client, dill, pytest-timeout)"
  FAILED=1
fi
"$PY" bench/gpu_report.py --env >"$DIR/env.json" || step "env: FAILED to collect"
cat "$DIR/env.json"

if [ "$TESTS" = 1 ]; then
  rm -f "$DIR/gpu_tests.xml"
  require=1
  [ "$SMOKE" = 1 ] && require=0  # on a CPU machine the GPU tests skip, as they should
  # SIGINT first: pytest then still writes the JUnit XML of the tests that ran
  NBACCEL_REQUIRE_GPU=$require OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} \
    timeout -s INT -k 30 "$TEST_BUDGET" \
    "$PY" -m pytest -m gpu tests/gpu -v -rA -p no:cacheprovider \
    --junitxml="$DIR/gpu_tests.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$DIR/gpu_tests.log"
  code=${PIPESTATUS[0]}
  echo "$code" >"$DIR/gpu_tests.exit"
  how="pytest exit $code, NBACCEL_REQUIRE_GPU=$require"
  if [ "$code" = 0 ]; then step "tests: ok ($how)"; else step "tests: FAILED ($how)"; FAILED=1; fi
fi

if [ "$BENCH" = 1 ]; then
  rm -f "$DIR/gpu_bench.md" "$DIR/gpu_bench.json"
  smoke=()
  [ "$SMOKE" = 1 ] && smoke=(--smoke)
  [ -n "${GPU_BENCH_ONLY:-}" ] && smoke+=(--only "$GPU_BENCH_ONLY")
  timeout -s INT -k 30 "$BENCH_BUDGET" "$PY" bench/gpu.py --out "$DIR" "${smoke[@]}"
  code=$?
  if [ "$code" = 0 ]; then step "bench: ok"; else step "bench: FAILED (exit $code)"; FAILED=1; fi
fi

if [ "$MESH" = 1 ]; then
  # 4 CPU processes over gloo: one GPU cannot hold several NCCL ranks, but the lent
  # machine's 16 idle cores give steadier figures than a shared 2-core box
  rm -f "$DIR/mesh_bench.md"
  mesh=(--steps "${GPU_MESH_STEPS:-30}")
  [ "$SMOKE" = 1 ] && mesh=(--steps 2 --layouts tp_fsdp)
  OMP_NUM_THREADS=1 timeout -s INT -k 30 "${GPU_MESH_BUDGET:-480}" \
    "$PY" bench/mesh_parallel.py "${mesh[@]}" --out "$DIR/mesh_bench.md"
  code=$?
  if [ "$code" = 0 ]; then step "mesh bench: ok"; else step "mesh bench: FAILED (exit $code)"; FAILED=1; fi
fi

if [ "$CLUSTER" = 1 ]; then
  rm -f "$DIR/cluster_check.json"
  cluster=(--out "$DIR")
  [ "$SMOKE" = 1 ] && cluster+=(--smoke)
  timeout -s INT -k 30 "${GPU_CLUSTER_BUDGET:-300}" "$PY" scripts/gpu_cluster_check.py "${cluster[@]}"
  code=$?
  said=$("$PY" -c "import json, sys; r = json.load(open(sys.argv[1]))
print(r['status'] + (': ' + r['why'] if r.get('why') else ''))" "$DIR/cluster_check.json" 2>/dev/null)
  if [ "$code" = 0 ]; then step "cluster: ${said:-ok}"
  else step "cluster: FAILED (exit $code${said:+; $said})"; FAILED=1; fi
fi

"$PY" bench/gpu_report.py --dir "$DIR" || FAILED=1
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  for f in REPORT.md report.json gpu_bench.md gpu_bench.json gpu_tests.xml gpu_tests.log env.json \
      mesh_bench.md cluster_check.json; do
    [ -f "$DIR/$f" ] && cp "$DIR/$f" "$OUT/"
  done
fi
echo "== report: $DIR/REPORT.md"
tail -n 40 "$DIR/REPORT.md"
exit "$FAILED"
