"""What a run reports: metrics writers, plots, the progress line, the rollout log, and a full disk told once; the
files it writes under run_dir are never written through a link (`run_files`).

No face: import the module you need (`learner.reporting.metrics_writers`, `learner.reporting.plots`, ...).
"""
