"""One host store per node, shared by the node's ranks through a file in shared memory.

In a multi-process run the decoder weights are frozen and identical on every rank, so the node's
local rank 0 (the *builder*) fills the RAM-placed layer blocks of its store into one file under
``/dev/shm`` (``DEG_HF_SHM_DIR`` elsewhere) and the node's other ranks map that file read-only: the
node holds the store once, whatever the number of ranks. Layers placed on disk are not in the file:
the layer cache is already one set of files per node.

The ranks find each other through torchrun's environment (``accelerate launch`` runs torchrun's
launcher, so it is the same): ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the run's identity
(``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR``/``MASTER_PORT``, ``GROUP_RANK`` - the node -, the restart
count), which names the file with the store's key. No process group is needed, so it works before one exists and never
blocks a collective.

Life of a segment:

* The builder first removes what killed runs left behind: any ``deg-hf-store-*`` file whose owner
  (host, pid and the pid's start time, written in the file's header) no longer runs.
* It writes the blocks under ``<name>.building``, then renames the file to ``<name>``: a file under
  the final name is always complete. On failure it removes the file and leaves ``<name>.error`` with
  the reason, which the waiting ranks raise.
* The other ranks poll for ``<name>`` (a timeout names the file and the remedy), check its header
  (the store's key and a live owner: a leftover of a killed run is never read), map it read-only and
  leave ``<name>.attached-<rank>``.
* Once every rank has attached, the builder unlinks the name. The memory lives on while a rank maps
  it and the kernel frees it when the last rank unmaps it or exits, however it ends (an exception,
  SIGKILL): nothing is left behind after the setup.

On CUDA each rank registers the mapped pages as pinned memory (``cudaHostRegister``), so its
host-to-device copies stay asynchronous.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import socket
import struct
import time
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PREFIX = "deg-hf-store-"
_MAGIC = b"DEGHFST1"
_PAGE = mmap.PAGESIZE
#: seconds a rank waits for its node's builder (a 70B base quantized on the host takes many minutes)
DEFAULT_TIMEOUT_S = 3 * 3600.0
_POLL_S = (0.005, 0.05)  # first and longest pause between looks at the files: ready within ~50 ms


def _pause(waited: float) -> None:
    time.sleep(min(_POLL_S[1], max(_POLL_S[0], waited / 20)))


class SharedStoreError(RuntimeError):
    """The node's shared store could not be built or attached; the message says why and what to do."""


def shm_dir() -> str:
    return os.environ.get("DEG_HF_SHM_DIR") or "/dev/shm"


def sharing_disabled_by_env() -> bool:
    return os.environ.get("DEG_HF_SHARE_STORE", "").strip().lower() in ("0", "false", "no", "off")


@dataclass(frozen=True)
class NodeRanks:
    """This process's place among the ranks of its node, and the run's identity on the node."""

    local_rank: int
    local_world_size: int
    node: int
    run: str  # digest of the run's identity: the segment's name

    @property
    def builder(self) -> bool:
        return self.local_rank == 0


def node_ranks(environ=None) -> NodeRanks | None:
    """This process's :class:`NodeRanks` under torchrun or ``accelerate launch`` with several local
    ranks; None otherwise (one process per node, another launcher, or ``DEG_HF_SHARE_STORE=0``)."""
    env = os.environ if environ is None else environ
    if sharing_disabled_by_env():
        return None
    try:
        local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if local_world <= 1:
        return None
    node = int(env.get("GROUP_RANK", "0") or 0)
    identity = "\0".join(env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                                                  "TORCHELASTIC_RESTART_COUNT"))
    run = hashlib.sha256(f"{identity}\0{node}\0{local_world}".encode()).hexdigest()[:16]
    return NodeRanks(local_rank, local_world, node, run)


# --------------------------------------------------------------------------- owners


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None when no such process runs)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 else None  # field 22 of the whole line


def this_owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_ticks(os.getpid())}


def owner_alive(owner: dict) -> bool | None:
    """Whether the process that wrote a header still runs; None for another host's (left alone)."""
    if owner.get("host") != socket.gethostname():
        return None
    start = _start_ticks(int(owner.get("pid", -1)))
    return start is not None and start == owner.get("start")


