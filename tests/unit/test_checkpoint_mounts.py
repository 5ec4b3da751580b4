"""Which storage a checkpoint root lives on (``sailor.checkpoint.mounts``): the mount table's
parse, and roots judged by mount, server or bucket, never by touching them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sailor.checkpoint.mounts import (
    Mount,
    parse_mountinfo,
    read_mounts,
    same_storage,
    storage_of,
)

# Lines as Linux writes them (proc(5)): optional fields before the "-", octal escapes.
MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 27 0:50 / /nfs rw,relatime shared:20 master:3 - nfs4 filer.example:/export/ckpt rw,vers=4.2
41 27 0:51 / /mnt/other\\040disk rw - nfs [fd00::7]:/export/b rw
42 27 0:52 / /mnt/share rw - cifs //NAS/train rw
43 27 8:17 /ckpt /data/ckpt rw - ext4 /dev/sdb1 rw
44 27 8:17 / /data rw - ext4 /dev/sdb1 rw
45 27 0:60 / /scratch rw - tmpfs tmpfs rw
46 27 0:61 / /scratch rw - tmpfs tmpfs rw
this line is not a mount
"""


def _table() -> tuple[Mount, ...]:
    return parse_mountinfo(MOUNTINFO)


def test_parse_reads_point_device_type_and_source_skipping_odd_lines() -> None:
    got = _table()
    assert len(got) == 9
    assert got[1] == Mount("/", "8:1", "ext4", "/dev/sda1")
    assert got[2] == Mount("/nfs", "0:50", "nfs4", "filer.example:/export/ckpt")
    assert got[3].mount_point == "/mnt/other disk"  # \040 is a space


@pytest.mark.parametrize(
    ("root", "key"),
    [
        ("/home/u/ckpt", "dev:8:1"),
        ("/nfs/a", "server:filer.example"),
        ("file:///nfs/b/", "server:filer.example"),
        ("/nfsx/a", "dev:8:1"),  # a prefix of the text, not of the path
        ("/mnt/other disk/run", "server:[fd00::7]"),
        ("/mnt/share/x", "server:nas"),
        ("/data/ckpt/run", "dev:8:17"),  # a bind mount of /data's file system: one storage
        ("/scratch/a", "dev:0:61"),  # mounted over: the last one hides the first
        ("//nfs/a", "server:filer.example"),  # a leading '//' is '/' (normpath keeps it)
        ("file:////nfs/a", "server:filer.example"),
        ("///nfs/a", "server:filer.example"),
        ("s3://bucket/a/b", "url:s3://bucket"),
        ("S3://bucket/", "url:s3://bucket"),
        ("gs://other/a", "url:gs://other"),
    ],
)
def test_storage_of(root: str, key: str) -> None:
    assert storage_of(root, _table()) == key


def test_roots_on_one_storage() -> None:
    t = _table()
    assert same_storage("/nfs/a", "/nfs/b", t)
    assert same_storage("/nfs/a", "/mnt/share/../../nfs/x", t)
    assert same_storage("/data/x", "/data/ckpt/y", t)
    assert same_storage("s3://bucket/a", "s3://bucket/b", t)
    assert not same_storage("s3://bucket/a", "s3://other/a", t)
    assert not same_storage("s3://bucket/a", "gs://bucket/a", t)
    assert not same_storage("/nfs/a", "/home/a", t)
    assert not same_storage("/nfs/a", "/mnt/share/a", t)  # another server
    assert same_storage("ckpt", "/nfs/ckpt", t, cwd="/nfs")  # relative: from cwd


def test_a_mount_over_a_parent_hides_the_mounts_below_it() -> None:
    """``/mnt/x/y`` (NFS) mounted, then ``/mnt/x`` (tmpfs) over its parent: a path under
    ``/mnt/x/y`` is on the tmpfs now. Before, the longest point won: the hidden NFS mount."""
    t = (
        Mount("/", "8:1", "ext4", "/dev/sda1"),
        Mount("/mnt/x/y", "0:50", "nfs4", "filer:/export"),
        Mount("/mnt/x", "0:60", "tmpfs", "tmpfs"),
        Mount("/mnt/z/w", "0:51", "nfs4", "other:/export"),  # under no later mount: seen
    )
    assert storage_of("/mnt/x/y/c", t) == "dev:0:60"
    assert storage_of("/mnt/z/w/c", t) == "server:other"
    assert not same_storage(
        "/mnt/x/y/c", "/nfs/filer-root", (*t, Mount("/nfs", "0:52", "nfs4", "filer:/"))
    )


def test_a_root_on_an_automounter_trigger_is_judged_by_its_path() -> None:
    """``/net`` is an autofs trigger: its servers' mounts are not in the table until first
    used. Two roots there are two storages unless their paths are one (before: one device,
    the trigger's, for every server under it)."""
    t = (Mount("/", "8:1", "ext4", "/dev/sda1"), Mount("/net", "0:40", "autofs", "-hosts"))
    assert storage_of("/net/hostA/ckpt", t) == "path:/net/hostA/ckpt"
    assert not same_storage("/net/hostA/ckpt", "/net/hostB/ckpt", t)
    assert same_storage("/net/hostA/ckpt", "/net/hostA/x/../ckpt", t)
    mounted = (*t, Mount("/net/hostA", "0:50", "nfs4", "hostA:/"))
    assert storage_of("/net/hostA/ckpt", mounted) == "server:hosta"  # once mounted


def test_without_a_mount_table_roots_are_compared_as_paths() -> None:
    assert same_storage("/nfs/a", "file:///nfs/a/", ())
    assert same_storage("/nfs/a", "/nfs/b/../a", ())
    assert not same_storage("/nfs/a", "/nfs/b", ())


def test_read_mounts_reads_this_process_table_or_none(tmp_path: Path) -> None:
    (tmp_path / "mountinfo").write_text(MOUNTINFO)
    assert read_mounts(str(tmp_path / "mountinfo")) == _table()
    assert read_mounts(str(tmp_path / "absent")) == ()
    if Path("/proc/self/mountinfo").exists():
        assert any(m.mount_point == "/" for m in read_mounts())
