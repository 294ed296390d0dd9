#!/usr/bin/env bash
# Runs admission_test.py in a venv with cel-python from PyPI (created once, kept in the build
# tree). Without PyPI the test is skipped (exit 77), saying why: the policy's CEL is then unchecked.
# usage: admission_test.sh VENV DEPLOY_DIR
set -uo pipefail
venv=$1
deploy=$2
here=$(cd "$(dirname "$0")" && pwd)
pins=(cel-python==0.5.0 google-re2==1.1.20251105 jmespath==1.1.0 lark==1.3.1 pendulum==3.3.0
      python-dateutil==4.0.0 PyYAML==6.0.4 tzdata==2026.6)
if ! "$venv/bin/python" -c 'import celpy, yaml' 2>/dev/null; then
  rm -rf "$venv"
  if ! out=$(python3 -m venv "$venv" 2>&1 && "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      --no-input --timeout 30 "${pins[@]}" 2>&1); then
    echo "SKIPPED: cannot make a venv with cel-python (python3-venv and PyPI are needed): $(tail -3 <<<"$out")"
    exit 77
  fi
fi
exec "$venv/bin/python" "$here/admission_test.py" "$deploy"
