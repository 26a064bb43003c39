"""Reading what a CUDA build generated, without a GPU."""


def cuda_source(compiled) -> str:
    host = compiled._executable.mod
    devices = [m for m in host.imports] + [m for h in host.imports for m in h.imports]
    sources = [m.inspect_source() for m in devices if m.kind == "cuda"]
    assert sources, [m.kind for m in devices]
    return sources[0]
