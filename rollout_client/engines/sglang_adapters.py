"""LoRA adapters loaded into an SGLang engine over smg's SGLang proto, each under an id the caller mints.

A request served by an adapter names it in ``GenerateRequest.lora_id``. smg's servicer hands that string to SGLang's
scheduler as its internal adapter id (``TokenizedGenerateReqInput.lora_id``), the key under which SGLang's
``LoRAManager`` holds the adapter; it does not resolve names. SGLang's HTTP ``/load_lora_adapter`` cannot serve such
a request: it mints that id itself (``uuid4().hex``), ignores one in the body and answers only names and paths. The
smg proto's own ``SglangScheduler.LoadLoRAAdapter`` takes the id from the caller ("Required: the scheduler-direct
path has no TokenizerManager to auto-generate one, and inference requests reference the adapter by this id"), on the
same server as the requests. `SGLangAdapters` uses that RPC and its ``UnloadLoRAAdapter`` and
``ListLoadedLoRAAdapters``. Sources (read, not run) are cited in docs/lora.md.

smg-grpc-servicer 0.14.1, the servicer ``sglang serve --grpc-mode`` runs, does not implement these three RPCs: it
answers UNIMPLEMENTED, and `SGLangAdapters` raises an error that says so and names the fix.
"""

from __future__ import annotations

import grpc
from smg_grpc_proto import sglang_scheduler_pb2

from rollout_client.engines.http_control import ControlPlaneError
from rollout_client.engines.smg.client import SmgClient

__all__ = ["SGLangAdapters"]

_UNIMPLEMENTED_FIX = ("it does not implement smg's LoRA RPCs (smg-grpc-servicer 0.14.1, which `sglang serve "
                      "--grpc-mode` runs, answers UNIMPLEMENTED): publish merged weights instead "
                      "(model.lora.publish='merged'; SGLangEngine(publish_adapters=False))")


class SGLangAdapters:
    """``LoadLoRAAdapter``, ``UnloadLoRAAdapter`` and ``ListLoadedLoRAAdapters`` of one SGLang engine.

    Args:
      client: the engine's smg client (its gRPC channel and credentials).
      address: the engine's address, for error messages.
    """

    def __init__(self, client: SmgClient, address: str):
        self.client = client
        self.address = address

    def loaded(self) -> dict[str, str]:
        """The adapters the engine holds: id -> name (``ListLoadedLoRAAdapters``).

        Raises:
          ControlPlaneError: the engine does not implement the RPC (with the fix), or it failed.
        """
        reply = self._call("ListLoadedLoRAAdapters", sglang_scheduler_pb2.ListLoadedLoRAAdaptersRequest())
        return {adapter.lora_id: adapter.lora_name for adapter in reply.loaded_adapters}

    def load(self, lora_name: str, lora_path: str, lora_id: str) -> None:
        """Loads the PEFT adapter directory ``lora_path`` as ``lora_name`` under the id ``lora_id``, which requests
        then name in ``GenerateRequest.lora_id``.

        Raises:
          ControlPlaneError: ``success`` false (with the engine's message), the RPC not implemented (with the fix) or
            failed.
        """
        reply = self._call("LoadLoRAAdapter", sglang_scheduler_pb2.LoadLoRAAdapterRequest(
            lora_name=lora_name, lora_path=lora_path, pinned=False, lora_id=lora_id))
        self._check(reply, "LoadLoRAAdapter", lora_name)

    def unload(self, lora_name: str, lora_id: str) -> None:
        """Unloads the adapter loaded as ``lora_name`` under ``lora_id`` (the proto asks for both).

        Raises:
          ControlPlaneError: ``success`` false (with the engine's message), the RPC not implemented or failed.
        """
        reply = self._call("UnloadLoRAAdapter", sglang_scheduler_pb2.UnloadLoRAAdapterRequest(
            lora_name=lora_name, lora_id=lora_id))
        self._check(reply, "UnloadLoRAAdapter", lora_name)

    def _check(self, reply, method: str, lora_name: str) -> None:
        if not reply.success:
            raise ControlPlaneError(f"{method} {lora_name!r} at the SGLang engine {self.address}: "
                                    f"{reply.message or 'success: false, no message'}")

    def _call(self, method: str, request):
        try:
            return self.client.engine_rpc(method, request)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ControlPlaneError(f"SglangScheduler.{method} at the SGLang engine {self.address}: "
                                        f"{_UNIMPLEMENTED_FIX}") from error
            raise ControlPlaneError(f"SglangScheduler.{method} at the SGLang engine {self.address}: "
                                    f"{error.code().name}: {error.details()}") from error
