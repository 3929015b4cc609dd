"""Stand-ins for SGLang and vLLM, for protocol-conformance tests: real servers on 127.0.0.1, fake model.

Neither engine runs on this CPU, so the tests drive Tether's backends against:

- a gRPC server implementing the servicer base classes generated from ``smg-grpc-proto`` (the same package the
  client uses), streaming as smg's servicers do: one ``chunk`` per step with the new tokens (SGLang: every
  ``stream_interval`` tokens; vLLM: every token), then a ``complete`` that repeats the last chunk's tokens;
  ``index`` per sample of ``n``; an aborted request ends with ``finish_reason="abort"``;
- an HTTP server (stdlib) with the engine's control endpoints and their documented request and response bodies.

Both share one `FakeEngine`: the model, the loaded weights, the pause state, and a record of every request
(``generate_requests``, ``abort_requests``, ``http_calls``) for the tests to assert on.

The model: sample ``index`` of prompt ``p`` at step ``t`` is `token` (a function of ``sum(p)``, ``t``, ``index``
and the loaded weights' ``offset``), with logprob `logprob`; the tests compute both independently.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.server
import json
import pathlib
import shutil
import threading
import time
import urllib.parse

import grpc
from smg_grpc_proto import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc

VOCAB = 64
EOS = VOCAB - 1
MAX_CONTEXT = 96
WEIGHTS_FILE = "fake_weights.json"  # what the tests' checkpoint writer writes and the fake engine loads


def token(prompt_sum: int, step: int, index: int, offset: int) -> int:
    """The fake model's token (never EOS: a sample stops by length unless asked to stop at a token it samples)."""
    return (prompt_sum * 5 + step * 7 + index * 11 + offset * 3) % (VOCAB - 1)


def logprob(step: int, index: int) -> float:
    """The fake model's logprob of its token (exact in float32)."""
    return -0.5 - 0.25 * step - 0.125 * index


@dataclasses.dataclass
class FakeEngine:
    """The engine state both servers share."""

    offset: int = 0  # the loaded weights (from WEIGHTS_FILE)
    weight_version: str = "default"
    hold_after: int | None = None  # a request stops after this many tokens until it is aborted
    step_delay_s: float = 0.0  # each token takes this long (a slow engine)
    fail: dict = dataclasses.field(default_factory=dict)  # HTTP path -> (status, body) to answer instead;
    #   "ListLoadedLoRAAdapters" -> True: that RPC lists nothing (a faulty engine)
    legacy_version_endpoint: bool = False  # SGLang: 404 on /model_info, answer /get_weight_version
    generate_requests: list = dataclasses.field(default_factory=list)
    abort_requests: list = dataclasses.field(default_factory=list)
    http_calls: list = dataclasses.field(default_factory=list)  # (method, path, query, body)
    lora_adapters: dict = dataclasses.field(default_factory=dict)  # served LoRA adapters: name -> path
    lora_ids: dict = dataclasses.field(default_factory=dict)  # SGLang: name -> the caller-minted id it was loaded under
    lora_rpcs: bool = True  # SGLang: False answers the LoRA RPCs UNIMPLEMENTED, as smg-grpc-servicer 0.14.1 does
    lora_calls: list = dataclasses.field(default_factory=list)  # SGLang: (RPC name, request) of each LoRA RPC

    def __post_init__(self):
        self.lock = threading.Lock()
        self.resumed = threading.Event()
        self.resumed.set()
        self.aborted: dict[str, threading.Event] = {}  # running request id -> set when aborted
        self.holding = threading.Event()  # set when a request stops at hold_after

    def abort(self, request_ids) -> None:
        with self.lock:
            for request_id, event in self.aborted.items():
                if any(request_id.startswith(prefix) for prefix in request_ids):  # SGLang matches by prefix
                    event.set()

    def abort_all(self) -> None:
        self.abort([""])

    def load(self, model_path: str) -> None:
        self.offset = json.loads((pathlib.Path(model_path) / WEIGHTS_FILE).read_text())["offset"]

    def samples(self, request_id: str, prompt: list[int], n: int, max_new_tokens: int, stops: set[int]):
        """Yields (index, token, logprob) step by step, then (index, None, finish_reason) per sample."""
        self.resumed.wait(timeout=30)
        aborted = self.aborted.setdefault(request_id, threading.Event())
        try:
            for index in range(n):
                finish = "length"
                for step in range(max_new_tokens):
                    if self.hold_after is not None and step == self.hold_after:
                        self.holding.set()
                        aborted.wait(timeout=30)
                    if aborted.is_set():
                        finish = "abort"
                        break
                    time.sleep(self.step_delay_s)
                    sampled = token(sum(prompt), step, index, self.offset)
                    yield index, sampled, logprob(step, index)
                    if sampled in stops:
                        finish = "stop"
                        break
                yield index, None, finish
        finally:
            with self.lock:
                self.aborted.pop(request_id, None)


