"""Artifacts changed on purpose, as a user editing one by hand would (checksums written again)."""
import json
import tarfile

from tvmdm.runtime.artifact import CHECKSUMS, write_members


def edited_copy(path, out, edit_manifest) -> str:
    """A copy of the artifact ``path`` at ``out`` whose manifest ``edit_manifest(manifest)`` changed in place."""
    with tarfile.open(path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name != CHECKSUMS}
    manifest = json.loads(members["manifest.json"])
    edit_manifest(manifest)
    members["manifest.json"] = json.dumps(manifest).encode()
    return write_members(out, members)
