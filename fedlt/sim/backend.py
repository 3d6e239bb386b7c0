"""Where the simulator runs each silo's local work: in this process, one silo after another (`serial`), or
as Ray tasks on a Ray cluster (`ray`), many at once.

A job is a module-level function of (method, global state, the silo's data, the silo's job) and returns what
the silo would send. The privacy layer's sums and the server step stay in the driver whichever backend runs
the jobs, and every job's randomness comes from (seed, round, silo), so both backends give the same bits for
the same seed and the same torch thread count (torch's reductions are ordered by its threads, so `threads`
decides the bits too). On Ray each silo's data is put in the object store once per run, the state and the
method once per round; a task whose worker or node dies is run again by Ray (`max_retries`), from the same
inputs, so it returns the same result; a task that raises stops the round, and the run resumes from its last
checkpoint as after a crash.
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedlt.config import setting
from fedlt.data.arrays import LabeledData
from fedlt.errors import FedltError
from fedlt.methods import GlobalState, Method

# what a job does with one silo: (method, state, the silo's data, the job's own argument) -> the result
Job = Callable[[Method, GlobalState, LabeledData, Any], Any]
CONNECT_SECONDS = 10
RETRIES = 3  # a task whose worker or node dies is run again this often before the round fails


@dataclass(frozen=True)
class BackendConfig:
    """`[sim]`: where each silo's local work runs. It never changes a run's identity (its fingerprint): a run
    may resume on another backend, bit for bit at the same `threads`."""

    backend: str = setting("serial", choices=("serial", "ray"), doc="serial: one process; ray: a Ray cluster")
    address: str = setting(
        "", doc='ray: the cluster to join ("auto": the one `ray start` runs here); empty: start a local one'
    )
    threads: int = setting(
        0, ge=0, le=256, doc="torch threads for each silo's work; 0: torch's default (serial), 1 (ray)"
    )
    workers: int = setting(
        0, ge=0, le=4096, doc="ray, local cluster: silos at once; 0: one per core / threads"
    )

    def threads_per_silo(self) -> int:
        return self.threads or (1 if self.backend == "ray" else torch.get_num_threads())


class BackendUnavailable(FedltError):
    """The configured backend cannot run here (Ray not installed, or its cluster not reachable)."""


class Backend(Protocol):
    def submit(
        self, job: Job, method: Method, state: GlobalState, work: Sequence[tuple[str, Any]]
    ) -> Callable[[], list[Any]]:
        """`job` for each (silo id, argument) of `work`, begun now or when the returned call asks for the
        results, which come in the order of `work`."""
        ...

    def close(self) -> None: ...


class SerialBackend:
    """Every silo in this process, one after another: the reference the other backends must match."""

    def __init__(self, silos: Mapping[str, LabeledData], threads: int) -> None:
        self.silos, self.threads = silos, threads

    def submit(
        self, job: Job, method: Method, state: GlobalState, work: Sequence[tuple[str, Any]]
    ) -> Callable[[], list[Any]]:
        """Run when the results are asked for: one silo after another, in the order a serial run has always
        had (a round's evaluation first, then the next round's silos)."""

        def results() -> list[Any]:
            with torch_threads(self.threads):
                return [job(method, state, self.silos[silo_id], arg) for silo_id, arg in work]

        return results

    def close(self) -> None:
        pass


class RayBackend:
    """One Ray task per silo and job, `threads` CPUs each; the data travels to the object store once."""

    def __init__(self, silos: Mapping[str, LabeledData], config: BackendConfig) -> None:
        ray, self._started = join_cluster(config)
        self._ray = ray
        _tensors_as_arrays(ray)  # for the results this process reads
        self.threads = config.threads_per_silo()
        self._silos = {silo_id: ray.put(silo) for silo_id, silo in silos.items()}
        self._task = ray.remote(_run_job).options(num_cpus=self.threads, max_retries=RETRIES)

    def submit(
        self, job: Job, method: Method, state: GlobalState, work: Sequence[tuple[str, Any]]
    ) -> Callable[[], list[Any]]:
        """Begun now, so that the workers train while the driver evaluates the round before."""
        # in a list, so that Ray passes the reference and each worker reads the object once (`_shared`)
        shared = [self._ray.put((job, method, state, self.threads))]
        refs = [self._task.remote(shared, self._silos[silo_id], arg) for silo_id, arg in work]
        return lambda: self._ray.get(refs)

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()


@contextmanager
def open_backend(config: BackendConfig, silos: Mapping[str, LabeledData]) -> Iterator[Backend]:
    """The configured backend for these silos, closed (a local Ray cluster stopped) when the run ends."""
    on_ray = config.backend == "ray"
    backend = RayBackend(silos, config) if on_ray else SerialBackend(silos, config.threads_per_silo())
    try:
        yield backend
    finally:
        backend.close()


def _run_job(shared: list[Any], silo: LabeledData, arg: Any) -> Any:
    """A Ray task's body. Ray hands numpy arrays over read-only, from shared memory; a silo's job may write
    to its arrays as in a silo process, so it gets its own copy (the data's bytes, once a round)."""
    import ray

    _tensors_as_arrays(ray)  # for what this worker reads and returns
    job, method, state, threads = _shared(shared[0])
    silo = dataclasses.replace(silo, x=silo.x.copy(), y=silo.y.copy())
    with torch_threads(threads):
        return job(method, state, silo, arg)


_SHARED: dict[str, Any] = {}  # in a Ray worker: the round's job, method and state, by object id
_REGISTERED: set[int] = set()  # processes whose Ray serializes tensors as NumPy arrays


def _tensors_as_arrays(ray: Any) -> None:
    """Ray moves NumPy arrays out of band, but pickles a torch tensor through torch's own reduction, three to
    five times slower here: ten 13 MB results took 0.33–0.40 s against 0.06–0.13 s as arrays. A CPU
    tensor travels as its array (a copy on arrival: Ray's arrays are read-only); others as torch pickles
    them. Values and dtypes are kept; storage shared between tensors and `requires_grad` are not, which
    no silo's result or state relies on. Registered once per process (Ray's registry is per process)."""
    if os.getpid() in _REGISTERED:
        return
    ray.util.register_serializer(torch.Tensor, serializer=_tensor_out, deserializer=_tensor_in)
    _REGISTERED.add(os.getpid())


def _tensor_out(tensor: torch.Tensor) -> tuple[str, Any]:
    if tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.dtype in _NUMPY_DTYPES:
        return "array", tensor.detach().resolve_conj().resolve_neg().numpy()
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return "torch", buffer.getvalue()


def _tensor_in(form: tuple[str, Any]) -> torch.Tensor:
    kind, value = form
    if kind == "array":
        return torch.from_numpy(value.copy())
    return torch.load(io.BytesIO(value), weights_only=True)


_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
}


