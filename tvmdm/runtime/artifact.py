"""One-file deployable artifacts: a tar holding the compiled library, the parameters and a manifest.

``load`` needs only TVM's runtime and numpy: no onnx, no onnxruntime.
Layout inside the tar: ``model.so`` (relax executable), ``params.npz`` (weights, names in manifest order),
``manifest.json`` (format version, target kind, inputs/outputs with shapes and dtypes, index bounds),
``checksums.json`` (sha256 of the other three, checked before any is used).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tarfile
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from tvmdm.core.errors import ArtifactError, TvmdmError

if TYPE_CHECKING:
    from tvmdm.runtime.runner import ModelRunner

FORMAT = "tvmdm-artifact"
VERSION = 1


MEMBERS = ("manifest.json", "model.so", "params.npz")
CHECKSUMS = "checksums.json"  # sha256 of each member: a damaged file is refused before anything in it is used


def _sha256(stream) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: stream.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def write_members(path, members: dict[str, bytes]) -> str:
    """Write ``members`` (name -> bytes) and their checksums as the tar ``path``, atomically: the real name
    appears only once the file is complete, and a failed write leaves nothing behind."""
    path = os.fspath(path)
    _check_writable(path)
    sums = {name: hashlib.sha256(data).hexdigest() for name, data in members.items()}
    tmp_out = path + ".partial"
    try:
        with tarfile.open(tmp_out, "w") as tar:
            for name, data in list(members.items()) + [(CHECKSUMS, json.dumps(sums, indent=1).encode())]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp_out, path)
    except OSError as err:
        raise ArtifactError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        if os.path.exists(tmp_out):
            os.remove(tmp_out)
    return path


def write_bundle(path, manifest: dict, executable, arrays: dict[str, np.ndarray]) -> str:
    """Write a tar of manifest.json (plus the array names, in order), model.so and params.npz; atomically."""
    _check_writable(os.fspath(path))  # before the library is built, not only once it is (write_members)
    manifest = dict(manifest, params=list(arrays))
    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, "model.so")
        executable.export_library(lib)
        with open(lib, "rb") as f:
            lib_bytes = f.read()
    buf = io.BytesIO()
    np.savez(buf, **{f"p{i}": v for i, v in enumerate(arrays.values())})
    return write_members(path, {"manifest.json": json.dumps(manifest, indent=1).encode(), "model.so": lib_bytes,
                                "params.npz": buf.getvalue()})


def _verify(tar: tarfile.TarFile, path: str) -> None:
    """Every member matches the checksum written with it (a flipped bit in model.so could crash the process
    that loads it; one in the manifest could change a shape)."""
    try:
        sums = json.loads(tar.extractfile(CHECKSUMS).read())
    except KeyError:
        raise ArtifactError(f"{path}: no {CHECKSUMS} (damaged, or written by a tvmdm before checksums); export "
                            "the model again") from None
    for name in MEMBERS:
        if not isinstance(sums, dict) or _sha256(tar.extractfile(name)) != sums.get(name):
            raise ArtifactError(f"{path}: {name} does not match its checksum (damaged or changed after export); "
                                "export the model again")


def _check_writable(path: str) -> None:
    if os.path.isdir(path):
        raise ArtifactError(f"cannot write {path}: it is a directory; give a file name, e.g. {path}/model.tvmdm")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ArtifactError(f"cannot write {path}: folder {folder} does not exist")


@contextlib.contextmanager
def manifest_entries(path):
    """Around the reading of a manifest's entries: one missing or malformed (a hand-edited manifest) is an
    ArtifactError that names it, not a KeyError."""
    try:
        yield
    except TvmdmError:
        raise
    except KeyError as err:
        raise ArtifactError(f"{path}: no entry {err.args[0]!r} in the artifact's manifest.json or arrays "
                            "(hand-edited or damaged); export the model again") from None
    except (TypeError, ValueError, AttributeError, IndexError) as err:
        raise ArtifactError(f"{path}: manifest.json has a malformed entry ({err}); export the model again") from None


def read_bundle(path, fmt: str = FORMAT, version: int = VERSION):
    """(manifest, loaded library module, arrays by name) of a bundle written by ``write_bundle``."""
    from tvm import runtime

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ArtifactError(f"artifact not found: {path}")
    try:
        with tarfile.open(path, "r") as tar:
            _verify(tar, path)
            manifest = json.loads(tar.extractfile("manifest.json").read())
            arrays = _read_params(tar, manifest)
            lib_bytes = tar.extractfile("model.so").read()
    except ArtifactError:
        raise
    except (tarfile.TarError, KeyError, ValueError, OSError, AttributeError, EOFError) as err:
        raise ArtifactError(f"{path}: not a tvmdm artifact or damaged: {err}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: manifest.json is not a JSON object (hand-edited or damaged)")
    if manifest.get("format") != fmt or manifest.get("version") != version:
        raise ArtifactError(f"{path}: unsupported artifact format {manifest.get('format')!r} "
                            f"version {manifest.get('version')!r} (expected {fmt} v{version})")
    with tempfile.TemporaryDirectory() as tmp:
        # The shared library must be a file to be dlopen'ed; once loaded the file can go.
        lib_path = os.path.join(tmp, "model.so")
        with open(lib_path, "wb") as f:
            f.write(lib_bytes)
        try:
            lib = runtime.load_module(lib_path)
        except RuntimeError as err:
            raise ArtifactError(f"{path}: compiled for {manifest.get('target_kind', '?')}, but this TVM runtime cannot load "
                                f"it here ({str(err).strip().splitlines()[-1]})") from None
    return manifest, lib, arrays


def _read_params(tar, manifest) -> dict:
    """The arrays of a bundle's params.npz, read from the archive member in place (one copy in memory)."""
    with np.load(tar.extractfile("params.npz")) as npz:
        return {name: npz[f"p{i}"] for i, name in enumerate(manifest["params"])}


