"""Exception types raised by nbaccel: every error a user may catch is importable from here.

Misuse raises ``ValueError``/``TypeError`` subclasses; a bad environment raises
``RuntimeError`` subclasses. Every message names the offending value and the fix.
A worker's own exception is re-raised in the kernel as a :class:`WorkerError` that is
also an instance of the original type (``except ValueError`` keeps working).

Example:
    >>> from nbaccel.errors import ConfigError
    >>> try:
    ...     raise ConfigError("num_processes=0 is invalid: pass an int >= 1")
    ... except ValueError as err:
    ...     print(type(err).__name__)
    ConfigError
"""

from __future__ import annotations


class NbaccelError(Exception):
    """Base class of every error nbaccel raises on purpose."""


class ConfigError(NbaccelError, ValueError):
    """A configuration value (argument, environment variable or YAML key) is invalid."""


class LaunchError(NbaccelError, RuntimeError):
    """Workers could not be started, could not rendezvous, or were lost."""


class Stopped(LaunchError):
    """The run (or pool call) was stopped with ``LaunchHandle.stop()``."""


class CheckpointError(NbaccelError, RuntimeError):
    """A file or directory is not a complete nbaccel checkpoint, or needs unsafe loading."""


class StorageError(NbaccelError, RuntimeError):
    """An object store named by a URL (``s3://``, ``gs://``...) cannot be used: its
    package is not installed, no package handles its scheme, or it cannot be reached."""


class SavePretrainedError(NbaccelError, RuntimeError):
    """``save_pretrained`` failed on the main process (the one that writes the files);
    raised on the other ranks, naming that error, instead of a barrier time-out."""


class CUDAInitializedError(LaunchError):
    """CUDA was initialised in this process before a fork-based launch.

    Forking a process whose CUDA driver is initialised gives children a broken
    CUDA context, so the launcher refuses *before* forking.
    """


