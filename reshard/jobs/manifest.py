"""What a finished output is, and how far an unfinished one got: manifest, fingerprints, journal.

    from reshard.jobs.manifest import Manifest
    manifest = Manifest.read("/ckpt/run1-dp16/global_step100")   # reshard_manifest.json
    bad = manifest.check_files("/ckpt/run1-dp16/global_step100")  # [] when every hash matches

The manifest sits in the published tag directory (DeepSpeed ignores it). It names the
source (paths, sizes, mtimes, tag, topology), the target topology and the BLAKE3 hash of
every file written. `output_fingerprint` identifies the output (source identity, target
size, reshard's format version); output bytes do not depend on the worker count or the
budget. `plan_fingerprint` adds those two, since a resume replays the same rounds.

The journal (.reshard-journal.json in the staging tag directory, written only by worker 0
after every worker has fsynced) records how far a run got: skeletons created, rounds done.
A re-run with the same plan fingerprint continues from there; anything else starts over.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

from reshard.files.byte_io import hash_file
from reshard.errors import CheckpointError

if TYPE_CHECKING:
    from reshard.formats.deepspeed_files.deepspeed_spec import SourceCheckpoint

MANIFEST_NAME = "reshard_manifest.json"
JOURNAL_NAME = ".reshard-journal.json"
FORMAT_VERSION = 1


def source_identity(tag_dir: str, names) -> dict:
    """Name -> size and mtime of the source files: enough to notice a changed source on resume."""
    identity = {}
    for name in sorted(names):
        stat = os.stat(os.path.join(tag_dir, name))
        identity[name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return identity


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


def output_fingerprint(save_dir: str, tag: str, identity: dict, target_dp: int, target_tp: int | None = None,
                       placement: dict | None = None, target_stage: int | None = None,
                       target_ep: int | None = None) -> str:
    """`target_tp`: given for tensor-parallel outputs only (data-parallel fingerprints stay as they were).
    `placement`: the node and ranks per node of a node-local output (which files it holds).
    `target_stage`: only when it changes the ZeRO stage. `target_ep`: given for MoE outputs only."""
    fields = {"format": FORMAT_VERSION, "source": os.path.realpath(save_dir), "tag": tag, "files": identity,
              "target_dp": target_dp}
    if target_tp is not None:
        fields["target_tp"] = target_tp
    if placement is not None:
        fields["placement"] = placement
    if target_stage is not None:
        fields["target_stage"] = target_stage
    if target_ep is not None:
        fields["target_ep"] = target_ep
    return _digest(fields)


def pipeline_stage_placement(opts, target) -> dict | None:
    """What decides a pipeline output's new stages (and, with a model axis re-cut, its model ranks), for
    its fingerprint: the layer list and partition options, None where the stages are kept. One rule for
    every job kind that writes one (the collective job, array tasks), so their manifests agree byte for
    byte. `opts`: ReshardOptions; `target`: the target Topology (its `stages` set where they are re-assigned,
    its `layer_files` re-cut where the model axis is)."""
    if target.stages is None:
        return None
    recut = target.layer_files is not None and target.layer_files.recut
    return {"pp": target.pp, "layers": opts.pipeline_layers, "tied": opts.pipeline_tied,
            "partition": opts.pipeline_partition, **({"tp": target.tp} if recut else {})}


def export_fingerprint(source: "SourceCheckpoint", export: dict) -> str:
    """Identifies an export's output: the source files (sizes, mtimes) and the export's options
    (`export`: format, dtype, shard size...; a pipeline save's exports name its layer files' identity
    there). Worker count and budget join in `plan_fingerprint`."""
    names = {os.path.basename(path) for rank in range(source.spec.topology.world_size)
             for path in source.source_files(rank, None)}
    return _digest({"format": FORMAT_VERSION, "source": os.path.realpath(source.save_dir), "tag": source.tag,
                    "files": source_identity(source.tag_dir, names), "export": export})


def manifest_source_entry(source: "SourceCheckpoint", identity: dict) -> dict:
    """The manifest's "source" entry for a DeepSpeed ZeRO save (the collective job's and an array task's)."""
    spec = source.spec
    return {"save_dir": source.save_dir, "tag": source.tag, "dp_world_size": spec.dp_world_size,
            "stage": spec.stage, "optimizer": spec.optimizer, "description": spec.describe(), "files": identity}


@dataclass(frozen=True)
class OutputEntries:
    """What identifies a resharded output and what its manifest says of it (`output_entries`)."""

    fingerprint: str
    """`output_fingerprint`."""
    source: dict
    """The manifest's "source" entry, "files" (the source identity) included."""
    target: dict
    """The manifest's "target" entry."""


