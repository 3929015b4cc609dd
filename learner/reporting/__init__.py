"""What a run reports: metrics writers, plots, the progress line, the rollout log, and a full disk told once.

No face: import the module you need (`learner.reporting.metrics_writers`, `learner.reporting.plots`, ...).
"""
