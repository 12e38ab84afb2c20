# Sourced by the device benchmark scripts: the wheels carried in .whl/ (the GPU image has no internet) installed
# into /tmp/site, ahead of the image's own packages, and the environment every run there shares.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
