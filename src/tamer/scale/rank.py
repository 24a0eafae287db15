"""One learner rank under torchrun: `python -m tamer.scale.rank SPEC.json`, started by
`tamer.scale.launch.launch_ranks` (see there): join the process group, run the RL job with a
`DistributedLearner`, and on rank 0 write the result the launching process reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from tamer.config import from_dict, import_plugins
from tamer.pipeline import RunConfig, rl_job
from tamer.scale.learner import init_distributed, make_learner
from tamer.stopping import TrainingStopped, graceful_stop
from tamer.storage import storage_errors, write_json


def rank_main(spec_path: str) -> int:
    """One rank's whole life; returns its exit status (128 + signal when stopped, as one process does)."""
    spec = json.loads(Path(spec_path).read_text())
    import_plugins(spec["config"].get("plugins") or ())
    config = from_dict(RunConfig, spec["config"])
    init_distributed(config.scale.dist_backend)
    learner = make_learner(config.scale.strategy)
    code = 0
    with graceful_stop(), storage_errors(config.output_dir):
        try:
            result = rl_job(config, resume=spec["resume"], initial_eval=spec["initial_eval"], learner=learner)
        except TrainingStopped as stop:
            result = {**stop.summary(), "signum": int(stop.signum)}
            code = stop.exit_code
    if learner.is_main:
        write_json(spec["result"], result)
    if code == 0:  # a finished run: every rank is alive (a stopped one may have lost a peer)
        # Rank 0 evaluates and saves last, alone: a rank that tore its process group down meanwhile
        # could abort in gloo's teardown (seen in CI: "terminate called without an active exception").
        dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1]))
