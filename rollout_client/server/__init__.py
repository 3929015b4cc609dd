"""The reference inference server: ``python -m rollout_client.server``."""