def read_params(path) -> dict:
    """The weights of a bundle by name, read again from its file."""
    path = os.fspath(path)
    with tarfile.open(path, "r") as tar:
        _verify(tar, path)
        return _read_params(tar, json.loads(tar.extractfile("manifest.json").read()))


def runner_fields(runner) -> dict:
    """The manifest entries of any compiled module (a Compiled or a TrainStep): its target kind, inputs,
    outputs, index bounds and whether it uses the AMX tiles."""
    return {
        "target_kind": runner.target_kind,
        "inputs": [s.to_json() for s in runner.inputs],
        "outputs": [s.to_json() for s in runner.outputs],
        "index_bounds": {k: list(v) for k, v in runner.index_bounds.items()},
        "amx": runner.uses_amx,
    }


def runner_kwargs(manifest: dict) -> dict:
    """``runner_fields`` read back as ModelRunner's (and TrainStep's) keyword arguments; call it inside
    ``manifest_entries``. (The AMX flag is set on the runner after construction.)"""
    from tvmdm.core.spec import TensorSpec

    return {"inputs": [TensorSpec.from_json(s) for s in manifest["inputs"]],
            "outputs": [TensorSpec.from_json(s) for s in manifest["outputs"]],
            "target_kind": manifest["target_kind"],
            "index_bounds": {k: tuple(v) for k, v in manifest["index_bounds"].items()}}


def runner_manifest(runner) -> dict:
    """What ``load`` needs beside the library and the weights to rebuild ``runner`` (a Compiled)."""
    return {"format": FORMAT, "version": VERSION, **runner_fields(runner), "copied_outputs": runner.copied_outputs}


def export_artifact(runner, path) -> str:
    """Write ``runner`` (a Compiled) to ``path``; returns the path written."""
    return write_bundle(path, runner_manifest(runner), runner._executable, runner.params())


def runner_from_parts(manifest: dict, lib, params: dict, path, reload_params=None) -> "ModelRunner":
    """A runner from a manifest (``runner_manifest``), a loaded library and the weights by name; ``path`` names
    the source in errors."""
    from tvmdm.runtime.runner import ModelRunner

    with manifest_entries(path):
        runner = ModelRunner(lib, params=params, reload_params=reload_params, **runner_kwargs(manifest))
        runner.uses_amx = bool(manifest.get("amx", False))  # (written since the AMX kernels; older: none)
        runner.copied_outputs = manifest.get("copied_outputs")  # (older artifacts: none, every output copied)
        return runner


def load(path) -> "ModelRunner":
    """Load an artifact written by ``Compiled.export``; returns a runner with ``run``."""
    manifest, lib, params = read_bundle(path)
    return runner_from_parts(manifest, lib, params, path, reload_params=lambda: read_params(path))
