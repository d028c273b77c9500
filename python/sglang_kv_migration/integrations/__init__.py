"""What RL frameworks load as they are: the model gateway's pinning (`gateway.py`), and
adapters for frameworks that route by themselves. Imports without SGLang."""
