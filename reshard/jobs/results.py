"""What a job reports: per worker, per checkpoint, per job; `summary()` is what the CLI prints.

    result = reshard.reshard_checkpoint(src, dst, target_dp=16)
    result.seconds, result.bytes_written, result.reports[0].peak_rss_bytes
    print(result.summary())
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, fields

from reshard.files.paths import write_file_atomically
from reshard.planning.plan import ReshardPlan
from reshard.topology import Topology

PHASES = ("start-up", "inspect", "plan", "exchange+write", "fsync", "hash", "publish")
"""Where a job's wall time goes, in order: start-up (interpreter, imports, process group),
inspect (source pickles, destination checks), plan (plan, start decision, lock), exchange+write
(open source files, write skeletons, rounds, carried copies), fsync, hash (BLAKE3 for the
manifest) and publish (gather hashes, manifest, rename into place). Phases end where the
workers agree, so the slowest worker's time per phase is that phase's share of the wall."""


class PhaseClock:
    """Wall time per phase on one worker: `lap(phase)` charges the time since the last lap to it."""

    def __init__(self, started: float | None = None):
        self.last = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.add(phase, now - self.last)
        self.last = now

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def move(self, seconds: float, source: str, target: str) -> None:
        """Charge `seconds` already counted under `source` to `target` (fsyncs inside the rounds)."""
        self.add(source, -seconds)
        self.add(target, seconds)


def process_started() -> float | None:
    """When this process started, on the time.perf_counter() clock (Linux /proc; None elsewhere):
    the start-up phase of a command includes the interpreter and its imports."""
    age = _process_age()
    return None if age is None else time.perf_counter() - age


def _process_age() -> float | None:
    try:
        with open("/proc/self/stat") as fd:
            start_ticks = int(fd.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as fd:
            uptime = float(fd.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class WorkerReport:
    """What one worker did, measured."""

    worker: int
    source_ranks: tuple[int, ...]
    target_ranks: tuple[int, ...]
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_carried: int = 0
    peak_rss_bytes: int = 0
    """VmHWM (`resources.peak_resident_bytes`): every resident page, file pages mapped for hashing included."""
    peak_anonymous_bytes: int = 0
    """Anonymous resident memory at its largest sample (`reshard.files.resources.PeakAnonymousMemory`):
    what the job held, to compare with --memory-budget."""
    phases: dict[str, float] = field(default_factory=dict)
    """Wall seconds per phase (see PHASES) on this worker."""
    torch_imported: bool | None = None
    """Whether this worker's process had imported torch by the end of its job (None: not recorded):
    `python -m reshard --workers W` reads and writes without it where the files allow."""
    bytes_between_nodes: int = 0
    """Bytes this worker sent to other nodes for this checkpoint (a node leader, reshard.transport.nodes)."""
    staging_peak_bytes: int = 0
    """Most cross-node bytes this worker held at once, leaving and arriving together (a node leader,
    reshard.transport.nodes: at most two staging windows, `staging_window`; 0 on other workers)."""
    torch_files: list = field(default_factory=list)
    """[(path, why)] of each file this worker read or wrote with torch after the torch-free reader
    or writer refused it (torch_archive.torch_fallbacks), so the summary can say which and why."""


@dataclass
class CheckpointResult:
    """What a job did to one checkpoint (save directory + tag)."""

    source: str
    destination: str
    tag: str
    description: str
    source_topology: Topology
    target_topology: Topology
    workers: int
    transport: str
    rounds: int
    seconds: float
    dry_run: bool
    plan: ReshardPlan | None = field(default=None, repr=False)
    reports: list[WorkerReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    planner_imported_torch: bool | None = None
    """A dry run's io marker: whether worker 0, which inspected the source, imported torch."""
    planner_torch_files: list = field(default_factory=list)
    """A dry run's torch_files (WorkerReport.torch_files) of worker 0's inspection."""
    nodes: int = 1
    """Nodes the workers ran on (reshard.transport.nodes); 1 for every other transport."""
    plan_bytes_between_nodes: int = 0
    """Bytes the plan says must cross between nodes (`ReshardPlan.bytes_between_nodes`)."""

    @property
    def bytes_between_nodes(self) -> int:
        """Bytes the node leaders sent to other nodes, measured."""
        return sum(r.bytes_between_nodes for r in self.reports)

    def as_dict(self) -> dict:
        """The figures of `summary()` as plain values (`--result-json`)."""
        return {"source": self.source, "destination": self.destination, "tag": self.tag,
                "source_dp": self.source_dp, "target_dp": self.target_dp, "workers": self.workers,
                "transport": self.transport, "rounds": self.rounds, "seconds": self.seconds, "dry_run": self.dry_run,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "nodes": self.nodes,
                "bytes_between_nodes": self.bytes_between_nodes,
                "plan_bytes_between_nodes": self.plan_bytes_between_nodes, "phases": self.phases,
                "workers_report": [{"worker": r.worker, "bytes_read": r.bytes_read, "bytes_written": r.bytes_written,
                                    "bytes_carried": r.bytes_carried, "bytes_between_nodes": r.bytes_between_nodes,
                                    "staging_peak_bytes": r.staging_peak_bytes,
                                    "peak_rss_bytes": r.peak_rss_bytes, "peak_anonymous_bytes": r.peak_anonymous_bytes,
                                    "torch_imported": r.torch_imported, "phases": r.phases} for r in self.reports],
                "notes": list(self.notes)}

    @property
    def source_dp(self) -> int:
        return self.source_topology.dp

    @property
    def target_dp(self) -> int:
        return self.target_topology.dp

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.reports)

    def io_line(self) -> str:
        """"torch-free" when no worker imported torch, else "torch" and which workers did ("" when not
        recorded). A dry run records worker 0, which did all of its reading."""
        flags = [r.torch_imported for r in self.reports] if self.reports else [self.planner_imported_torch]
        if not flags or None in flags:
            return ""
        if not any(flags):
            return "torch-free (no worker imported torch)"
        first = next(iter(self.torch_files()), None)  # each file and why: the `torch  :` lines
        why = f"{first[0]}: {first[1]}" if first else ""
        return (f"torch (imported by worker(s) {', '.join(str(i) for i, f in enumerate(flags) if f)})"
                + (f": {why}" if why else ""))

    def torch_files(self) -> list[tuple[str, str]]:
        """[(path, why)] of every file some worker read or wrote with torch, each path once."""
        found: dict[str, str] = {}
        for path, why in [pair for r in self.reports for pair in r.torch_files] + list(self.planner_torch_files):
            found.setdefault(path, why)
        return sorted(found.items())

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes_written + r.bytes_carried for r in self.reports)

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase, the slowest worker's for each."""
        return _slowest(self.reports)

    def summary(self) -> str:
        tp = f" x {self.target_topology.tp} tp ranks" if self.target_topology.tp > 1 else ""
        lines = [f"reshard {'plan' if self.dry_run else 'done'}: {self.source} (tag {self.tag}) -> {self.destination}",
                 f"  source : {self.description}",
                 f"  layout : source {self.source_topology.describe()} -> target {self.target_topology.describe()}",
                 f"  target : {self.target_dp} dp ranks{tp}; {workers_phrase(self.workers, self.transport)}; "
                 + (f"{counted(self.rounds, 'round')} under a {_human(self.plan.budget_bytes)} budget"
                    if self.plan is not None else "whole files, no exchange rounds")]
        io = self.io_line()
        if io:
            lines.append(f"  io     : {io}")
        lines += [f"  torch  : {path}: {why}" for path, why in self.torch_files()]
        lines += [f"  note   : {note}" for note in self.notes]
        if self.dry_run:
            lines.append(f"  {'worker':>6} {'reads ranks':>14} {'writes ranks':>14} {'read':>10} {'send':>10} "
                         f"{'receive':>10} {'write':>10}")
            for t in (self.plan.traffic() if self.plan is not None else []):
                lines.append(f"  {t.worker:>6} {_ranks(t.source_ranks):>14} {_ranks(t.target_ranks):>14} "
                             f"{_human(t.bytes_read):>10} {_human(t.bytes_sent):>10} {_human(t.bytes_received):>10} "
                             f"{_human(t.bytes_written):>10}")
            lines.append("  (partitioned state only; the unpartitioned parts are copied as they are)")
            return "\n".join(lines)
        if not self.reports:
            return "\n".join(lines)
        rate = self.bytes_written / self.seconds / 1e9 if self.seconds else 0.0
        lines.append(f"  moved  : read {_human(self.bytes_read)}, wrote {_human(self.bytes_written)} in "
                     f"{self.seconds:.2f} s ({rate:.2f} GB/s written)")
        lines.append(f"  phases : {_phase_line(self.phases)} (slowest worker each)")
        if self.nodes > 1:
            lines.append(f"  nodes  : {self.nodes}; {_human(self.bytes_between_nodes)} crossed between them "
                         f"({self.bytes_between_nodes} bytes; the plan: {self.plan_bytes_between_nodes}); "
                         f"a leader held at most {_human(max(r.staging_peak_bytes for r in self.reports))} of it "
                         "at a time, leaving and arriving")
        lines.append(f"  {'worker':>6} {'reads ranks':>14} {'writes ranks':>14} {'read':>10} {'written':>10} "
                     f"{'peak RSS':>10} {'peak anon':>10}")
        for r in self.reports:
            lines.append(f"  {r.worker:>6} {_ranks(r.source_ranks):>14} {_ranks(r.target_ranks):>14} "
                         f"{_human(r.bytes_read):>10} {_human(r.bytes_written + r.bytes_carried):>10} "
                         f"{_human(r.peak_rss_bytes):>10} {_human(r.peak_anonymous_bytes):>10}")
        lines.append("  (peak RSS: the kernel's high-water mark of every resident page, VmHWM, what top and SLURM "
                     "show; peak anon: anonymous resident memory, sampled after planning and every round)")
        return "\n".join(lines)