def _shared(ref: Any) -> Any:
    """The round's shared inputs, read from the object store once per worker process rather than once per
    task (a state of millions of numbers is copied out of it on every read)."""
    key = ref.hex()
    if key not in _SHARED:
        import ray

        _SHARED.clear()
        _SHARED[key] = ray.get(ref)
    return _SHARED[key]


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set for a block, and put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def join_cluster(config: BackendConfig) -> tuple[Any, bool]:
    """The `ray` module, connected as `config` says unless this process already is, and whether it was
    connected here (and should be shut down by the caller)."""
    ray = _import_ray()
    if ray.is_initialized():
        return ray, False
    _connect(ray, config)
    return ray, True


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise BackendUnavailable(
            "sim.backend = 'ray' needs Ray, which is not installed: pip install 'fedlt[ray]' "
            "(or run with the serial backend)"
        ) from None
    return ray


def _connect(ray: Any, config: BackendConfig) -> None:
    """Join the configured cluster, or start a local one with `workers` silos' worth of CPUs."""
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    try:
        if config.address:
            _check_reachable(config.address)
            ray.init(address=config.address, **quiet)
        else:
            cpus = (config.workers or max(1, (os.cpu_count() or 1) // config.threads_per_silo())) * (
                config.threads_per_silo()
            )
            ray.init(address="local", num_cpus=cpus, **quiet)  # a new one, even where `ray start` runs one
    except ConnectionError as exc:
        raise BackendUnavailable(f"no Ray cluster at {config.address!r}: {exc}") from None


def _check_reachable(address: str) -> None:
    """A head node's `host:port` answers, or a clear error now: Ray itself keeps trying for minutes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return  # "auto", or a ray:// client address: Ray's own errors say what is wrong
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        raise BackendUnavailable(f"no Ray head node answers at {address}: {exc}") from None
