#!/usr/bin/env bash
# Build molora's wheel, install it into a fresh venv (torch pinned to the tested version first, then the wheel
# with no extras, plus the openai client) and serve a tiny model with vLLM's flags from it, outside the checkout.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" wheel -q --no-deps -w "$work/dist" "$repo"
"$work/venv/bin/pip" install -q "$work"/dist/molora-*.whl openai
cp "$repo/tools/wheel_smoke.py" "$work/"
cd "$work"
"$work/venv/bin/python" -I -c "import molora, sys; print('molora from', molora.__file__); sys.exit('molora' in molora.__file__ and '$repo' in molora.__file__)"
"$work/venv/bin/python" -I wheel_smoke.py "$work"
