"""One process of a two-process JAX distributed system that prints, as JSON, the index it reads before any backend
starts and the memory budget `configure_learner` gives it for the default config (tests/learner/rl/test_devices.py)."""

import json
import sys

from jax._src import xla_bridge

from learner.distributed import initialize, process_index_before_backends
from learner.rl import load_config
from learner.rl.devices import MEMORY_FRACTION_ENV, configure_learner

if __name__ == "__main__":
    coordinator, process_id = sys.argv[1], int(sys.argv[2])
    initialize(coordinator, num_processes=2, process_id=process_id)
    index = process_index_before_backends()
    environ: dict[str, str] = {}
    configure_learner(load_config(None), environ, process_index=index)
    print(json.dumps({"index": index, "budget": environ.get(MEMORY_FRACTION_ENV),
                      "backends_started": bool(xla_bridge._backends)}), flush=True)
