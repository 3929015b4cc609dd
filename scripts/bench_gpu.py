"""Benchmark on one accelerator, with the packages at hand (no environment is created): issue 28's item 5.

One timed call is one whole update (`scripts/bench_peers.py`'s workers: bfloat16 compute, float32 parameters,
corrections with recompute, the completion half of every row trained), ``--rows`` x ``--length`` tokens:

* ``--compare`` (qwen2-0.5b): Tether against google-tunix, alternated in two worker processes that share the device
  (``--memory-fraction`` each), if this interpreter can import tunix; else Tether alone.
* ``--mfu`` (llama-1b): Tether alone (``--mfu-memory-fraction``); model-FLOPs utilisation = model FLOPs per second over
the bfloat16 matmul peak
  measured by the same worker (``--peak-size``). Model FLOPs per update: tokens x (6N + 12·L·H·Dh·T) for the training
  pass plus tokens x (2N + 4·L·H·Dh·T) for the recompute pass, N the matmul parameters including the output head.

Every worker reports its device's peak memory in use. Results go to ``--out`` as ``bench_gpu.json`` and a Markdown
table (also printed). On the CPU it runs at tiny shapes (what tests/test_bench_gpu.py checks):

    python scripts/bench_gpu.py --out bench_out                                                # on a GPU
    python scripts/bench_gpu.py --compare tiny --mfu tiny --rows 2 --length 64 --peak-size 256 --rounds 1 --calls 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_peers import Case, Worker, alternate, completion_length, worker_env  # noqa: E402


def model_flops(model: str, rows: int, length: int) -> float:
    """Model FLOPs of one update with a recompute pass (the issue's formula; PaLM's convention)."""
    from learner.model.transformer import model_config

    config = model_config(model)
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    per_layer = d * config.num_heads * config.head_dim * 2 + d * config.num_kv_heads * config.head_dim * 2 + 3 * d * f
    n = config.num_layers * per_layer + d * v  # matmul parameters, the output head included
    attention = config.num_layers * config.num_heads * config.head_dim * length
    tokens = rows * length
    return tokens * (6 * n + 12 * attention) + tokens * (2 * n + 4 * attention)


def tether_case(model: str, args) -> Case:
    return Case(model, args.rows, args.length, recompute=True, dtype="bfloat16")


def timings(worker_seconds: list[float], rows: int, length: int) -> dict:
    median = statistics.median(worker_seconds)
    return {"median_s": median, "tokens_per_s": rows * length / median, "seconds": worker_seconds}


def compare(args, env: dict) -> dict:
    """Tether vs tunix (if importable) at ``args.compare``, alternated."""
    case = tether_case(args.compare, args)
    names = ["tether"] + (["tunix"] if importlib.util.find_spec("tunix") else [])
    workers = {}
    try:
        for name in names:
            workers[name] = Worker(name, pathlib.Path(sys.executable), case, env)
        seconds = alternate(workers, f"time {args.calls}", args.rounds)
        memory = {name: worker.ask("memory")["peak_bytes"] for name, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    row = {"case": case.label, "params": workers["tether"].ready["params"]}
    for name in names:
        row[name] = {**timings(seconds[name], case.rows, case.length), "peak_bytes": memory[name],
                     "first_call_s": workers[name].ready["first_call_s"], "params": workers[name].ready["params"]}
    row["ratio"] = row["tether"]["tokens_per_s"] / row["tunix"]["tokens_per_s"] if "tunix" in row else None
    return row


def mfu(args, env: dict) -> dict:
    """Tether alone at ``args.mfu``: tokens/s, model TFLOP/s, the measured bfloat16 peak, their ratio, memory."""
    case = tether_case(args.mfu, args)
    worker = Worker("tether", pathlib.Path(sys.executable), case, env)
    try:
        seconds = alternate({"tether": worker}, f"time {args.calls}", args.rounds)["tether"]
        memory = worker.ask("memory")["peak_bytes"]
        peak = worker.ask(f"peak {args.peak_size}")["tflops"]
    finally:
        worker.close()
    row = {"case": case.label, "params": worker.ready["params"], **timings(seconds, case.rows, case.length),
           "first_call_s": worker.ready["first_call_s"], "peak_bytes": memory, "peak_tflops": peak,
           "scored_tokens_per_row": completion_length(case.length)}
    row["model_tflops"] = model_flops(case.model, case.rows, case.length) / row["median_s"] / 1e12
    row["mfu"] = row["model_tflops"] / peak
    return row


def gib(value) -> str:
    return "n/a" if value is None else f"{value / 2**30:.1f}"


def table(results: dict) -> str:
    lines = []
    if "compare" in results:
        row = results["compare"]
        t, u = row["tether"], row.get("tunix")
        lines += ["| case | Tether tokens/s | tunix tokens/s | ratio | Tether peak GiB | tunix peak GiB |",
                  "|---|---|---|---|---|---|",
                  f"| {row['case']} | {t['tokens_per_s']:,.0f} ({t['median_s']:.3f} s) | "
                  + (f"{u['tokens_per_s']:,.0f} ({u['median_s']:.3f} s) | **{row['ratio']:.2f}x** | "
                     if u else "tunix not importable | - | ")
                  + f"{gib(t['peak_bytes'])} | {gib(u['peak_bytes']) if u else '-'} |", ""]
    if "mfu" in results:
        row = results["mfu"]
        lines += ["| case | tokens/s | model TFLOP/s | bf16 matmul peak TFLOP/s | MFU | peak GiB |",
                  "|---|---|---|---|---|---|",
                  f"| {row['case']} | {row['tokens_per_s']:,.0f} ({row['median_s']:.3f} s) | "
                  f"{row['model_tflops']:.1f} | {row['peak_tflops']:.1f} | **{row['mfu']:.1%}** | "
                  f"{gib(row['peak_bytes'])} |"]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", default="qwen2-0.5b", help="model shape of Tether vs tunix ('' skips)")
    parser.add_argument("--mfu", default="llama-1b", help="model shape of the MFU measurement ('' skips)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="alternated turns per worker")
    parser.add_argument("--calls", type=int, default=3, help="timed updates per turn")
    parser.add_argument("--peak-size", type=int, default=8192, help="N of the N x N bfloat16 matmul peak")
    parser.add_argument("--memory-fraction", type=float, default=0.45,
                        help="each comparing worker's share of the accelerator's memory (two share one device)")
    parser.add_argument("--mfu-memory-fraction", type=float, default=0.9,
                        help="the MFU worker's share (it runs alone)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."), help="where results are written")
    args = parser.parse_args(argv)
    results = {}
    if args.compare:
        results["compare"] = compare(args, worker_env(memory_fraction=args.memory_fraction))
    if args.mfu:
        results["mfu"] = mfu(args, worker_env(memory_fraction=args.mfu_memory_fraction))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gpu.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (args.out / "bench_gpu.md").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