@dataclass
class ReshardResult:
    """What a job did, checkpoint by checkpoint; `summary()` is what the CLI prints."""

    checkpoints: list[CheckpointResult] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def dry_run(self) -> bool:
        return any(c.dry_run for c in self.checkpoints)

    @property
    def bytes_read(self) -> int:
        return sum(c.bytes_read for c in self.checkpoints)

    @property
    def bytes_written(self) -> int:
        return sum(c.bytes_written for c in self.checkpoints)

    @property
    def reports(self) -> list[WorkerReport]:
        """Per worker, summed over checkpoints (peak RSS: the maximum)."""
        merged: dict[int, WorkerReport] = {}
        for checkpoint in self.checkpoints:
            for r in checkpoint.reports:
                m = merged.setdefault(r.worker, WorkerReport(r.worker, r.source_ranks, r.target_ranks))
                m.bytes_read += r.bytes_read
                m.bytes_written += r.bytes_written
                m.bytes_carried += r.bytes_carried
                m.peak_rss_bytes = max(m.peak_rss_bytes, r.peak_rss_bytes)
                m.peak_anonymous_bytes = max(m.peak_anonymous_bytes, r.peak_anonymous_bytes)
                for phase, seconds in r.phases.items():
                    m.phases[phase] = m.phases.get(phase, 0.0) + seconds
        return [merged[w] for w in sorted(merged)]

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "checkpoints": [c.as_dict() for c in self.checkpoints],
                "notes": list(self.notes)}

    def write_json(self, path: str) -> None:
        """`as_dict()` as JSON at `path` (`--result-json`), written whole, then renamed into place."""
        _write_json(path, self.as_dict())

    def summary(self) -> str:
        parts = [c.summary() for c in self.checkpoints] + [f"note: {n}" for n in self.notes]
        if len(self.checkpoints) > 1:
            parts.append(f"{len(self.checkpoints)} checkpoints in {self.seconds:.2f} s")
        return "\n".join(parts)


