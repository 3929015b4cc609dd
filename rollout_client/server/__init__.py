"""The reference inference server's shell: gRPC service, scheduler, network settings; engines plug in.

``python -m rollout_client.server`` serves the scripted engine; the learner's model generator is `learner.serving`.
"""
