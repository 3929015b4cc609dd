"""Stands in for the embedded reference server: logs its device environment, then serves the scripted engine.

``python -m tests.support.env_reporting_server [learner.serving args]`` prints ``ENV {json}`` (the variables of
`REPORTED`) as its first log line; the model arguments are ignored, the network ones honoured.
"""

import json
import os

from rollout_client.server.__main__ import main as serve_scripted
from rollout_client.server.cli import server_parser

REPORTED = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "CUDA_VISIBLE_DEVICES")

if __name__ == "__main__":
    print("ENV " + json.dumps({name: os.environ.get(name) for name in REPORTED}), flush=True)
    shell, _ = server_parser("tests.support.env_reporting_server").parse_known_args()
    serve_scripted(["--host", shell.host, "--port", str(shell.port), "--port-file", str(shell.port_file)])
