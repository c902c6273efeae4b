"""The one skeleton every data-moving command runs, and the contract its sources and sinks keep.

    from reshard.jobs.execute import execute
    execute(plan, transport,
            open_source=lambda: SourceReader.open(source, plan.ownership.source_ranks_of(transport.rank), target=target),
            open_sink=lambda: TargetWriter.create(...),
            opening="opening source files and creating target files",
            finish=lambda reader, writer: writer.finish())

The offline job (`reshard.jobs.collective_job`), the in-job load (`reshard.deepspeed`), `verify --against`
(`reshard.verify`), the exports (`reshard.export.runner`) and a SLURM array task
(`reshard.jobs.array_job`, one worker over a `LocalTransport`) all move bytes the same way:

    plan (pure, identical on every worker)
      -> every worker opens its SliceSource and its SliceSink          (collective agreement)
      -> exchange rounds: read_batch ... all_to_all ... write, sync     (reshard.transport.exchange)
      -> every worker finishes its sink                                (collective agreement)
      -> both endpoints are closed in `finally`, on success and on failure alike

What differs between callers is only the sink (files in staging, tensors in memory, a
comparison with existing files, safetensors shards, a universal checkpoint) and what they do
after the exchange (publish, load, report). Each caller passes those; the skeleton is here.
"""
from __future__ import annotations

from typing import Callable, Protocol

from reshard.jobs.progress import Progress
from reshard.transport.collective import check_peers
from reshard.transport.exchange import run_rounds
from reshard.planning.plan import ReshardPlan

Slot = tuple
"""(space name, buffer index, stream name): one flat tensor of one rank, e.g. ("optim", 0, "exp_avg")."""


class SliceSource(Protocol):
    """Where a worker reads the source ranks it owns (`plan.ownership.source_ranks_of(worker)`).

    Call order, on every worker: created (opening and validating its files) before round 0;
    `read_batch` once per round, from the exchange's reader thread only, never concurrently
    with itself (it may read the batch's parts in parallel threads of its own; they fill
    disjoint buffers); `close` exactly once at the end, also after a failure, and it must
    tolerate a half-opened state. A source never modifies what it reads.
    """

    bytes_read: int

    def read_batch(self, reads: list[tuple[int, Slot, int, int, memoryview]]) -> None:
        """For each (rank, slot, element, itemsize, out): fill `out` with elements
        [element, element + len(out) // itemsize) of `slot` of source `rank`."""

    def close(self) -> None:
        """Release every file handle; idempotent."""


class SliceSink(Protocol):
    """Where a worker puts the target ranks it owns (`plan.ownership.target_ranks_of(worker)`).

    Call order, on every worker: created before round 0 (every worker creates its own, then
    all agree through `check_peers`); `write` any number of times from the exchange's main
    thread, in round order; `sync` after the rounds that end a durable stretch (the data
    written so far must then survive a crash); then the caller's finish step (`finish` for
    file sinks: fsync, hash, close); `close` exactly once at the end, also after a failure,
    idempotent (it may follow `finish`). A sink may also have `write_gather(rank, slot, element,
    itemsize, pieces)`, `write` of a list of views back to back: the exchange then hands it each
    round's runs that continue each other in one call (formats.deepspeed_files.target_writer.TargetWriter does).
    """

    def write(self, rank: int, slot: Slot, element: int, itemsize: int, data: memoryview) -> None:
        """Store `data`: elements [element, element + len(data) // itemsize) of `slot` of target `rank`."""

    def sync(self) -> None:
        """Make every write so far durable (a no-op for sinks that hold nothing on disk)."""

    def close(self) -> None:
        """Release every handle; idempotent."""


def execute(plan: ReshardPlan, transport, *, open_source: Callable[[], SliceSource],
            open_sink: Callable[[], SliceSink], opening: str,
            opened: Callable[[SliceSource, SliceSink], None] | None = None,
            finish: Callable[[SliceSource, SliceSink], object] | None = None, finishing: str = "finishing",
            after: Callable[[SliceSource, SliceSink, object], object] | None = None,
            progress: Progress | None = None, **rounds) -> object:
    """Run one plan on this worker: open both endpoints, agree, exchange, finish, agree, close.

    Every worker of `transport` calls this with the same plan. `open_source` / `open_sink`
    create this worker's endpoints; a failure on any worker stops all of them at the
    agreement named `opening` (so nobody waits in a collective for a peer that gave up);
    `opened(source, sink)` then runs on every worker before round 0 (background copies, a
    journal saying the skeletons exist).
    `rounds` go to `reshard.transport.exchange.run_rounds` (start_round, durable_every_bytes,
    on_durable, on_round). `finish(source, sink)` runs on every worker after the last round
    and its failure, too, is agreed on (`finishing`). `after(source, sink, finished)` runs
    while the endpoints are still open (a caller's publish step) and its result is returned;
    otherwise `finish`'s result is. Both endpoints are closed in `finally`.
    `progress` (reshard.jobs.progress), when given, draws the rounds' bytes from `opened` on.
    """
    source = sink = None
    try:
        failure = None
        try:
            source = open_source()
            sink = open_sink()
        except Exception as error:
            failure = error
        check_peers(transport, failure, opening)
        if opened is not None:
            opened(source, sink)
        if progress is not None:
            progress.start_rounds(plan, rounds.get("start_round", 0))
            rounds["on_round"] = _also(progress, rounds.get("on_round"))
        run_rounds(plan, transport, source, sink, **rounds)
        if progress is not None:
            progress.close()
        finished = None
        if finish is not None:
            failure = None
            try:
                finished = finish(source, sink)
            except Exception as error:
                failure = error
            check_peers(transport, failure, finishing)
        return after(source, sink, finished) if after is not None else finished
    finally:
        for endpoint in (source, sink):
            if endpoint is not None:
                endpoint.close()
        if progress is not None:
            progress.close()


def _also(progress: Progress, on_round: Callable[[int, int], None] | None) -> Callable[[int, int], None]:
    """on_round that advances `progress` by the round's bytes, then runs the caller's `on_round`."""
    def each_round(round_index: int, nbytes: int) -> None:
        progress.update(nbytes)
        if on_round is not None:
            on_round(round_index, nbytes)
    return each_round
