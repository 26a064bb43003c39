"""Reading what a CUDA build generated, without a GPU."""


def cuda_source(compiled) -> str:
    host = compiled._executable.mod
    devices = [m for m in host.imports] + [m for h in host.imports for m in h.imports]
    sources = [m.inspect_source() for m in devices if m.kind == "cuda"]
    assert sources, [m.kind for m in devices]
    return sources[0]


def kernel_sources(source: str) -> dict[str, str]:
    """Each ``__global__`` function's body by name (TVM may split one TIR kernel into ``name_kernel``,
    ``name_kernel_1``, ...)."""
    import re

    found = {}
    for match in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^)]*\) \{', source):
        end = source.find('\nextern "C" __global__', match.end())
        found[match.group(1)] = source[match.end():end if end >= 0 else len(source)]
    return found


def launch_extents(func) -> dict[str, int]:
    """blockIdx.* / threadIdx.* extents of a scheduled TIR kernel (its grid and block), read off its loops bound
    to them."""
    import re

    extents = {}
    for extent, axis in re.findall(r'T\.thread_binding\((?:T\.int64\()?(\d+)\)?, thread="(\w+\.\w)"\)', func.script()):
        extents[axis] = int(extent)
    return extents