def _chunks(engine: FakeEngine, request_id, prompt, n, max_new_tokens, stops, interval):
    """(index, delta token ids, delta logprobs, finish reason or None) as smg's servicers stream them."""
    pending: dict[int, tuple[list, list]] = {}
    for index, sampled, value in engine.samples(request_id, prompt, n, max_new_tokens, stops):
        tokens, logprobs = pending.setdefault(index, ([], []))
        if sampled is None:
            yield index, tokens, logprobs, value
            pending.pop(index)
            continue
        tokens.append(sampled)
        logprobs.append(value)
        if len(tokens) == interval:
            yield index, tokens, logprobs, None
            pending[index] = ([], [])


class FakeSglangScheduler(sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
    """``sglang.grpc.scheduler.SglangScheduler`` over `FakeEngine`."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def Generate(self, request, context):
        self.engine.generate_requests.append(request)
        if request.lora_id and request.lora_id not in self.engine.lora_ids.values():  # an id, never a name
            context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter is loaded under id {request.lora_id!r}")
        params = request.sampling_params
        stops = set() if params.ignore_eos else {*params.stop_token_ids, EOS}
        interval = params.stream_interval if params.HasField("stream_interval") else 1
        last = {}
        for index, tokens, logprobs, finish in _chunks(self.engine, request.request_id,
                                                       list(request.tokenized.input_ids), max(params.n, 1),
                                                       params.max_new_tokens, stops, interval):
            out = sglang_scheduler_pb2.OutputLogProbs(token_logprobs=logprobs, token_ids=tokens)
            yield sglang_scheduler_pb2.GenerateResponse(request_id=request.request_id, chunk=(
                sglang_scheduler_pb2.GenerateStreamChunk(token_ids=tokens, output_logprobs=out, index=index)))
            last[index] = (tokens, out)
            if finish is not None:
                yield sglang_scheduler_pb2.GenerateResponse(request_id=request.request_id, complete=(
                    sglang_scheduler_pb2.GenerateComplete(output_ids=tokens, output_logprobs=out, finish_reason=finish,
                                                          index=index)))

    def Abort(self, request, context):
        self.engine.abort_requests.append(request)
        self.engine.abort([request.request_id])
        return sglang_scheduler_pb2.AbortResponse(success=True)

    def HealthCheck(self, request, context):
        return sglang_scheduler_pb2.HealthCheckResponse(healthy=True)

    def GetModelInfo(self, request, context):
        return sglang_scheduler_pb2.GetModelInfoResponse(
            vocab_size=VOCAB, max_context_length=MAX_CONTEXT, eos_token_ids=[EOS], model_type="llama",
            architectures=["LlamaForCausalLM"], weight_version=self.engine.weight_version, is_generation=True)

    # The LoRA RPCs as ``sglang_scheduler.proto`` documents them (smg-grpc-proto 0.4.28): the caller mints the id
    # (``LoadLoRAAdapterRequest.lora_id``, required), requests name it (``GenerateRequest.lora_id``), replies list
    # every loaded id; a name already loaded is refused as SGLang's ``LoRAManager.validate_new_adapter`` refuses it.

    def LoadLoRAAdapter(self, request, context):
        self.engine.lora_calls.append(("LoadLoRAAdapter", request))
        if not self.engine.lora_rpcs:
            return super().LoadLoRAAdapter(request, context)
        engine = self.engine
        error = _lora_load_error(engine, request.lora_name, request.lora_path)
        if not request.lora_id:
            error = "lora_id is required: the scheduler-direct path has no TokenizerManager to mint one"
        elif request.lora_name in engine.lora_adapters:
            error = f"Failed to load LoRA adapter {request.lora_name} because it is already loaded"
        if error is None:
            engine.lora_adapters[request.lora_name] = request.lora_path
            engine.lora_ids[request.lora_name] = request.lora_id
        return sglang_scheduler_pb2.LoadLoRAAdapterResponse(success=error is None, message=error or "",
                                                            loaded_lora_ids=list(engine.lora_ids.values()))

    def UnloadLoRAAdapter(self, request, context):
        self.engine.lora_calls.append(("UnloadLoRAAdapter", request))
        if not self.engine.lora_rpcs:
            return super().UnloadLoRAAdapter(request, context)
        engine = self.engine
        error = None
        if engine.lora_ids.get(request.lora_name) != request.lora_id or not request.lora_id:
            error = f"no LoRA adapter {request.lora_name!r} is loaded under id {request.lora_id!r}"
        else:
            del engine.lora_adapters[request.lora_name], engine.lora_ids[request.lora_name]
        return sglang_scheduler_pb2.UnloadLoRAAdapterResponse(success=error is None, message=error or "",
                                                              loaded_lora_ids=list(engine.lora_ids.values()))

    def ListLoadedLoRAAdapters(self, request, context):
        self.engine.lora_calls.append(("ListLoadedLoRAAdapters", request))
        if not self.engine.lora_rpcs:
            return super().ListLoadedLoRAAdapters(request, context)
        if self.engine.fail.get("ListLoadedLoRAAdapters"):  # a faulty engine: lists nothing
            return sglang_scheduler_pb2.ListLoadedLoRAAdaptersResponse()
        return sglang_scheduler_pb2.ListLoadedLoRAAdaptersResponse(loaded_adapters=[
            sglang_scheduler_pb2.LoadedLoRAAdapter(lora_id=lora_id, lora_name=name,
                                                   lora_path=self.engine.lora_adapters[name])
            for name, lora_id in self.engine.lora_ids.items()])


class FakeVllmEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """``vllm.grpc.engine.VllmEngine`` over `FakeEngine` (logprobs only when ``logprobs`` is set, as vLLM)."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def Generate(self, request, context):
        self.engine.generate_requests.append(request)
        params = request.sampling_params
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
        for index, tokens, logprobs, finish in _chunks(self.engine, request.request_id,
                                                       list(request.tokenized.input_ids), max(params.n, 1),
                                                       params.max_tokens, stops, 1):
            out = (vllm_engine_pb2.OutputLogProbs(token_logprobs=logprobs, token_ids=tokens)
                   if params.HasField("logprobs") else None)
            yield vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                token_ids=tokens, output_logprobs=out, completion_tokens=len(tokens), index=index))
            if finish is not None:
                yield vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
                    output_ids=tokens, output_logprobs=out, finish_reason=finish, index=index))

    def Abort(self, request, context):
        self.engine.abort_requests.append(request)
        self.engine.abort(list(request.request_ids))
        return vllm_engine_pb2.AbortResponse()

    def HealthCheck(self, request, context):
        return vllm_engine_pb2.HealthCheckResponse(healthy=True)

    def GetModelInfo(self, request, context):
        return vllm_engine_pb2.GetModelInfoResponse(
            vocab_size=VOCAB, max_context_length=MAX_CONTEXT, eos_token_ids=[EOS], model_type="llama",
            architectures=["LlamaForCausalLM"], is_generation=True)


