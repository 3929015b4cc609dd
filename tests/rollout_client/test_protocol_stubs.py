"""The committed stubs equal what scripts/regen_protos.py generates now."""

import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
STUB_DIR = pathlib.Path("rollout_client/proto/rollout/v1")


def test_committed_stubs_match_regenerated(tmp_path):
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts/regen_protos.py"), "--out-dir", str(tmp_path)],
                   check=True, timeout=60)
    generated = sorted(path.name for path in (tmp_path / STUB_DIR).iterdir())
    assert generated == ["rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py"]
    for name in generated:
        assert (tmp_path / STUB_DIR / name).read_text() == (REPO_ROOT / STUB_DIR / name).read_text(), (
            f"{STUB_DIR / name} is stale: run python scripts/regen_protos.py")
