"""The engines a run talks to: the `Engine` interface and its backends, the pool over them, and engine processes.

`Engine` (`base`) declares `EngineCapabilities`; `check_capabilities` refuses a run an engine cannot honour.
Backends: `tether` (rollout.v1), `mlx` (the MLX servicer over its smg proto, restarted to publish), `sglang` and
`vllm` (their smg protos, weights loaded through their HTTP control planes, `http_control`; SGLang adapters over
smg's LoRA RPCs, `sglang_adapters`). `smg` is the smg engines' data plane, `weight_dirs` the weight folders they load.
`pool` spreads requests over several engines and survives engines that die; `process` runs an engine's server as a
child process (`child` is that child's entry point). The public names are re-exported by `rollout_client`.
"""
