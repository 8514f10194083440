"""Process-group setup for torchrun, srun, mpirun or a single process, a watchdog that ends the
step when a rank dies or freezes, and rank helpers.

import ddpkit

with ddpkit.init() as dist:            # torchrun, srun, or plain python: same code
    ddpkit.seed_everything(1234, dist.rank)
    model = ddpkit.wrap_ddp(model, dist)   # or ddpkit.shard_model(model, dist, blocks="layers")
    ...
    if dist.any_rank(time_is_up):       # every rank stops at the same step
        break
"""

import warnings

with warnings.catch_warnings():
    # numpy is optional for ddpkit, but torch warns "Failed to initialize NumPy" on import
    # without it (issue 17). Scoped to this import: the caller's filters are left as they are.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401

from ddpkit.determinism import (  # noqa: E402
    CUBLAS_DETERMINISTIC,
    Determinism,
    attention_kernel,
    attention_nondeterminism,
    set_determinism,
)
from ddpkit.dist import (  # noqa: E402
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    Dist,
    InitOptions,
    init,
    is_peer_failure,
)
from ddpkit.env import (  # noqa: E402
    DistInfo,
    Launcher,
    detect,
    fallback_ports,
    master_port_for_job,
)
from ddpkit.errors import DistConfigError, InitInterrupted, PeerError  # noqa: E402
from ddpkit.faults import EXIT_PEER_LOST, FAULT_FILE_ENV, Fault  # noqa: E402
from ddpkit.fsdp import (  # noqa: E402
    ShardOptions,
    checkpoint_activations,
    copy_whole_,
    fill_shards,
    full_value,
    is_sharded,
    local_part,
    no_sync,
    shard_model,
)
from ddpkit.hostlist import expand_hostlist, first_host, parse_tasks_per_node  # noqa: E402
from ddpkit.model import clean_state_dict, unwrap, wrap_ddp  # noqa: E402
from ddpkit.ranklog import (  # noqa: E402
    RankLogging,
    RankZeroFilter,
    current_rank,
    rank_zero_only,
    setup_logging,
)
from ddpkit.rng import (  # noqa: E402
    RngRestored,
    capture_rng,
    reseed_rng,
    restore_rng,
    rng_state,
    set_rng_state,
)
from ddpkit.seed import seed_everything  # noqa: E402
from ddpkit.watchdog import WatchdogOptions  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CUBLAS_DETERMINISTIC",
    "DEFAULT_TIMEOUT_S",
    "EXIT_PEER_LOST",
    "FAULT_FILE_ENV",
    "TIMEOUT_ENV",
    "Determinism",
    "Dist",
    "DistConfigError",
    "DistInfo",
    "Fault",
    "InitInterrupted",
    "InitOptions",
    "Launcher",
    "PeerError",
    "RankLogging",
    "RankZeroFilter",
    "RngRestored",
    "ShardOptions",
    "WatchdogOptions",
    "attention_kernel",
    "attention_nondeterminism",
    "capture_rng",
    "checkpoint_activations",
    "clean_state_dict",
    "copy_whole_",
    "current_rank",
    "detect",
    "expand_hostlist",
    "fallback_ports",
    "fill_shards",
    "first_host",
    "full_value",
    "init",
    "is_peer_failure",
    "is_sharded",
    "local_part",
    "master_port_for_job",
    "no_sync",
    "parse_tasks_per_node",
    "rank_zero_only",
    "reseed_rng",
    "restore_rng",
    "rng_state",
    "seed_everything",
    "set_determinism",
    "set_rng_state",
    "setup_logging",
    "shard_model",
    "unwrap",
    "wrap_ddp",
]
