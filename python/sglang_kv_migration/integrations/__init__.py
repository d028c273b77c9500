"""What RL frameworks load as they are, by configuration: the model gateway's pinning
(`gateway.py`), verl's plugin entry point (`verl_plugin.py`, loads SGLang's plugins in verl's
server actors in time) and a verl load balancer that re-pins sticky sessions with their KV
(`verl_balancer.py`).

Imports without SGLang (and without verl): nothing here imports `server/` or `paths/`;
the balancer moves KV over HTTP with `client/` and prices moves with `rollout/`.
"""
