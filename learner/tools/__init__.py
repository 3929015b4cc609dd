"""Command-line tools around a run, each a module run with ``python -m learner.tools.NAME`` (``--help`` says more).

- `check_rollout_logprobs`: each logged token's rollout logprob against the checkpoint of the version that drew it.
- `recompute_diagnostics`: the off-policy corrections' diagnostics of every logged batch, offline.
- `make_hf_tiny`: the tiny random Qwen2 checkpoint and dataset that ``configs/hf_tiny.toml`` trains on.
- `make_gsm8k_tiny`: the ~17M-parameter checkpoint and GSM8K-shaped data of ``configs/gsm8k_cpu.toml``.

A top floor beside `learner.train` and `learner.export`: nothing else in `learner` imports it.
"""