def sglang_http_routes(engine: FakeEngine):
    """SGLang's endpoints (``http_server.py``): (method, path) -> handler(query, body) -> (status, reply)."""
    def pause(query, body):
        if body.get("mode") not in ("abort", "retract", "in_place"):
            return 400, {"object": "error", "message": f"Invalid mode: {body.get('mode')!r}", "type": "Bad Request",
                         "code": 400}
        engine.resumed.clear()
        if body["mode"] == "abort":
            engine.abort_all()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def update(query, body):
        try:
            engine.load(body["model_path"])
        except OSError as error:
            return 400, {"success": False, "message": f"Failed to update weights: {error}", "num_paused_requests": 0}
        if body.get("weight_version") is not None:
            engine.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def resume(query, body):
        engine.resumed.set()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def model_info(query, body):
        if engine.legacy_version_endpoint:
            return 404, {"detail": "Not Found"}
        return 200, {"model_path": "/fake", "is_generation": True, "weight_version": engine.weight_version}

    def legacy_version(query, body):
        return 200, {"weight_version": engine.weight_version}

    return {("POST", "/pause_generation"): pause, ("POST", "/update_weights_from_disk"): update,
            ("POST", "/continue_generation"): resume, ("GET", "/model_info"): model_info,
            ("GET", "/get_weight_version"): legacy_version}


def _lora_load_error(engine: FakeEngine, name: str | None, path: str | None) -> str | None:
    """Why the engines refuse to load an adapter for its name and path alone (both required; a PEFT adapter
    directory at the path)."""
    if not name or not path:
        return "Both 'lora_name' and 'lora_path' must be provided."
    if not (pathlib.Path(path) / "adapter_config.json").is_file():
        return f"Loading lora {name} failed: No adapter found for {path}"
    return None


