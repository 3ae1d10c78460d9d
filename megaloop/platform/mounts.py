"""This process's mounts as the kernel lists them (``/proc/self/mountinfo``, proc(5)), and the one
that holds a given path: inside a container, that tells a file system mounted from the host (a
bind mount of the job's, or one a site's enroot/pyxis configuration adds, such as /lustre) from
the container's own root file system and its memory file systems (enroot mounts a tmpfs on /tmp).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")

# The kernel writes a space, tab, newline or backslash in a path field as a 3-digit octal escape
# (\040, \011, \012, \134), so that the fields stay separated by single spaces.
_ESCAPE = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    point: Path  # where it is mounted
    fstype: str


def read_mounts(mountinfo: Path = MOUNTINFO) -> list[Mount]:
    """The mounts listed in ``mountinfo``, in its order (OSError if it cannot be read). A line is
    ``ID PARENT MAJOR:MINOR ROOT POINT OPTIONS [OPTIONAL FIELDS...] - FSTYPE SOURCE SUPER_OPTIONS``,
    with as many optional fields as the mount has propagation tags."""
    mounts = []
    for line in mountinfo.read_bytes().splitlines():
        fields = line.split(b" ")
        separator = fields.index(b"-", 6)
        mounts.append(Mount(Path(_unescape(fields[4])), _unescape(fields[separator + 1])))
    return mounts


def _unescape(field: bytes) -> str:
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), field))


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount that holds ``path`` (absolute, resolved): the one at its deepest mount point, and
    of several at that point the last listed, which was mounted over the others. None when none
    is listed: a chroot lists no mount for its root directory unless that is a mount point."""
    holding = [m for m in mounts if m.point == path or m.point in path.parents]
    return max(reversed(holding), key=lambda m: len(m.point.parts), default=None)