def _process_start_epoch() -> float:
    """When this process started (seconds since the epoch)."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return btime + (_start_ticks(os.getpid()) or 0) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError):
        return time.time()


# --------------------------------------------------------------------------- headers


def _read_header(fd: int) -> tuple[dict, int] | None:
    """(header, data offset) of a segment file, or None when the file is not one (yet)."""
    head = os.pread(fd, 16, 0)
    if len(head) < 16 or head[:8] != _MAGIC:
        return None
    (length,) = struct.unpack("<Q", head[8:])
    raw = os.pread(fd, length, 16)
    try:
        header = json.loads(raw)
    except ValueError:
        return None
    return header, _data_offset(length)


def _data_offset(header_len: int) -> int:
    return (16 + header_len + _PAGE - 1) // _PAGE * _PAGE


def read_owner(path: str) -> dict | None:
    """The owner written in a segment, error or marker file (None when unreadable)."""
    try:
        if path.endswith(".error") or ".attached-" in path:
            with open(path, encoding="utf-8") as fh:
                return json.load(fh).get("owner")
        fd = os.open(path, os.O_RDONLY)
        try:
            got = _read_header(fd)
        finally:
            os.close(fd)
        return got[0].get("owner") if got else None
    except (OSError, ValueError, AttributeError):
        return None


def remove_leftovers(directory: str | None = None) -> list[str]:
    """Remove the segment files (and their markers) of runs whose owner no longer runs; the paths removed."""
    directory = directory or shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(directory, name)
        owner = read_owner(path)
        if owner is None:
            # a file being created this instant has no header yet: only old headerless files go
            try:
                stale = time.time() - os.stat(path).st_mtime > 60
            except OSError:
                continue
            if not stale:
                continue
        elif owner_alive(owner) is not False:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    if removed:
        logger.warning("deg_hf: removed %d shared layer-store file(s) left by runs that no longer run "
                       "(first: %s); the store is built again.", len(removed), removed[0])
    return removed


# --------------------------------------------------------------------------- the segment


class SharedSegment:
    """One node's shared store file, mapped into this process (read-only once complete).

    ``data`` is the uint8 tensor over the blocks; ``offsets[i]`` is where RAM layer ``i`` starts."""

    def __init__(self, path: str, ranks: NodeRanks, header: dict, data_offset: int, fd: int, writable: bool):
        self.path = path
        self.ranks = ranks
        self.header = header
        self.data_offset = data_offset
        self.nbytes = int(header["bytes"])
        self.offsets = {int(k): int(v) for k, v in header["offsets"].items()}
        self.built = writable
        self.final = path
        self.pinned = False
        self.ready_at = None if writable else time.time()  # published (builder) or mapped (other ranks)
        self._fd = fd
        self._map(writable)

    # -- mapping
    def _map(self, writable: bool) -> None:
        length = self.data_offset + max(self.nbytes, 1)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mm = mmap.mmap(self._fd, length, flags=mmap.MAP_SHARED, prot=prot)
        with warnings.catch_warnings():  # a read-only buffer: torch warns that writes are undefined
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.data = whole[self.data_offset : self.data_offset + self.nbytes]

    def block(self, i: int, nbytes: int) -> torch.Tensor:
        return self.data[self.offsets[i] : self.offsets[i] + nbytes]

    @property
    def address(self) -> int:
        return self.data.data_ptr()

    # -- builder
    @classmethod
    def create(cls, ranks: NodeRanks, key: str, offsets: dict[int, int], nbytes: int, extra: dict) -> SharedSegment:
        directory = shm_dir()
        os.makedirs(directory, exist_ok=True)
        remove_leftovers(directory)
        final = segment_path(ranks, key)
        for stale in (final, final + ".error"):
            # a file of this run and store that is already there is not this build's: never reused as is
            owner = read_owner(stale)
            if owner is not None and owner != this_owner():
                logger.warning("deg_hf: replacing the shared layer store file %s of pid %s.", stale, owner.get("pid"))
            _unlink(stale)
        header = {"key": key, "owner": this_owner(), "bytes": nbytes, "offsets": {str(k): v for k, v in offsets.items()},
                  "local_world_size": ranks.local_world_size, **extra}
        raw = json.dumps(header).encode()
        building = final + ".building"
        _unlink(building)
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS while filling
                os.posix_fallocate(fd, 0, _data_offset(len(raw)) + max(nbytes, 1))
            except OSError as exc:
                free = os.statvfs(directory)
                raise SharedStoreError(
                    f"cannot reserve {nbytes / 2**30:.2f} GiB for the node's shared layer store in {directory} "
                    f"({exc.strerror}; {free.f_bavail * free.f_frsize / 2**30:.2f} GiB free there). Enlarge it (in a "
                    "container: --shm-size), point DEG_HF_SHM_DIR at a larger tmpfs, or set "
                    "stream_share_store=False (DEG_HF_SHARE_STORE=0) for one store per rank."
                ) from exc
            os.pwrite(fd, _MAGIC + struct.pack("<Q", len(raw)) + raw, 0)
            segment = cls(building, ranks, header, _data_offset(len(raw)), fd, writable=True)
        except BaseException:
            os.close(fd)
            _unlink(building)
            raise
        segment.final = final
        return segment

    def publish(self) -> None:
        """The blocks are complete: remap them read-only and give the file its final name."""
        self._remap_read_only()
        os.rename(self.path, self.final)
        self.path = self.final
        self.ready_at = time.time()

    def _remap_read_only(self) -> None:
        # the writable mapping is unmapped when its last view goes (the tensors hold the mmap object;
        # closing it under them would leave them pointing at unmapped memory)
        self.data = self._mm = None
        self._map(writable=False)

    def wait_for_ranks(self, timeout: float) -> None:
        """Wait until every other local rank has mapped the file, then unlink its name: the memory
        stays while any rank maps it and is freed with the last."""
        markers = [f"{self.final}.attached-{r}" for r in range(1, self.ranks.local_world_size)]
        start = time.monotonic()
        deadline = start + timeout
        try:
            while not all(os.path.exists(m) for m in markers):
                if time.monotonic() > deadline:
                    missing = [m for m in markers if not os.path.exists(m)]
                    raise SharedStoreError(
                        f"local rank(s) {', '.join(m.rsplit('-', 1)[1] for m in missing)} did not map the shared "
                        f"layer store {self.final} within {timeout:.0f} s; see their logs. Raise "
                        "DEG_HF_SHARE_TIMEOUT (seconds), or set stream_share_store=False (DEG_HF_SHARE_STORE=0) "
                        "for one store per rank."
                    )
                _pause(time.monotonic() - start)
        finally:
            for path in (self.final, *markers):
                _unlink(path)

    def fail(self, exc: BaseException) -> None:
        """Building failed: remove the file and tell the waiting ranks why."""
        self.close()
        _unlink(self.path)
        report_failure(self.ranks, self.header["key"], exc)

    # -- other ranks
    @classmethod
    def attach(cls, ranks: NodeRanks, key: str, timeout: float) -> SharedSegment:
        """Map the node's store read-only once its builder has published it."""
        final = segment_path(ranks, key)
        since = _process_start_epoch() - 2.0  # files older than this process belong to an earlier run
        start = time.monotonic()
        deadline = start + timeout
        while True:
            error = _fresh_error(final + ".error", since)
            if error is not None:
                raise SharedStoreError(f"local rank 0 failed to build the node's shared layer store: {error}")
            segment = cls._try_attach(final, ranks, key)
            if segment is not None:
                return segment
            building = final + ".building"
            owner = read_owner(building)
            if owner is not None and owner_alive(owner) is False and _mtime(building) >= since:
                raise SharedStoreError(
                    f"local rank 0 (pid {owner.get('pid')}) stopped while building the shared layer store "
                    f"{building}; see its log."
                )
            if time.monotonic() > deadline:
                raise SharedStoreError(
                    f"local rank {ranks.local_rank} waited {timeout:.0f} s for local rank 0 to build the node's "
                    f"shared layer store {final} and it did not appear. Check rank 0's log (is it still loading or "
                    "quantizing?), raise DEG_HF_SHARE_TIMEOUT (seconds), or set stream_share_store=False "
                    "(DEG_HF_SHARE_STORE=0) for one store per rank."
                )
            _pause(time.monotonic() - start)

    @classmethod
    def _try_attach(cls, final: str, ranks: NodeRanks, key: str) -> SharedSegment | None:
        try:
            fd = os.open(final, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            got = _read_header(fd)
            if got is None:
                os.close(fd)
                return None
            header, offset = got
            if owner_alive(header.get("owner") or {}) is not True:
                os.close(fd)  # left by a killed run: the builder replaces it
                return None
            if header.get("key") != key:
                os.close(fd)
                raise SharedStoreError(
                    f"the shared layer store {final} holds another store ({header.get('key')}) than this rank "
                    f"builds ({key}): the local ranks were given different models or settings."
                )
            segment = cls(final, ranks, header, offset, fd, writable=False)
        except BaseException:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise
        marker = f"{final}.attached-{ranks.local_rank}"
        with open(marker, "w", encoding="utf-8") as fh:
            json.dump({"owner": this_owner()}, fh)
        return segment

    # -- CUDA
    def pin(self) -> bool:
        """Register the mapping as pinned (page-locked) memory with CUDA, so copies out of it are
        asynchronous. The pages are mapped read-only, so they are registered read-only where the
        driver supports it. False (and a warning) when registration fails."""
        if not torch.cuda.is_available() or self.nbytes == 0:
            return False
        cudart = torch.cuda.cudart()
        error = None
        for flags in (8, 0):  # cudaHostRegisterReadOnly, then the default
            result = cudart.cudaHostRegister(self.address, self.nbytes, flags)
            code = int(getattr(result, "value", result))
            if code == 0:
                self.pinned = True
                return True
            error = code
            torch.cuda.synchronize()
        warnings.warn(f"registering the shared layer store ({self.nbytes / 2**20:.0f} MiB) as pinned memory failed "
                      f"(cudaError {error}); copies out of it are synchronous. Raise the locked-memory limit "
                      "(ulimit -l).", stacklevel=3)
        return False

    def close(self) -> None:
        """Drop this mapping (unmapped once no tensor views it) and close the file. Idempotent."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        # unmapped when the last tensor viewing it goes (see _remap_read_only)
        self.data = self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def stats(self) -> dict:
        return {"shared": True, "ranks": self.ranks.local_world_size, "role": "built" if self.built else "attached",
                "segment": self.final if self.built else self.path, "bytes": self.nbytes, "pinned": self.pinned}


def segment_path(ranks: NodeRanks, key: str) -> str:
    """The file of this run's store on this node: the run's identity and the store's key name it (two
    stores in one run, a policy and a separate reference, are two files)."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(shm_dir(), f"{PREFIX}{ranks.run}-{digest}")


