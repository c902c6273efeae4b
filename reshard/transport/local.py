"""One worker alone: every exchange is with itself.

    from reshard.transport.local import LocalTransport
    run_rounds(plan, LocalTransport(), reader, writer)   # a plan for one worker, no collectives

Used when no launcher started several workers, and by SLURM array tasks (reshard.jobs.array_job),
each of which runs its share of the plan alone.
"""
from __future__ import annotations


class LocalTransport:
    """A single worker: every exchange is with itself."""

    rank, size, name = 0, 1, "local"

    def all_to_all(self, send, send_counts, recv_counts, out=None):
        assert send_counts == recv_counts, (send_counts, recv_counts)
        if out is None:
            return send.copy()
        out[...] = send
        return out

    def broadcast_object(self, obj, src=0):
        return obj

    def all_gather_object(self, obj):
        return [obj]

    def barrier(self):
        pass

    def close(self):
        pass