@dataclass
class ExportResult:
    """What an export did, whatever its format (reshard.export.runner.run_export returns it; each format's
    result adds what it wrote: reshard.export.dcp_job.DcpResult, safetensors_job.SafetensorsResult,
    universal.UniversalResult); `summary()` is what the CLI prints:

        export done: SRC (tag T) -> OUT{format_name}
          {written()}; N workers, R rounds, S s{; how_to_load()}
          {each line of details()}
          note: {each of all_notes()}
    """

    source: str
    destination: str
    tag: str
    workers: int
    rounds: int
    seconds: float = 0.0
    peak_rss_bytes: list = field(default_factory=list)
    """Each worker's peak RSS (VmHWM), gathered on every worker."""
    notes: list = field(default_factory=list)

    format_name = ""
    """What the first line names the output as, after OUT: " (PyTorch DCP)"."""

    @classmethod
    def of(cls, done: "ExportResult", **written):
        """This format's result: the figures every export has (`done`, run_export's) and what it wrote."""
        return cls(**{f.name: getattr(done, f.name) for f in fields(ExportResult)}, **written)

    def written(self) -> str:
        """What the export wrote, the second line's start: "3 .distcp files"."""
        return ""

    def how_to_load(self) -> list[str]:
        """What follows the run's figures on the second line, each after "; "."""
        return []

    def details(self) -> list[str]:
        """Lines between the figures and the notes."""
        return []

    def all_notes(self) -> list[str]:
        return list(self.notes)

    def summary(self) -> str:
        lines = [f"export done: {self.source} (tag {self.tag}) -> {self.destination}{self.format_name}",
                 f"  {self.written()}; {counted(self.workers, 'worker')}, {counted(self.rounds, 'round')}, "
                 f"{self.seconds:.1f} s" + "".join(f"; {part}" for part in self.how_to_load())]
        lines += [f"  {line}" for line in self.details()]
        lines += [f"  note: {note}" for note in self.all_notes()]
        return "\n".join(lines)


