"""Calls every RPC of the AdapterServe service, and grpc.health.v1 Check, through Python
stubs generated from the shipped .proto into STUB_DIR (not the package's own modules);
prints one JSON object of what came back. Run by test_fresh_stubs.py in a process of its
own: the fresh modules define the same protobuf names as ours.

    python fresh_stubs.py STUB_DIR HOST:PORT API_KEY ADAPTER_DIR UPLOAD_NAME
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

STUB_DIR, SERVER, API_KEY, ADAPTER_DIR, UPLOAD_NAME = sys.argv[1:6]
sys.path.insert(0, STUB_DIR)
import adapterserve_pb2 as pb  # noqa: E402
import adapterserve_pb2_grpc as pb_grpc  # noqa: E402

METADATA = (("authorization", f"Bearer {API_KEY}"),)
TIMEOUT_S = 120


def as_dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True)


def status_of(call) -> str:
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def upload_requests(directory: Path, name: str):
    files = sorted(p for p in directory.iterdir() if p.is_file())
    entries = [pb.FileEntry(path=p.name, size=p.stat().st_size, sha256=hashlib.sha256(p.read_bytes()).hexdigest())
               for p in files]
    yield pb.UploadAdapterRequest(header=pb.UploadHeader(name=name, files=entries))
    for p in files:
        yield pb.UploadAdapterRequest(chunk=pb.FileChunk(path=p.name, offset=0, data=p.read_bytes()))


def main() -> None:
    channel = grpc.insecure_channel(SERVER)
    stub, health = pb_grpc.AdapterServeStub(channel), health_pb2_grpc.HealthStub(channel)
    call = {"metadata": METADATA, "timeout": TIMEOUT_S}
    sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = {"stub_module": pb.__file__, "ours_imported": [m for m in sys.modules if m.split(".")[0] == "adapterserve"]}
    out["health"] = {service: health_pb2.HealthCheckResponse.ServingStatus.Name(
        health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S).status)
        for service in ("", "adapterserve.v1.AdapterServe")}
    out["server_info"] = as_dict(stub.ServerInfo(pb.ServerInfoRequest(), **call))
    request = pb.GenerateRequest(text="The lighthouse keeper", adapter="sql", sampling=sampling)
    out["generate"] = [as_dict(m) for m in stub.Generate(request, **call)]
    out["generate_unknown_adapter"] = status_of(lambda: list(stub.Generate(
        pb.GenerateRequest(text="Hi", adapter="no-such-adapter", sampling=sampling), **call)))
    texts = ["what a wonderful, moving film", "a dull and boring mess"]
    out["classify"] = as_dict(stub.Classify(pb.ClassifyRequest(texts=texts, adapter="sentiment"), **call))
    out["embed"] = as_dict(stub.Embed(pb.EmbedRequest(texts=texts), **call))
    out["upload"] = as_dict(stub.UploadAdapter(upload_requests(Path(ADAPTER_DIR), UPLOAD_NAME), **call))
    ref = out["upload"]["ref"]
    out["list"] = as_dict(stub.ListAdapters(pb.ListAdaptersRequest(name=UPLOAD_NAME), **call))
    out["get"] = as_dict(stub.GetAdapter(pb.GetAdapterRequest(ref=ref), **call))
    out["delete"] = as_dict(stub.DeleteAdapter(pb.DeleteAdapterRequest(ref=UPLOAD_NAME), **call))
    out["get_deleted"] = status_of(lambda: stub.GetAdapter(pb.GetAdapterRequest(ref=ref), **call))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
