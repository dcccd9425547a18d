"""Regenerates the committed Python stubs of serving/proto/stratum/v1/stratum.proto with grpc_tools.protoc.

    python serving/proto/regenerate.py            # rewrite the committed stubs
    python serving/proto/regenerate.py --out DIR  # write them under DIR instead (the drift test does this)

protoc writes `from stratum.v1 import stratum_pb2`, an import that only works with serving/proto on
sys.path; the stubs are rewritten to import through the package, `serving.proto.stratum.v1`.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent      # serving/proto: protoc's include root
PROTO = pathlib.Path("stratum/v1/stratum.proto")           # relative to PROTO_ROOT, as protoc names it
GENERATED = ("stratum_pb2.py", "stratum_pb2.pyi", "stratum_pb2_grpc.py")
PACKAGE = "serving.proto.stratum.v1"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc into out_root (which mirrors serving/proto) and returns the generated files."""
    from grpc_tools import protoc   # a dev dependency: imported here so the module loads without it

    include = pathlib.Path(protoc.__file__).parent / "_proto"   # google/protobuf/*.proto
    out_root.mkdir(parents=True, exist_ok=True)
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(PROTO),
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO} (exit {rc})")
    out_dir = out_root / PROTO.parent
    files = [out_dir / name for name in GENERATED]
    for path in files:
        text = path.read_text()
        text = re.sub(r"^from stratum\.v1 import ", f"from {PACKAGE} import ", text, flags=re.M)
        path.write_text(text)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_ROOT,
                        help="root to write stratum/v1/*.py under (default: serving/proto itself)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