def report_result(result, result_json: str | None = None) -> None:
    """Worker 0's last step of every command that ran a job (the reshard and its exports, by torchrun or
    `--workers`): a ReshardResult as JSON at `result_json` when asked (`--result-json`, a path the options
    checked: ReshardOptions.validate; the exports take none), then `result`'s summary on stdout."""
    if result_json:
        result.write_json(result_json)
    print_summary(result.summary())


def print_summary(text: str) -> None:
    """Print `text` on stdout; when the reader has gone (`reshard inspect X | head`), stop writing
    quietly: what was asked for has run, and its exit status stands."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        drop_stdout()


def drop_stdout() -> None:
    """Point stdout at /dev/null, so that what Python still holds for the closed pipe, and any later
    print, goes nowhere instead of raising again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def counted(n: int, noun: str) -> str:
    """(3, "round") -> "3 rounds", (1, "round") -> "1 round": summaries say counts as words do."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def workers_phrase(workers: int, transport: str) -> str:
    """How many workers ran a job and how they talked, as the summary says it: "1 worker, this
    process alone (nothing exchanged between processes)", "4 workers over torch.distributed/gloo"."""
    if transport == "local":  # reshard.transport.local: one process, every rank's slices in hand
        return f"{counted(workers, 'worker')}, this process alone (nothing exchanged between processes)"
    return f"{counted(workers, 'worker')} over {transport}"


def _slowest(reports) -> dict[str, float]:
    slowest: dict[str, float] = {}
    for report in reports:
        for phase, seconds in report.phases.items():
            slowest[phase] = max(slowest.get(phase, 0.0), seconds)
    return {phase: slowest[phase] for phase in PHASES if phase in slowest}


def _phase_line(phases: dict[str, float]) -> str:
    return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in phases.items())


def _ranks(ranks) -> str:
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def write_refusal_json(path: str, error: BaseException, exit_status: int = 2) -> None:
    """The record of a refused job at `path` (`--result-json`): {"refused": true, "exit_status",
    "error"}, so that a caller judges a refusal by a file and the exit status, not by what reached
    a launcher's output (under load, a launcher can lose its workers' last lines)."""
    _write_json(path, {"refused": True, "exit_status": exit_status, "error": str(error)})


def _write_json(path: str, record: dict) -> None:
    """`record` as JSON at `path`, written whole into a new file beside it, then renamed into place
    (reshard.files.paths.write_file_atomically: never through a planted link). `path` was checked
    when the options were (ReshardOptions.validate: outside SRC and DST, not the job file)."""
    import json
    write_file_atomically(path, json.dumps(record, indent=2))
