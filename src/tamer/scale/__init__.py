"""Past one process: Ray rollout workers, a torch.distributed learner, off-policy-by-k training.

Everything here is opt-in; with the defaults (`scale.rollout_workers: 0`, `scale.learner_ranks: 1`,
`rl.max_staleness: 0`) a run is the single-process loop, unchanged.

    tamer train --set scale.rollout_workers=2 --set scale.learner_ranks=2     # local Ray + torchrun
    tamer train --set scale.ray_address=auto ...                              # join a Ray cluster

Pieces (docs/scaling.md):

* `ScaleConfig` (`tamer.scale.config`): the `scale:` section of a run's config.
* `Learner` / `DistributedLearner` (`tamer.scale.learner`): single | ddp | fsdp2. The trainer calls
  it for the loss denominators (all-reduced), the module the loss runs through, each rank's rows
  and the full state dicts of checkpoints.
* `RayRollout` (`tamer.scale.ray_rollout`): `Rollout.run`'s interface over N Ray actors.
* `launch` (`tamer.scale.launch`): `tamer train` starts the learner ranks with torchrun.

Ray is imported only by `ray_rollout` and only when rollout workers are asked for (`pip install
"tamer[scale]"`); torch.distributed ships with torch.
"""

from tamer.scale.config import LEARNER_STRATEGIES, ScaleConfig

__all__ = ["LEARNER_STRATEGIES", "ScaleConfig"]
