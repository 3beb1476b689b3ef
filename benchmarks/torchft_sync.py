"""torchft's sync of the same θ that benchmarks/elastic_sync.py gives the elastic syncer: what
a user would run instead (torchft's Lighthouse, one Manager per replica, gloo, and its DiLoCo
with an outer Nesterov step), timed on the same cores.

Each of M replica processes holds one float32 parameter of `--mb` MB and takes one inner SGD
step on a loss linear in it per sync (DiLoCo's sync_every = 1): the pseudo-gradient is
all-reduced over gloo and the outer optimizer steps. The seconds per sync are the median gap
between consecutive syncs' ends on replica 0, the first two left out (the quorum's setup).

Run with a Python that has torch and torchft (not a dependency of diloco-jax), for example:

    python3.11 -m venv /tmp/torchft && /tmp/torchft/bin/pip install torch torchft==0.2.0
    /tmp/torchft/bin/python benchmarks/torchft_sync.py --mb 100 --workers 2 --rounds 8

It prints one JSON line: {"torchft": version, "torch": version, "sync_seconds": median,
"sync_gaps": [...]}. benchmarks/elastic_sync.py --torchft-python PATH runs it in its own run.
"""

import argparse
import json
import multiprocessing
import statistics
import time
from datetime import timedelta


def replica(index: int, args: argparse.Namespace, lighthouse: str, out) -> None:
    """One replica's loop; replica 0 sends its sync times to `out`."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    # The replica group's store (torchrun would start it; a group of one process here).
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(int(args.mb * 1e6) // 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        min_replica_size=args.workers,
        use_async_quorum=False,  # as torchft's DiLoCo requires
        replica_id=str(index),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=120),
    )
    ends = []
    with DiLoCo(manager, [model], inner, outer, sync_every=1):
        for step in range(args.rounds):
            inner.zero_grad()
            (model.w.mean() * (1.0 + index + step)).backward()
            inner.step()  # DiLoCo's hook syncs here (every step)
            ends.append(time.perf_counter())
    manager.shutdown(wait=False)
    if index == 0:
        out.send([b - a for a, b in zip(ends, ends[1:], strict=False)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    import importlib.metadata

    import torch
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.workers)
    receive, send = multiprocessing.Pipe(duplex=False)
    context = multiprocessing.get_context("spawn")
    replicas = [
        context.Process(target=replica, args=(m, args, lighthouse.address(), send))
        for m in range(args.workers)
    ]
    for p in replicas:
        p.start()
    gaps = receive.recv()
    for p in replicas:
        p.join(timeout=120)
    lighthouse.shutdown()
    print(json.dumps({
        "torchft": importlib.metadata.version("torchft"), "torch": torch.__version__,
        "sync_seconds": round(statistics.median(gaps[2:]), 4),
        "sync_gaps": [round(x, 4) for x in gaps],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
