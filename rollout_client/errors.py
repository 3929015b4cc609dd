"""Errors the client raises; each message says what failed and where."""


class RolloutError(Exception):
    """Base class of the client's errors."""


class ServerNotReadyError(RolloutError, TimeoutError):
    """The server did not report SERVING within the start-up timeout."""


class RolloutDeadlineError(RolloutError, TimeoutError):
    """A call ran past its deadline."""


class RolloutUnavailableError(RolloutError):
    """The server stayed unreachable through every retry."""


class InvalidRolloutError(RolloutError):
    """A sample failed validation and the client is configured to fail, not drop."""


class ProtocolError(RolloutError):
    """The server broke the protocol (e.g. ended a stream with samples missing)."""


class ServerSilentError(RolloutDeadlineError):
    """A Generate stream sent nothing, not even a heartbeat, for the silence timeout, attempt after attempt: the
    server is hung (one that works sends heartbeats while it generates)."""


class EngineCallError(RolloutError):
    """An engine answered a call with an error status (or broke the protocol) that no retry mends; the message names
    the engine's address and the status."""


class PolicyVersionError(RolloutError, RuntimeError):
    """The engine serves a policy version the learner cannot publish over (versions must increase); the message
    names the fix."""
