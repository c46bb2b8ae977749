"""Tensor parallelism, the engine side: rank 0 (the engine: scheduler, slots, requests)
drives ranks 1..N-1 (workers holding their shard of the backbone and of every adapter
pool) in lockstep.

    lockstep.py   rank 0's ordered channel to the workers: steps, slot fills and clears,
                  KV block copies, graph capture, shutdown; a dead worker -> EngineBroken
    worker.py     a worker: joins the group, loads its shard, runs each command
    inbox.py      a worker's adapters' parts by key, each staged for loading as it arrives
    adapter_post.py  an adapter's part to a worker: one blob and a pickled skeleton, as a
                  shared-memory file on rank 0's host, else over the connection
    launch.py     starts the workers (Ray actors in a placement group, or local processes)
    group.py      torch.distributed rendezvous and the checks of a tensor-parallel size
    stack_dump.py every thread's Python stack on SIGUSR1, in rank 0 and each worker

docs/tensor_parallel.md has the design and its reasons.
"""

RAY_CPU_PER_WORKER = 0.01  # a CPU worker's bundle (Ray refuses empty ones): a sliver, not a core
