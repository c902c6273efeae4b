"""The skeleton every export runs on every worker: open, exchange, finish, publish.

    from reshard.export.runner import run_export
    run_export(transport, source, plan, open_writer=lambda files: MyWriter(...),
               publish=lambda: write_index(...), trust_pickle=False)

1. each worker opens (and validates) the source rank files it reads and lets `open_writer`
   create the output files it owns (`plan.ownership` target ranks); all agree on success;
2. all workers run the plan's rounds (`reshard.exchange.run_rounds`): the writer receives
   slices through `write(rank, slot, element, itemsize, data)`;
3. `writer.finish()` (its own copies, fsync, close); all agree;
4. worker 0 runs `publish()` (the file that marks the output complete); all agree.
Returns each worker's peak RSS in bytes, gathered on every worker.
"""
from __future__ import annotations

import resource

from reshard.collective import check_peers
from reshard.exchange import run_rounds
from reshard.formats.deepspeed_spec import SourceCheckpoint
from reshard.plan import ReshardPlan
from reshard.source_reader import SourceReader


def run_export(transport, source: SourceCheckpoint, plan: ReshardPlan, open_writer, publish, *,
               trust_pickle: bool = False) -> list[int]:
    own = plan.ownership
    reader = writer = None
    failure = None
    try:
        try:
            reader = SourceReader.open(source, own.source_ranks_of(transport.rank), trust_pickle=trust_pickle)
            writer = open_writer(own.target_ranks_of(transport.rank))
        except Exception as error:
            failure = error
        check_peers(transport, failure, "opening source files and creating output files")
        run_rounds(plan, transport, reader, writer)
        try:
            writer.finish()
        except Exception as error:
            failure = error
        check_peers(transport, failure, "writing output files")
        if transport.rank == 0:
            try:
                publish()
            except Exception as error:
                failure = error
        check_peers(transport, failure, "publishing the output")
    finally:
        for endpoint in (reader, writer):
            if endpoint is not None:
                endpoint.close()
    return transport.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
