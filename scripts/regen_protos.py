"""Regenerates the committed rollout.v1 Python stubs from rollout.proto.

Run from anywhere: ``python scripts/regen_protos.py``. With ``--out-dir DIR`` the
stubs are written under DIR instead (the staleness test compares those with the
committed ones). Protos are compiled with the repository root as include path, so
the stubs import each other as ``rollout_client.proto.rollout.v1``.
"""

import argparse
import pathlib
import sys

from grpc_tools import protoc

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_FILES = ("rollout_client/proto/rollout/v1/rollout.proto",)


def regenerate(out_dir: pathlib.Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for PROTO_FILES under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in PROTO_FILES:
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(REPO_ROOT / proto),
        ]
        if protoc.main(args) != 0:
            sys.exit(f"protoc failed on {proto}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=REPO_ROOT)
    regenerate(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()
