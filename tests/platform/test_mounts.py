"""Which mount holds a path, from a mount table as the kernel writes it (an enroot container's,
tests/platform/mountinfo_enroot.txt, and this process's own)."""

from pathlib import Path

from megaloop.platform.mounts import MOUNTINFO, mount_of, read_mounts

ENROOT = Path(__file__).with_name("mountinfo_enroot.txt")


def _holder(path: str, mountinfo: Path = ENROOT) -> tuple[str, str]:
    mount = mount_of(Path(path), read_mounts(mountinfo))
    return str(mount.point), mount.fstype


def test_the_deepest_mount_point_holds_a_path_and_the_last_mount_at_a_point_is_on_top():
    assert _holder("/results/run") == ("/", "xfs")  # the container's root
    assert _holder("/lustre/alice/run") == ("/lustre", "lustre")
    assert _holder("/lustre/fs1/cache/x") == ("/lustre/fs1/cache", "ramfs")
    assert _holder("/lustre/fs1/cached") == ("/lustre", "lustre")  # a name, not a parent
    assert _holder("/tmp") == ("/tmp", "tmpfs")
    assert _holder("/scratch/run") == ("/scratch", "tmpfs")  # mounted over the xfs


def test_escaped_characters_in_paths_are_decoded():
    """The kernel writes a space in a mount point as \\040: the mount is found by its real
    name, and the fields after it are still read in place."""
    assert _holder("/data/team a/run") == ("/data/team a", "nfs4")
    assert _holder("/data/team\\040a/run") == ("/", "xfs")


def test_this_process_s_own_mount_table_is_read():
    mounts = read_mounts(MOUNTINFO)
    assert mount_of(Path("/proc/self"), mounts).fstype == "proc"
    assert mount_of(Path("/"), mounts).point == Path("/")
