"""Process-group setup for torchrun, srun or a single process, and rank helpers.

import ddpkit

with ddpkit.init() as dist:            # torchrun, srun, or plain python: same code
    ddpkit.seed_everything(1234, dist.rank)
    model = ddpkit.wrap_ddp(model, dist)
    ...
    if dist.any_rank(time_is_up):       # every rank stops at the same step
        break
"""

from ddpkit.dist import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, Dist, InitOptions, init
from ddpkit.env import DistInfo, Launcher, detect, master_port_for_job
from ddpkit.errors import DistConfigError, PeerError
from ddpkit.hostlist import expand_hostlist, first_host, parse_tasks_per_node
from ddpkit.model import clean_state_dict, unwrap, wrap_ddp
from ddpkit.ranklog import RankZeroFilter, current_rank, rank_zero_only
from ddpkit.seed import seed_everything
from ddpkit.wandb_logger import MetricsLogger, WandbLogger

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "Dist",
    "DistConfigError",
    "DistInfo",
    "InitOptions",
    "Launcher",
    "MetricsLogger",
    "PeerError",
    "RankZeroFilter",
    "WandbLogger",
    "clean_state_dict",
    "current_rank",
    "detect",
    "expand_hostlist",
    "first_host",
    "init",
    "master_port_for_job",
    "parse_tasks_per_node",
    "rank_zero_only",
    "seed_everything",
    "unwrap",
    "wrap_ddp",
]
