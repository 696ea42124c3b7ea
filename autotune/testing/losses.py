"""The first steps' losses of one workload under several configs, as trials build and step them,
for the test that sharding trains the same model as DDP.

    torchrun --nproc-per-node 2 -m autotune.testing.losses OUT.json WORKLOAD STEPS CONFIG_JSON...

joins one process group, then for each config (a ``Config``'s dict form) builds the trial
(``trial.bench.build``: the same model, seed, data order, DDP or FSDP2 and accumulation a trial
measures) and runs ``STEPS`` optimizer steps; rank 0 writes each config's per-step losses,
averaged over the ranks, to OUT.json, with what the build applied.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from autotune.config.knobs import Config
from autotune.trial.bench.ranks import Ranks
from autotune.trial.spec import TrialSpec, WorkloadSpec


class _Joined(Ranks):
    """Ranks that join the process group once and stay in it for every config."""

    def start(self, device: Any) -> str | None:
        import torch.distributed as dist

        if self.world > 1 and not dist.is_initialized():
            return super().start(device)
        return "gloo" if self.world > 1 else None


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from autotune.trial.bench.build import build
    from autotune.trial.bench.device import Memory
    from autotune.trial.shard import model_state

    out, workload, steps, configs = argv[0], argv[1], int(argv[2]), argv[3:]
    name, _, params = workload.partition(":")
    ranks, device = _Joined(), torch.device("cpu")
    found = []
    for text in configs:
        spec = TrialSpec(WorkloadSpec(name, json.loads(params or "{}")),
                         Config.from_dict(json.loads(text)))
        result: dict[str, Any] = {}
        trainer = build(spec, device, ranks, result, Memory(device))  # type: ignore[arg-type]
        trainer.losses = []
        per_step = []
        for _ in range(steps):
            trainer.step()
            loss = torch.stack(trainer.losses).sum().double()
            trainer.losses.clear()
            if ranks.world > 1:
                dist.all_reduce(loss)
            per_step.append(float(loss) / ranks.world)
        result["applied"]["model_state"] = model_state(trainer.module, trainer.optimizer)
        found.append({"config": json.loads(text), "losses": per_step,
                      "applied": result.get("applied", {}), "ddp": result.get("ddp")})
    if ranks.reports:
        with open(out, "w") as f:
            json.dump(found, f)
    if ranks.world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
