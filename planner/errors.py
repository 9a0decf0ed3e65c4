"""User-facing errors: each carries the exit code the CLI returns for it.

Every error raised for bad input names the file, op or field at fault and says what
to do, so the CLI can print one line and exit without a traceback.
"""

from __future__ import annotations


class ShardplanError(Exception):
    """Bad input or an impossible request (CLI exit code 2)."""

    exit_code = 2


class ModelError(ShardplanError):
    """The ONNX file cannot be read or planned (missing, corrupt, unbound dims, ...)."""


class ProfileError(ShardplanError):
    """A hardware profile is unknown or malformed, or cannot form the requested cluster."""


class StrategyError(ShardplanError):
    """A user-given or stored strategy does not fit the op, the tensor or the mesh."""


class PlanFileError(ShardplanError):
    """A strategy JSON file is unreadable, of another schema version, or inconsistent."""


class NoPlanFits(ShardplanError):
    """No plan fits the device memory limit (CLI exit code 3)."""

    exit_code = 3


class RunFailed(ShardplanError):
    """A training run's rank failed, died or stopped answering (CLI exit code 4); every
    rank the run started has been stopped."""

    exit_code = 4


class SignalInterrupt(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while ranks ran: raised in the launcher, as SIGINT raises
    KeyboardInterrupt, so that it stops its ranks (CLI exit code 128 + the signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
