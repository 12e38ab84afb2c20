# Sourced by scripts/ab/drive.sh on the lent GPU, from the repo root: scripts/device_site.sh's logic (the carried
# wheels installed into /tmp/site, ahead of the image's packages; the shared environment), plus the Realtime
# case's serve/client wheels from .whl/rt/ when that folder was carried. Installs once per machine (a marker in
# /tmp/site), so a later call on the same warm machine skips it.
want=$(ls .whl/*.whl .whl/rt/*.whl 2>/dev/null | sort | tr '\n' ' ')
if [ -n "$want" ] && [ "$(cat /tmp/site/.ab-wheels 2>/dev/null)" != "$want" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $want \
    || { echo "site.sh: pip install of the carried wheels failed" >&2; return 1 2>/dev/null || exit 1; }
  echo "$want" > /tmp/site/.ab-wheels
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# PYTHONPATH is set per tree by drive.sh (/tmp/site first, then the tree being measured)
