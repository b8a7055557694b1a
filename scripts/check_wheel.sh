#!/usr/bin/env bash
# Packaging check, run once by `make test` (stamped): build moefuse's wheel the way pip builds it
# for a user (isolated build with the build-system requirements of pyproject.toml), fail on any
# setuptools deprecation warning, install the wheel with --no-deps into a throwaway virtual
# environment, and use it from there: import moefuse, run a reference op, run the `moefuse`
# console script. The throwaway environment borrows torch / triton / numpy from the project's
# venv (a .pth line: nothing big is downloaded) and never sees the source tree or the editable
# install (.pth files inside a borrowed folder are not processed).
# Usage: bash scripts/check_wheel.sh [VENV]   (default .venv)
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the comment block above
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY="$VENV/bin/python"
work=$(mktemp -d "${TMPDIR:-/tmp}/moefuse-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "check_wheel: building the wheel"
if ! "$PY" -m pip wheel -v --no-deps . -w "$work/dist" >"$work/build.log" 2>&1; then
    tail -40 "$work/build.log"
    echo "check_wheel: FAILED: the wheel does not build" >&2
    exit 1
fi
if grep -n -i "deprecat\|BuildBackendWarning" "$work/build.log"; then
    echo "check_wheel: FAILED: the build warns about deprecated configuration (above)" >&2
    exit 1
fi
wheel=$(ls "$work"/dist/moefuse-*.whl)

"$PY" -m venv --without-pip "$work/venv"
site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" >"$site/_borrowed_from_project_venv.pth"
"$PY" -m pip --python "$work/venv/bin/python" install -q --no-deps --no-index "$wheel"

cd "$work"  # away from the source tree
"$work/venv/bin/python" - "$wheel" "$work/venv" <<'EOF'
import sys
import zipfile

import torch

import moefuse

wheel, venv = sys.argv[1], sys.argv[2]
names = zipfile.ZipFile(wheel).namelist()
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE not in the wheel"
assert not any(n.startswith("tests/") for n in names), "tests packaged"
assert moefuse.__file__.startswith(venv), f"imported {moefuse.__file__}, not the wheel"
x = torch.randn(3, 64, dtype=torch.bfloat16)
w = torch.randn(64, dtype=torch.bfloat16)
y = moefuse.rmsnorm(x, w, impl="reference")
x32 = x.float()
expect = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()
assert (y.float() - expect.float()).abs().max().item() <= 2 ** -6 * expect.abs().max().item()
print(f"check_wheel: {wheel.rsplit('/', 1)[-1]} installs and runs (moefuse {moefuse.__version__}"
      f" from {moefuse.__file__})")
EOF
"$work/venv/bin/moefuse" env >"$work/env.txt" || { cat "$work/env.txt"; exit 1; }
grep -q "^versions: moefuse" "$work/env.txt"
echo "check_wheel: the moefuse console script runs"
