"""What models are built from: the adapter-aware linear, paged attention, the
step's batch context, the base GEMM and the bottleneck pools. Imports only
kernels/ (and adapter data types); models/ and engine/ import it, never the reverse."""
