"""In-job resharding: resume a DeepSpeed engine from a checkpoint saved at another world size.

    import reshard.deepspeed
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    load_path, client_state = reshard.deepspeed.load_checkpoint(engine, "/ckpt/run1")

A drop-in for `engine.load_checkpoint(load_dir, tag, **kwargs)`, with the same return value.
If the checkpoint was saved at the engine's data-parallel size it simply delegates.
Otherwise the job's own ranks reshard it over the job's process group: each rank reads a
disjoint subset of the source rank files, slices move with all-to-all within the memory
budget, and each rank builds its new partition in memory; DeepSpeed's own
`load_checkpoint` then loads those objects, so the engine ends in exactly the state a
native load of the offline-resharded checkpoint gives. No resharded copy is written.

What does touch disk: DeepSpeed's loader checks that the files it loads exist, so each rank
creates empty placeholder files with the target names in a private temporary directory
(removed afterwards) and DeepSpeed's checkpoint engine is pointed, for the duration of the
call, at the in-memory objects. One case cannot be served from memory: ZeRO-3 with
`load_optimizer_states=False` makes DeepSpeed run zero_to_fp32 on the directory itself;
there the checkpoint is resharded into a temporary staging directory, loaded, and removed.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import torch

from reshard.checkpoint_plan import plan_reshard
from reshard.collective import on_rank0
from reshard.errors import ReshardError
from reshard.execute import execute
from reshard.formats import deepspeed_classes as classes
from reshard.formats import deepspeed_schema as schema
from reshard.formats.deepspeed_client_state import differing_client_state
from reshard.formats.deepspeed_inspect import inspect_checkpoint
from reshard.formats.deepspeed_spec import SourceCheckpoint, refuse_tensor_parallel
from reshard.formats.deepspeed_target import target_files
from reshard.formats.torch_archive import leaves_in_order, materialize
from reshard.source_reader import SourceReader
from reshard.topology import Topology
from reshard.transport import TorchDistributedTransport

DEFAULT_BUDGET = 1 << 30


class MemoryTargetWriter:
    """Builds the target files of some ranks as in-memory objects (what torch.load would return)."""

    def __init__(self, source: SourceCheckpoint, target_topology: Topology, ranks):
        self.objects: dict[tuple[int, str], object] = {}
        self.locations: dict[tuple, np.ndarray] = {}
        self.bytes_written = 0
        for rank in ranks:
            for target in target_files(source, target_topology, rank):
                if source.spec.stage < 3 and target.name == schema.model_file_name(source.spec.stage):
                    continue  # ZeRO-1/2 model states: every rank reads the source file, as DeepSpeed does
                obj, roles = materialize(target.tree)
                carried = source.carried[target.template]
                for tensor in leaves_in_order(obj):
                    role = roles.get(tensor.untyped_storage()._cdata)
                    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
                    if isinstance(role, tuple):
                        raw.zero_()  # padding reads as zeros, as in a written file
                        self.locations[(rank, role)] = raw.numpy()
                    elif role is not None and len(raw):
                        raw.copy_(torch.frombuffer(bytearray(carried[role]), dtype=torch.uint8))
                self.objects[(rank, target.name)] = obj

    def write(self, rank: int, slot: tuple, element: int, itemsize: int, data: memoryview) -> None:
        start = element * itemsize
        self.locations[(rank, slot)][start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.bytes_written += len(data)

    def sync(self) -> None:
        pass  # nothing on disk

    def close(self) -> None:
        pass  # the objects are the result: they stay until the load has used them


class _ServedCheckpointEngine:
    """Wraps DeepSpeed's checkpoint engine: named paths come from memory, the rest from disk."""

    def __init__(self, inner, served: dict):
        self.inner, self.served = inner, served

    def load(self, path, map_location=None):
        key = os.path.abspath(path)
        if key in self.served:
            return self.served[key]
        return self.inner.load(path, map_location=map_location)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _data_parallel_size(engine) -> int:
    return int(getattr(engine, "seq_dp_world_size", None) or engine.dp_world_size)


