"""What every export runs on every worker, over the one skeleton (`reshard.execute`): open, exchange, finish, publish.

    from reshard.export.runner import run_export
    run_export(transport, source, plan, open_writer=lambda files: MyWriter(...),
               publish=lambda: write_index(...), trust_pickle=False)

1. each worker opens (and validates) the source rank files it reads and lets `open_writer`
   create the output files it owns (`plan.ownership` target ranks); all agree on success;
2. all workers run the plan's rounds (`reshard.execute.execute`): the writer receives
   slices through `write(rank, slot, element, itemsize, data)`;
3. `writer.finish()` (its own copies, fsync, close); all agree;
4. worker 0 runs `publish()` (the file that marks the output complete); all agree.
Returns each worker's peak RSS in bytes, gathered on every worker.
"""
from __future__ import annotations

import resource

from reshard.collective import check_peers
from reshard.execute import execute
from reshard.formats.deepspeed_spec import SourceCheckpoint
from reshard.plan import ReshardPlan
from reshard.source_reader import SourceReader


def run_export(transport, source: SourceCheckpoint, plan: ReshardPlan, open_writer, publish, *,
               trust_pickle: bool = False) -> list[int]:
    own = plan.ownership

    def publish_on_worker_0(reader, writer, finished) -> None:
        failure = None
        if transport.rank == 0:
            try:
                publish()
            except Exception as error:
                failure = error
        check_peers(transport, failure, "publishing the output")

    execute(plan, transport,
            open_source=lambda: SourceReader.open(source, own.source_ranks_of(transport.rank),
                                                  trust_pickle=trust_pickle),
            open_sink=lambda: open_writer(own.target_ranks_of(transport.rank)),
            opening="opening source files and creating output files",
            finish=lambda reader, writer: writer.finish(), finishing="writing output files",
            after=publish_on_worker_0)
    return transport.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