def vllm_http_routes(engine: FakeEngine):
    """vLLM's endpoints (``serve/rlhf/api_router.py``, ``serve/dev/rpc/api_router.py``)."""
    def pause(query, body):
        mode = query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return 400, {"error": f"Invalid pause mode: {mode}"}
        engine.resumed.clear()
        if mode == "abort":
            engine.abort_all()
        return 200, {"status": "paused"}

    def collective_rpc(query, body):
        if body.get("method") != "reload_weights":
            return 400, {"detail": f"unknown method {body.get('method')}"}
        try:
            engine.load(body["kwargs"]["weights_path"])
        except OSError as error:
            return 500, {"error": f"reload_weights failed: {error}"}
        return 200, {"results": [None]}

    def resume(query, body):
        engine.resumed.set()
        return 200, {"status": "resumed"}

    def is_paused(query, body):
        return 200, {"is_paused": not engine.resumed.is_set()}

    def load_lora(query, body):  # vLLM 0.33.0 OpenAIServingModels.load_lora_adapter: a text, or an ErrorResponse
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return 400, _vllm_error(400, "InvalidUserInput", _lora_load_error(engine, name, path))
        if name in engine.lora_adapters and not body.get("load_inplace"):
            return 400, _vllm_error(400, "InvalidUserInput", (
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set "
                "'load_inplace' to True."))
        error = _lora_load_error(engine, name, path)
        if error:
            return 404, _vllm_error(404, "NotFoundError", error)
        engine.lora_adapters[name] = path
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora(query, body):
        name = body.get("lora_name")
        if engine.lora_adapters.pop(name, None) is None:
            return 404, _vllm_error(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    return {("POST", "/pause"): pause, ("POST", "/collective_rpc"): collective_rpc, ("POST", "/resume"): resume,
            ("GET", "/is_paused"): is_paused, ("POST", "/v1/load_lora_adapter"): load_lora,
            ("POST", "/v1/unload_lora_adapter"): unload_lora}


def _vllm_error(code: int, kind: str, message: str) -> dict:
    """vLLM's ``ErrorResponse`` body (``{"error": {"message", "type", "param", "code"}}``)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class ControlServer:
    """A stdlib HTTP server on 127.0.0.1:``port`` (0: a free one) answering ``routes`` (recording each call in
    ``engine.http_calls``)."""

    def __init__(self, engine: FakeEngine, routes, port: int = 0):
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, method):
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                engine.http_calls.append((method, url.path, query, body))
                handler = routes.get((method, url.path))
                status, reply = engine.fail.get(url.path) or (
                    handler(query, body) if handler else (404, {"detail": "Not Found"}))
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeServers:
    """A fake engine served over gRPC (``servicer_class``) and HTTP (``routes``) on 127.0.0.1 (ports 0: free ones)."""

    def __init__(self, servicer_class, add_servicer, routes, grpc_port: int = 0, http_port: int = 0,
                 engine: FakeEngine | None = None):
        self._kind = (servicer_class, add_servicer, routes)
        self.engine = FakeEngine() if engine is None else engine
        self.grpc = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16))
        add_servicer(servicer_class(self.engine), self.grpc)
        self.target = f"127.0.0.1:{self.grpc.add_insecure_port(f'127.0.0.1:{grpc_port}')}"
        self.grpc.start()
        self.http = ControlServer(self.engine, routes(self.engine), http_port)

    def started_again(self, **state) -> FakeServers:
        """The engine (these servers, stopped) started again by its operator: new servers on the same ports, serving
        the start-up weights (a fresh `FakeEngine`: offset 0, no adapters; ``state``: its other fields)."""
        return FakeServers(*self._kind, grpc_port=int(self.target.rsplit(":", 1)[1]),
                           http_port=self.http.server.server_address[1], engine=FakeEngine(**state))

    def reset(self) -> FakeEngine:
        """A fresh engine state for the next test (same servers)."""
        fresh = FakeEngine()
        for name in ("offset", "weight_version", "hold_after", "step_delay_s", "fail", "legacy_version_endpoint",
                     "generate_requests", "abort_requests", "http_calls", "lora_adapters", "lora_ids", "lora_rpcs",
                     "lora_calls"):
            setattr(self.engine, name, getattr(fresh, name))
        self.engine.resumed.set()
        self.engine.holding.clear()
        return self.engine

    def stop(self) -> None:
        self.engine.abort_all()
        self.engine.resumed.set()
        self.http.stop()
        self.grpc.stop(grace=None)


def sglang_servers() -> FakeServers:
    return FakeServers(FakeSglangScheduler, sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server,
                       sglang_http_routes)


def vllm_servers() -> FakeServers:
    return FakeServers(FakeVllmEngine, vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server, vllm_http_routes)


def write_fake_checkpoint(directory: pathlib.Path, weights) -> None:
    """The tests' checkpoint writer (a `rollout_client.engines.weight_dirs.CheckpointWriter`):
    ``{"offset": weights["offset"]}`` as WEIGHTS_FILE, written to a temporary directory and renamed into place,
    replacing one there (a retried publish writes the same version again), as the learner's writer does."""
    directory = pathlib.Path(directory)
    temporary, replaced = directory.with_name(f".{directory.name}.tmp"), directory.with_name(f".{directory.name}.old")
    temporary.mkdir(parents=True)
    (temporary / WEIGHTS_FILE).write_text(json.dumps({"offset": int(weights["offset"])}))
    if directory.exists():
        directory.rename(replaced)
    temporary.rename(directory)
    shutil.rmtree(replaced, ignore_errors=True)
