"""torchrun entry for tests: reshard.deepspeed.share_file over a real gloo group, each send recorded.

    torchrun --standalone --nproc_per_node=4 tests/entry/share_file.py OUT_DIR '[["model_states", 0, [0, 2]], ...]'

Every rank builds its own in-memory "files" ({"rank": r, "values": tensor}) and calls `share_file` for
each case (key, owner, loaders) in order, as the in-job loads do. Each rank writes OUT_DIR/rank-R.json:
per case what it got (the owner's rank and values, or null) and the ranks it sent to
(TorchDistributedTransport.send_object, recorded).
"""
import json
import os
import sys

import torch
import torch.distributed as dist


def main(out_dir: str, cases: list) -> None:
    from reshard.deepspeed import share_file
    from reshard.transport import TorchDistributedTransport
    dist.init_process_group("gloo")
    transport = TorchDistributedTransport()
    sent = []
    send = transport.send_object
    transport.send_object = lambda obj, dst: (sent.append(dst), send(obj, dst))[1]
    objects = {key: {"rank": transport.rank, "values": torch.arange(6, dtype=torch.float32) + 10 * transport.rank}
               for key, owner, _ in cases if owner == transport.rank}
    record = {}
    for key, owner, loaders in cases:
        del sent[:]
        got = share_file(transport, objects, key, owner, loaders)
        record[key] = {"got": None if got is None else {"rank": got["rank"], "values": got["values"].tolist()},
                       "sent_to": list(sent)}
    dist.barrier()
    with open(os.path.join(out_dir, f"rank-{transport.rank}.json"), "w") as fd:
        json.dump(record, fd)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