def load_checkpoint(engine, load_dir: str, tag: str | None = None, *, memory_budget: int = DEFAULT_BUDGET,
                    trust_pickle: bool = False, staging_dir: str | None = None, **load_checkpoint_kwargs):
    """`engine.load_checkpoint(load_dir, tag, **kwargs)`, resharding in the job when the sizes differ.

    Collective: every rank of the job calls it, as with DeepSpeed's own method.
    `staging_dir`: a directory every rank can see, needed only for the one case that goes
    through disk (ZeRO-3 with load_optimizer_states=False) on more than one host.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        raise ReshardError("reshard.deepspeed.load_checkpoint needs the job's torch.distributed process group "
                           "(call it after deepspeed.initialize)")
    transport = TorchDistributedTransport()
    source: SourceCheckpoint = on_rank0(transport, lambda: inspect_checkpoint(load_dir, tag, trust_pickle=trust_pickle))
    target_dp = _data_parallel_size(engine)
    if source.spec.tensor is not None:
        engine_tp = int(engine.autotp_size() or 1) if hasattr(engine, "autotp_size") else 1
        if source.spec.dp_world_size == target_dp and source.spec.topology.tp == engine_tp:
            return engine.load_checkpoint(load_dir, source.tag, **load_checkpoint_kwargs)
        refuse_tensor_parallel(source, "in-job resharding (reshard.deepspeed.load_checkpoint)")
    if source.spec.dp_world_size == target_dp:
        return engine.load_checkpoint(load_dir, source.tag, **load_checkpoint_kwargs)
    if transport.size != target_dp:
        raise ReshardError(f"in-job resharding needs data parallelism only: the job has {transport.size} ranks "
                           f"but a data-parallel size of {target_dp}")
    started = time.perf_counter()
    differing = on_rank0(transport, lambda: differing_client_state(source, trust_pickle=trust_pickle))
    if differing and transport.rank == 0:
        print(f"reshard: client_state differs between source ranks in {', '.join(differing)} (ZeRO-3 saves each "
              f"rank's own); every rank received source rank 0's values", flush=True)
    if source.spec.stage == 3 and not load_checkpoint_kwargs.get("load_optimizer_states", True):
        return _load_through_staging(engine, source, transport, memory_budget, trust_pickle, staging_dir,
                                     load_checkpoint_kwargs)
    objects = _reshard_in_memory(source, target_dp, transport, memory_budget, trust_pickle)
    result = _load_served(engine, source, objects, transport.rank, load_checkpoint_kwargs)
    if transport.rank == 0:
        print(f"reshard: resharded {source.tag_dir} from {source.spec.dp_world_size} to {target_dp} "
              f"data-parallel ranks in-job in {time.perf_counter() - started:.2f} s", flush=True)
    return result


def _reshard_in_memory(source: SourceCheckpoint, target_dp: int, transport, budget: int, trust_pickle: bool) -> dict:
    plan = plan_reshard(source.spec, Topology(dp=target_dp), transport.size, budget)
    own = plan.ownership
    return execute(plan, transport,
                   open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank),
                                                         trust_pickle=trust_pickle),
                   open_sink=lambda: MemoryTargetWriter(source, Topology(dp=target_dp),
                                                        own.target_ranks_of(transport.rank)),
                   opening="opening source files", finish=lambda reader, writer: writer.objects)


def _load_served(engine, source: SourceCheckpoint, objects: dict, rank: int, kwargs: dict):
    spec = source.spec
    placeholder_root = tempfile.mkdtemp(prefix="reshard-injob-")
    try:
        tag_dir = os.path.join(placeholder_root, source.tag)
        os.makedirs(tag_dir)
        served = {}
        for (_, name), obj in objects.items():
            served[os.path.join(tag_dir, name)] = classes.to_deepspeed(obj)
        if spec.stage < 3:
            name = schema.model_file_name(spec.stage)
            served[os.path.join(tag_dir, name)] = _zero12_model_states(source, _data_parallel_size(engine))
        for path in served:
            open(path, "wb").close()  # DeepSpeed checks the files exist before loading them
        inner = engine.checkpoint_engine
        engine.checkpoint_engine = _ServedCheckpointEngine(inner, served)
        try:
            load_path, client_state = engine.load_checkpoint(placeholder_root, source.tag, **kwargs)
        finally:
            engine.checkpoint_engine = inner
        return _as_source_path(source, load_path), client_state
    finally:
        shutil.rmtree(placeholder_root, ignore_errors=True)


def _as_source_path(source: SourceCheckpoint, load_path: str | None) -> str | None:
    """The path DeepSpeed reports, named in the source directory the caller asked to load."""
    return None if load_path is None else os.path.join(source.tag_dir, os.path.basename(load_path))


def _zero12_model_states(source: SourceCheckpoint, target_dp: int) -> dict:
    """The ZeRO-1/2 model-states file at the target size: the source file, metadata recomputed."""
    from reshard.formats.deepspeed_target import _zero12_model_tree
    torch.serialization.add_safe_globals(schema.safe_globals())
    states = classes.to_deepspeed(torch.load(source.model_path(0), map_location="cpu", mmap=True, weights_only=True))
    recomputed = _zero12_model_tree(source, source.spec.layout(target_dp))
    states["param_shapes"] = recomputed["param_shapes"]
    states["dp_world_size"] = recomputed["dp_world_size"]
    return states


def _load_through_staging(engine, source: SourceCheckpoint, transport, budget: int, trust_pickle: bool,
                          staging_dir: str | None, kwargs: dict):
    """Reshard into a temporary directory (never inside the source), load it, remove it."""
    import socket

    from reshard.job import reshard_checkpoint
    hosts = set(transport.all_gather_object(socket.gethostname()))
    if staging_dir is None and len(hosts) > 1:
        raise ReshardError("ZeRO-3 with load_optimizer_states=False reshards through disk: pass staging_dir=, a "
                           f"directory all {len(hosts)} hosts can see")
    root = None
    if transport.rank == 0:
        root = tempfile.mkdtemp(prefix="reshard-injob-staging-", dir=staging_dir)
    root = transport.broadcast_object(root)
    try:
        destination = os.path.join(root, "checkpoint")
        reshard_checkpoint(source.save_dir, destination, _data_parallel_size(engine), tag=source.tag,
                           memory_budget=budget, quiet=True, trust_pickle=trust_pickle, transport=transport)
        load_path, client_state = engine.load_checkpoint(destination, source.tag, **kwargs)
        transport.barrier()
        return _as_source_path(source, load_path), client_state
    finally:
        if transport.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
