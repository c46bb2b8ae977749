"""The gRPC API: adapterserve.proto (shipped for stubs in any language) and its generated Python modules."""
