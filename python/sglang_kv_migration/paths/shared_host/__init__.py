"""The shared-host path: into the target's host pool, which it keeps in memory a
same-host source maps (`peer_pools.py`), written from the source's GPU or host pool at
memory speed; see `path.py`."""
