"""Benchmark on one accelerator, with the packages at hand (no environment is created): issues 28 and 38.

One timed call is one whole update (`scripts/bench/peers.py`'s workers: bfloat16 compute, float32 parameters,
corrections with recompute, the completion half of every row trained), ``--rows`` x ``--length`` tokens:

* ``--compare`` (qwen2-0.5b): Tether against google-tunix, alternated in two worker processes that share the device
  (``--memory-fraction`` each), if this interpreter can import tunix; else Tether alone.
* ``--mfu`` (llama-1b): Tether alone (``--mfu-memory-fraction``). Model-FLOPs utilisation as the field reports it:
  model FLOPs per second over the card's spec dense-bf16 peak (`learner.reporting.mfu`: H100/H200 SXM 989 TFLOP/s, ...),
  with the rate of an ``--peak-size``^3 bfloat16 product measured by the same worker printed beside it as a check.
  Model FLOPs per update (PaLM's): tokens x (6N + 12·L·H·Dh·T) for the training pass, plus tokens x
  (2N + 4·L·H·Dh·T) when a proximal pass runs (not in the default one-epoch, one-mini-batch update, which takes its
  proximal logprobs from the training pass: ``--fuse-proximal off`` forces the pass).
* ``--variants`` (issue 38's studies): one more MFU worker per variant, each ``knob=value[,knob=value]`` over the
  Tether knobs below, e.g. ``remat=full`` ``attention=xla`` ``logprob_chunk_size=2048`` ``fuse_proximal=off``
  ``donate=state+batch``; a row each in the MFU table.

Tether's knobs (``--attention``, ``--remat``, ``--donate``, ``--logprob-chunk-size``, ``--fuse-proximal``) apply to
every Tether worker: `learner.model.attention` (``auto``: cuDNN flash attention on an NVIDIA GPU),
`learner.model.remat`, `learner.update.step.make_update_fn`'s ``donate``, ``UpdateConfig.logprob_chunk_size`` and
``.fuse_proximal``.

Every worker reports its device's peak memory in use. Results go to ``--out`` as ``bench_gpu.json`` and a Markdown
table (also printed). On the CPU it runs at tiny shapes (what tests/scripts/bench/test_gpu.py checks):

    python -m scripts.bench.gpu --out bench_out                                                # on a GPU
    python -m scripts.bench.gpu --compare "" --rows 2 --length 8192 --out bench_long           # B2 x T8192
    python -m scripts.bench.gpu --compare "" --variants remat=full remat=dots attention=xla --out bench_sweep
    python -m scripts.bench.gpu --compare tiny --mfu tiny --rows 2 --length 64 --peak-size 256 --rounds 1 --calls 1
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys

from learner.reporting.mfu import model_flops, spec_peak_tflops
from scripts.bench.common import write_json
from scripts.bench.peers import KNOB_DEFAULTS, Case, Worker, alternate, completion_length, worker_env


def tether_case(model: str, args, **knobs) -> Case:
    base = {name: getattr(args, name) for name in KNOB_DEFAULTS}
    return Case(model, args.rows, args.length, recompute=True, dtype="bfloat16", **(base | knobs))


def parse_variant(text: str) -> dict:
    """``"remat=full,logprob_chunk_size=2048"`` -> Case overrides, each value converted to its knob's type.

    Example:
        >>> parse_variant("remat=full,fuse_proximal=off,logprob_chunk_size=2048")
        {'remat': 'full', 'fuse_proximal': False, 'logprob_chunk_size': 2048}
    """
    knobs = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in KNOB_DEFAULTS or not value:
            raise SystemExit(f"error: variant {text!r}: {item!r} is not knob=value with a knob of "
                             f"{sorted(KNOB_DEFAULTS)}")
        default = KNOB_DEFAULTS[name]
        knobs[name] = (_on_off(value) if isinstance(default, bool) else type(default)(value))
    return knobs


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise SystemExit(f"error: {value!r} must be on or off")
    return value == "on"


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


def mfu(args, env: dict, **knobs) -> dict:
    """Tether alone at ``args.mfu`` (with ``knobs`` over the flags' values): tokens/s, model TFLOP/s, the spec peak
    and the measured bfloat16 product's rate, the utilisation against each, memory."""
    from learner.model.transformer import model_config

    case = tether_case(args.mfu, args, **knobs)
    worker = Worker("tether", pathlib.Path(sys.executable), case, env)
    try:
        seconds = alternate({"tether": worker}, f"time {args.calls}", args.rounds)["tether"]
        memory = worker.ask("memory")["peak_bytes"]
        product = worker.ask(f"peak {args.peak_size}")["tflops"]
    finally:
        worker.close()
    ready = worker.ready
    row = {"case": case.label, "knobs": {name: getattr(case, name) for name in KNOB_DEFAULTS},
           "params": ready["params"], **timings(seconds, case.rows, case.length),
           "first_call_s": ready["first_call_s"], "peak_bytes": memory, "device_kind": ready["device_kind"],
           "attention": ready["attention"], "proximal_pass": ready["proximal_pass"],
           "spec_tflops": spec_peak_tflops(ready["device_kind"]), "product_tflops": product,
           "product_size": args.peak_size, "scored_tokens_per_row": completion_length(case.length)}
    flops = model_flops(model_config(case.model), case.rows, case.length, recompute_pass=ready["proximal_pass"])
    row["model_tflops"] = flops / row["median_s"] / 1e12
    row["mfu"] = row["model_tflops"] / row["spec_tflops"] if row["spec_tflops"] else None
    row["of_product"] = row["model_tflops"] / product
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
    rows = ([results["mfu"]] if "mfu" in results else []) + results.get("variants", [])
    if rows:
        lines += ["| case | attention | tokens/s | model TFLOP/s | MFU (spec peak) | bf16 product TFLOP/s (of it) | "
                  "peak GiB | first call s |", "|---|---|---|---|---|---|---|---|"]
        for row in rows:
            if "error" in row:
                lines.append(f"| {row['case']} | failed: {row['error']} | | | | | | |")
                continue
            spec = (f"**{row['mfu']:.1%}** of {row['spec_tflops']:.0f}" if row["mfu"] is not None
                    else f"n/a (no spec peak for {row['device_kind']!r})")
            lines.append(f"| {row['case']} | {row['attention']} | {row['tokens_per_s']:,.0f} ({row['median_s']:.3f} s)"
                         f" | {row['model_tflops']:.1f} | {spec} | {row['product_tflops']:.1f} "
                         f"({row['product_size']}^3; {row['of_product']:.1%}) | {gib(row['peak_bytes'])} | "
                         f"{row['first_call_s']:.1f} |")
        kinds = sorted({row["device_kind"] for row in rows if "device_kind" in row})
        lines.append(f"\nModel FLOPs: PaLM's, a proximal pass counted where it runs; device: {', '.join(kinds)}.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.gpu", description=__doc__.splitlines()[0])
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
    parser.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"),
                        help="Tether's attention kernel (ModelConfig.attention)")
    parser.add_argument("--remat", default="none", help="Tether's block rematerialisation (ModelConfig.remat)")
    parser.add_argument("--donate", default="state", choices=("none", "state", "state+batch"),
                        help="buffers the update may reuse (make_update_fn's donate)")
    parser.add_argument("--logprob-chunk-size", type=int, default=512, help="UpdateConfig.logprob_chunk_size")
    parser.add_argument("--fuse-proximal", type=_on_off, default=True, metavar="{on,off}",
                        help="off: a proximal pass of its own even in the on-policy update")
    parser.add_argument("--variants", nargs="*", default=[], type=parse_variant, metavar="KNOB=VALUE[,...]",
                        help="more MFU workers at --mfu, each with these knobs changed")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."), help="where results are written")
    args = parser.parse_args(argv)
    if args.variants and not args.mfu:
        parser.error("--variants needs --mfu (the model they run)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    if args.compare:
        results["compare"] = compare(args, worker_env(memory_fraction=args.memory_fraction))
        write(results, args.out)
    mfu_env = worker_env(memory_fraction=args.mfu_memory_fraction)
    for index, knobs in enumerate([{}] + args.variants if args.mfu else []):
        # one failing worker (out of memory, a kernel refused) leaves the others' rows; every row is written at once
        try:
            row = mfu(args, mfu_env, **knobs)
        except (RuntimeError, OSError) as error:
            row = {"case": tether_case(args.mfu, args, **knobs).label, "error": f"{type(error).__name__}: {error}"}
        if index == 0:
            results["mfu"] = row
        else:
            results.setdefault("variants", []).append(row)
        write(results, args.out)
    print(table(results), flush=True)
    failed = [row["case"] for row in [results.get("mfu", {})] + results.get("variants", []) if "error" in row]
    if failed:
        sys.exit(f"error: these workers failed (their output is above): {failed}")


def write(results: dict, out: pathlib.Path) -> None:
    """``bench_gpu.json`` and the Markdown table ``bench_gpu.md`` of the results so far."""
    write_json(out / "bench_gpu.json", results)
    (out / "bench_gpu.md").write_text(table(results) + "\n")


if __name__ == "__main__":
    main()