def report_failure(ranks: NodeRanks, key: str, exc: BaseException) -> None:
    """Leave ``<name>.error`` with the builder's reason, which the node's waiting ranks raise."""
    directory = shm_dir()
    error = segment_path(ranks, key) + ".error"
    tmp = f"{error}.{os.getpid()}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"owner": this_owner(), "error": f"{type(exc).__name__}: {exc}"}, fh)
        os.replace(tmp, error)
    except OSError:
        _unlink(tmp)


def share_timeout() -> float:
    raw = os.environ.get("DEG_HF_SHARE_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise SharedStoreError(f"DEG_HF_SHARE_TIMEOUT={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise SharedStoreError(f"DEG_HF_SHARE_TIMEOUT={raw!r} must be > 0 seconds")
    return value


def _fresh_error(path: str, since: float) -> str | None:
    try:
        if os.stat(path).st_mtime < since:
            return None
        with open(path, encoding="utf-8") as fh:
            return json.load(fh).get("error")
    except (OSError, ValueError):
        return None


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def store_pss_bytes(store, pid: int | str = "self") -> int:
    """Proportional set size of a store's RAM blocks in a process, from ``/proc/<pid>/smaps``: each
    mapping's Pss, weighted by the share of the mapping the blocks cover. Exact for a shared store
    (its mapping is the blocks); for one rank's own blocks, the anonymous mappings (or heap) that
    hold them."""
    ranges = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in store.flat if b is not None)
    total = 0.0
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as fh:
        start = end = covered = 0
        for line in fh:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                start, end = lo, hi
                covered = sum(max(0, min(hi, b) - max(lo, a)) for a, b in ranges)
            elif first == "Pss:" and covered:
                total += int(line.split()[1]) * 1024 * covered / (end - start)
    return int(total)