def output_entries(opts, source: "SourceCheckpoint", target, identity: dict, placement: dict | None = None
                   ) -> OutputEntries:
    """The fingerprint and manifest entries of `source` resharded to `target` (a reshard.jobs.preflight.
    CheckpointTarget: dp, tp, pp, ep and the ZeRO stage from it, never from the options), one rule for every
    job kind that writes one (collective_job._describe_output and _publish, array_job's units), so their
    outputs agree byte for byte.

        entries = output_entries(opts, source, checkpoint_target(opts, source), identity)

    `identity`: the source files' `source_identity`. `placement`: a node-local output's node and ranks per
    node (which files it holds), in fingerprint and target entry. Keys only some saves have stay theirs:
    a tensor-parallel save's tp in its fingerprint and tp_world_size entries, an MoE save's target ep, a
    pipeline's layer list when its stages change (`pipeline_stage_placement`) and its own manifest source."""
    spec, topology, zero = source.spec, target.topology, target.zero
    target_tp = topology.tp if spec.tensor is not None else None
    target_ep = topology.ep if spec.experts is not None else None
    stages = pipeline_stage_placement(opts, topology)
    fingerprint = output_fingerprint(source.save_dir, source.tag, identity, topology.dp, target_tp,
                                     placement=placement if stages is None else {**(placement or {}), **stages},
                                     target_stage=zero.changed_to, target_ep=target_ep)
    if source.manifest_source is not None:  # a pipeline's, as every job kind writes it (pinned bytes)
        source_entry = {**source.manifest_source, "files": identity}
        target_entry = {"dp_world_size": topology.dp, "pp": topology.pp, "tp": topology.tp, "stage": 1,
                        **(placement or {})}
    else:
        source_entry = manifest_source_entry(source, identity)
        target_entry = {"dp_world_size": topology.dp, "stage": zero.stage, **(placement or {})}
        if spec.tensor is not None:  # data-parallel manifests keep their keys (and bytes) as before
            source_entry["tp_world_size"] = spec.topology.tp
            target_entry["tp_world_size"] = topology.tp
    if target_ep is not None:  # likewise: only MoE manifests carry the target ep
        target_entry["ep"] = target_ep
    return OutputEntries(fingerprint, source_entry, target_entry)


def plan_fingerprint(output: str, workers: int, budget_bytes: int) -> str:
    return _digest({"output": output, "workers": workers, "budget": budget_bytes})


def write_json_atomically(path: str, obj) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as fd:
        json.dump(obj, fd, indent=1, sort_keys=True)
        fd.flush()
        os.fsync(fd.fileno())
    os.replace(temporary, path)


@dataclass
class Manifest:
    """reshard_manifest.json: where the output came from and the hash of every file."""

    fingerprint: str
    source: dict
    target: dict
    files: dict = field(default_factory=dict)
    """name -> {"bytes": int, "blake3": hex}"""
    reshard_version: str = ""
    format: int = FORMAT_VERSION

    def write(self, tag_dir: str) -> None:
        # No timestamp: an output is byte-identical however (and however often) it was made.
        write_json_atomically(os.path.join(tag_dir, MANIFEST_NAME), asdict(self))

    @classmethod
    def read(cls, tag_dir: str) -> "Manifest":
        path = os.path.join(tag_dir, MANIFEST_NAME)
        try:
            with open(path) as fd:
                data = json.load(fd)
            return cls(**data)
        except FileNotFoundError:
            raise CheckpointError(path, "does not exist: this directory was not written by reshard "
                                        "(or the run did not finish)") from None
        except (ValueError, TypeError) as error:
            raise CheckpointError(path, f"is not a valid reshard manifest: {error}") from None

    def check_files(self, tag_dir: str, on_file: Callable[[int], None] | None = None) -> list[str]:
        """Problems found re-hashing every listed file ([] when all match); `on_file(bytes the
        manifest lists)` after each file (a progress bar)."""
        problems = []
        for name, expected in sorted(self.files.items()):
            path = os.path.join(tag_dir, name)
            if not os.path.isfile(path):
                problems.append(f"{path}: missing")
            elif (size := os.path.getsize(path)) != expected["bytes"]:
                problems.append(f"{path}: {size} bytes, the manifest says {expected['bytes']}")
            elif hash_file(path) != expected["blake3"]:
                problems.append(f"{path}: content differs from the manifest (BLAKE3 mismatch)")
            if on_file is not None:
                on_file(expected["bytes"])
        return problems


def read_journal(staging_tag_dir: str) -> dict | None:
    try:
        with open(os.path.join(staging_tag_dir, JOURNAL_NAME)) as fd:
            return json.load(fd)
    except (OSError, ValueError):
        return None


def write_journal(staging_tag_dir: str, plan_fp: str, skeletons: bool, rounds_done: int) -> None:
    write_json_atomically(os.path.join(staging_tag_dir, JOURNAL_NAME),
                          {"plan_fingerprint": plan_fp, "skeletons": skeletons, "rounds_done": rounds_done})
