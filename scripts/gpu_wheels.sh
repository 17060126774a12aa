#!/usr/bin/env bash
# Fill .gpu-wheels/ (gitignored) with the wheels a bare GPU machine without network needs
# for nbaccel, tests/gpu and bench/gpu.py, so that scripts/gpu_check.sh can install them
# there offline. Run it on a machine that reaches PyPI (this one), then carry the folder:
#   device run: command="bash scripts/gpu_check.sh", carry=[".gpu-wheels"]
#
# What is carried: the resolved closure of REQUIREMENTS for the GPU image's Python
# (GPU_PY_VERSION, default 3.12) on manylinux x86_64, minus the compiled packages the
# image already has (scripts/gpu_image_packages.txt, from the device docs' KINDS.md);
# pure-Python wheels are carried even when the image has the package, in case its
# version is too old. torch itself is never carried: the image's CUDA build is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${GPU_PY_VERSION:-3.12}
# torchao 0.17.0 is the release built for torch 2.11, the image's torch (fp8 training).
TORCHAO=${GPU_TORCHAO_VERSION:-0.17.0}
OUT=${GPU_WHEELS_DIR:-.gpu-wheels}
LIMIT_MB=${GPU_WHEELS_LIMIT_MB:-40}
PIP=(${PIP:-python3 -m pip})
REQUIREMENTS=(
  # nbaccel's own dependencies (setup.cfg), torch excepted
  safetensors pyyaml numpy psutil "dill>=0.3.8" tqdm
  # a real kernel for tests/gpu and bench/gpu.py (tests/kernel_harness.py)
  "ipykernel>=6" "jupyter_client>=8"
  # the test runner
  "pytest>=8" "pytest-timeout>=2.3"
  # fp8 training (nbaccel's mixed_precision="fp8")
  "torchao==${TORCHAO}"
  # DeepSpeed's own dependencies that the image lacks (tests/gpu/test_gpu_deepspeed.py);
  # deepspeed itself is a source distribution: built into a wheel below
  hjson "pydantic>=2"
)
# The optional `deepspeed` extra, built here (pure Python; its ops are JIT-built on use).
DEEPSPEED=${GPU_DEEPSPEED_VERSION:-0.19.8}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "resolving for Python ${PY_VERSION} (manylinux x86_64): ${REQUIREMENTS[*]}"
"${PIP[@]}" install --dry-run --ignore-installed --quiet --report "$work/report.json" \
  --python-version "$PY_VERSION" "${PLATFORMS[@]}" --only-binary=:all: \
  --target "$work/target" "${REQUIREMENTS[@]}"

python3 - "$work/report.json" scripts/gpu_image_packages.txt >"$work/carry.txt" <<'EOF'
import json, re, sys

def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()

report = json.load(open(sys.argv[1]))
image = {canon(line.strip()) for line in open(sys.argv[2]) if line.strip() and not line.startswith("#")}
for item in report["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    url = item["download_info"]["url"]
    pure = url.endswith("-none-any.whl")
    if canon(name) == "torch":
        continue
    if canon(name) in image and not pure:
        print(f"# skip {name}=={version}: compiled, already in the image", file=sys.stderr)
        continue
    print(f"{name}=={version}")
EOF

rm -rf "$OUT"
mkdir -p "$OUT"
"${PIP[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  "${PLATFORMS[@]}" -d "$OUT" -r "$work/carry.txt"
"${PIP[@]}" wheel --quiet --no-deps --no-build-isolation -w "$OUT" "deepspeed==${DEEPSPEED}"
# What gpu_check.sh installs (pip resolves the rest from the folder and the image).
printf '%s\n' "${REQUIREMENTS[@]}" "deepspeed==${DEEPSPEED}" | grep -v '^#' >"$OUT/requirements.txt"
cp "$work/carry.txt" "$OUT/carried.txt"
size_mb=$(du -sm "$OUT" | cut -f1)
ls -1 "$OUT"/*.whl | wc -l | xargs echo "wheels:"
echo "wrote $OUT (${size_mb} MiB, limit ${LIMIT_MB} MiB)"
if [ "$size_mb" -gt "$LIMIT_MB" ]; then
  echo "error: $OUT is ${size_mb} MiB > ${LIMIT_MB} MiB; the device tool carries 64 MiB in all" >&2
  exit 1
fi
