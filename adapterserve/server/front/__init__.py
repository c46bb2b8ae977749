"""Front workers for the direct replica's own gRPC port (setting `replica_grpc.workers`).

    pool.py        the replica's side: starts N worker processes on the port, guards the port,
                   replaces a worker that exits, stops them with the replica
    worker.py      a worker process: a grpc.aio server forwarding every call's bytes
    bridge.py      the replica's end of a worker's link: runs each call's Ingress handler
    context.py     the call context those handlers see there
    frames.py      the link: batched, length-prefixed frames over a Unix socketpair
    methods.py     the methods forwarded, from the services' descriptors
    options.py     the workers' gRPC server options
    port_audit.py  who else listens on the port

A worker imports gRPC and the protos only; the replica runs every handler, so auth, quotas,
admission, validation, resolution and the engine stay with one owner, as with one listener.
"""
