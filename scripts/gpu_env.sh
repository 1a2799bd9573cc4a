# The preamble every scripts/gpu_*.sh sources (`source "$(dirname "$0")/gpu_env.sh"`): from the repository root, $OUT
# made, the carried wheels (.whl/*.whl, when there) installed into a temporary folder on PYTHONPATH after src, Python
# unbuffered, NVLink multicast off in NCCL (the lent hosts' rule), a warning when FASTDIFF_GIT_SHA (the sha results
# record) is unset, and $gpu: the first GPU's name in file-name form (nvidia-h100-80gb-hbm3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
site=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
fi
export PYTHONPATH="src:$site" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
[ -n "${FASTDIFF_GIT_SHA:-}" ] || echo "warning: FASTDIFF_GIT_SHA is unset: results record the sha of this copy's .git, which may not be the commit sent" >&2
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-')
