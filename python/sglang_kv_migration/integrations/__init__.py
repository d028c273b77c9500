"""What RL frameworks and operators run as they are, by configuration: the model
gateway's pinning (`gateway.py`), verl's plugin entry point (`verl_plugin.py`, loads
SGLang's plugins in verl's server actors in time), a verl load balancer that re-pins
sticky sessions with their KV (`verl_balancer.py`) and `sglang-kv-migrate rebalance`
(`rebalance_cli.py`: the rollout rebalancer from the shell, through the gateway when
given).

Imports without SGLang (and without verl): nothing here imports `server/` or `paths/`;
it stands on `client/` and `rollout/`, which never import it.
"""