class RanksMissingError(NbaccelError, RuntimeError):
    """An operation that needs every rank was entered by some ranks only (e.g. inside
    ``if accelerator.is_main_process:``); ``missing`` lists the ranks that did not come,
    when this rank knows them."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])

    def __reduce__(self):  # keep picklable across process boundaries
        return (type(self), (str(self), self.missing))


def too_few_gpus_error(processes: int, gpus: int) -> ConfigError:
    """The error for more NCCL processes on one machine than it has GPUs.

    Raised by the launcher's pre-flight check (before any process exists) and by the
    process state (torchrun, a script), instead of NCCL's later "Duplicate GPU detected".

    Example:
        >>> str(too_few_gpus_error(2, 1)).split(":")[0]
        'num_processes=2 but this machine has 1 visible GPU'
    """
    plural = "" if gpus == 1 else "s"
    return ConfigError(
        f"num_processes={processes} but this machine has {gpus} visible GPU{plural}: NCCL "
        "needs one GPU per process (two ranks on one GPU fail later with 'Duplicate GPU "
        f"detected'). Launch with num_processes <= {gpus}, or train on the CPU over gloo: "
        "notebook_launcher(..., config=LaunchConfig(compute_device='cpu')), "
        "NBACCEL_USE_CPU=1 or Accelerator(cpu=True)."
    )


def named_rank(
    rank: int, pid: int | None = None, node: str | None = None, *, with_pid: bool = False
) -> str:
    """How every message names a rank: a rank on another machine (a cluster's node) with its
    pid and node, one here by its number (``with_pid``: and its pid, as an error's headline).

    Example:
        >>> named_rank(1, 42, "node 10.0.0.3 (1a2b3c4d)")
        'rank 1 (pid 42 on node 10.0.0.3 (1a2b3c4d))'
        >>> named_rank(1, 42), named_rank(1, 42, with_pid=True)
        ('rank 1', 'rank 1 (pid 42)')
    """
    if node:
        return f"rank {rank} ({node})" if pid is None else f"rank {rank} (pid {pid} on {node})"
    return f"rank {rank} (pid {pid})" if with_pid else f"rank {rank}"


def named_ranks(
    ranks: list[int], pids: dict[int, int] | None = None, nodes: dict[int, str] | None = None
) -> str:
    """Several ranks, each as :func:`named_rank` names it, after one ``rank(s)``.

    Example:
        >>> named_ranks([0, 1]), named_ranks([1], {1: 7}, {1: "node 10.0.0.3 (1a2b3c4d)"})
        ('rank(s) 0, 1', 'rank(s) 1 (pid 7 on node 10.0.0.3 (1a2b3c4d))')
    """
    pids, nodes = pids or {}, nodes or {}
    each = (named_rank(r, pids.get(r), nodes.get(r)).removeprefix("rank ") for r in ranks)
    return "rank(s) " + (", ".join(each) or "none")


class WorkerError(LaunchError):
    """A worker process failed; carries the remote rank, pid and traceback.

    Args:
        rank: global rank of the failing worker.
        pid: its process id.
        exc_type: qualified name of the remote exception type.
        message: ``str()`` of the remote exception.
        remote_traceback: the formatted traceback text from the worker.
        node: where the worker ran when that is another machine (a cluster launch:
            ``"node <address> (<Ray node id>)"``); None on this machine.

    Attributes:
        exit_code: the worker's exit code (a script's own; 128 + N after signal N).
    """

    exit_code: int = 1

    def __init__(
        self,
        rank: int,
        pid: int | None,
        exc_type: str,
        message: str,
        remote_traceback: str = "",
        node: str | None = None,
    ) -> None:
        self.rank = rank
        self.pid = pid
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.node = node
        super().__init__(self._render())

    @property
    def where(self) -> str:
        """``pid 42``, or ``pid 42 on node 10.0.0.3 (1a2b3c4d)`` on a cluster."""
        return f"pid {self.pid}" + (f" on {self.node}" if self.node else "")

    def _render(self) -> str:
        who = named_rank(self.rank, self.pid, self.node, with_pid=True)
        head = f"{who} failed with {self.exc_type}: {self.message}"
        if self.remote_traceback:
            return f"{head}\n\nRemote traceback (rank {self.rank}):\n{self.remote_traceback}"
        return head

    def __reduce__(self):  # keep picklable across process boundaries
        return (
            type(self),
            (self.rank, self.pid, self.exc_type, self.message, self.remote_traceback, self.node),
        )


class WorkerTimeoutError(WorkerError):
    """Some ranks stopped making progress: a collective timed out or peers never finished.

    Attributes:
        stuck_ranks: ranks that were still running when the hang was declared.
        stacks: rank -> that worker's Python stack, or its traceback.
    """

    def __init__(
        self,
        stuck_ranks: list[int],
        stacks: dict[int, str],
        reason: str,
        pid: int | None = None,
        nodes: dict[int, str] | None = None,
        pids: dict[int, int] | None = None,
    ) -> None:
        self.stuck_ranks = list(stuck_ranks)
        self.stacks = dict(stacks)
        self.reason = reason
        self.nodes = dict(nodes or {})  # rank -> its node, on a cluster
        self.pids = dict(pids or {})  # rank -> its pid, said beside its node
        rank = self.stuck_ranks[0] if self.stuck_ranks else -1
        super().__init__(rank, pid, "Timeout", reason, "", self.nodes.get(rank))

    def _render(self) -> str:
        stuck = named_ranks(self.stuck_ranks, self.pids, self.nodes)
        parts = [f"{stuck} appear stuck: {self.reason}"]
        for rank in sorted(self.stacks):
            who = named_rank(rank, self.pids.get(rank), self.nodes.get(rank))
            parts.append(f"\n--- where {who} was ---\n{self.stacks[rank].rstrip()}")
        return "\n".join(parts)

    def __reduce__(self):
        args = (self.stuck_ranks, self.stacks, self.reason, self.pid, self.nodes, self.pids)
        return (type(self), args)


class Unreachable(NbaccelError, ConnectionError):
    """A cluster node could not open its connection to the kernel (no byte was exchanged):
    the rank's streams then travel through Ray instead.

    Example:
        >>> issubclass(Unreachable, ConnectionError)
        True
    """


__all__ = [
    "CUDAInitializedError",
    "CheckpointError",
    "ConfigError",
    "LaunchError",
    "NbaccelError",
    "RanksMissingError",
    "SavePretrainedError",
    "Stopped",
    "StorageError",
    "Unreachable",
    "WorkerError",
    "WorkerTimeoutError",
    "named_rank",
    "named_ranks",
    "too_few_gpus_error",
]
