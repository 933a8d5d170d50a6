"""The memory behind a pool: reserved at creation, never a SIGBUS, populated ahead of
use, huge pages where the filesystem offers them.

Most tests mount a small tmpfs of their own, which needs root (CI runs as root;
elsewhere they fail, saying how to run them).
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import maru
from maru.backends import shm
from maru.backends._pool import mapping, memory
from maru.backends._pool.attach import memory_of
from maru.cli import main
from maru.hugepages import HUGE_PAGE

MIB = 2**20
SYSFS_NEVER = "always within_size advise [never] deny force\n"


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount a small tmpfs (`size`, optional `huge=`) under tmp_path; unmounted after."""
    mounted: list[Path] = []

    def mount(size: str = "64M", huge: str | None = None) -> Path:
        target = tmp_path / f"tmpfs{len(mounted)}"
        target.mkdir()
        options = f"size={size}" + (f",huge={huge}" if huge else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            pytest.fail(
                f"these tests mount a small tmpfs, which needs root (CI runs as root; "
                f"run `sudo make test`): {done.stderr.strip()}"
            )
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=True)


@pytest.fixture
def shm_dir(tmpfs, monkeypatch) -> Path:
    """The shm backend's directory is a 64 MiB tmpfs, as in a default docker container."""
    directory = tmpfs("64M")
    monkeypatch.setattr(shm, "SHM_DIR", directory)
    return directory


def shm_config(name: str, capacity: str, **options: object) -> maru.MaruConfig:
    return maru.load_config(backend="shm", capacity=capacity, shm={"name": name, **options})


def free_bytes(directory: Path) -> int:
    vfs = os.statvfs(directory)
    return vfs.f_bavail * vfs.f_frsize


FILL = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import maru
    from maru.backends import shm
    shm.SHM_DIR = Path(sys.argv[1])
    config = maru.load_config(backend="shm", capacity=sys.argv[3], shm={"name": sys.argv[2]})
    try:
        store = maru.open_store(config)
    except maru.ConfigError as exc:
        print(exc)
        sys.exit(3)
    chunk = bytes(4 * 2**20)
    for i in range(3 * store.stats().capacity // len(chunk)):
        store.put(f"chunk-{i}", chunk)
    print("filled", store.stats().evictions)
    """
)


def fill_in_child(directory: Path, name: str, capacity: str) -> subprocess.CompletedProcess:
    """Open a pool in a child process and write three times its capacity into it."""
    return subprocess.run(
        [sys.executable, "-c", FILL, str(directory), name, capacity],
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- reserved at creation ----------------------------------------------------------


def test_a_pool_larger_than_its_tmpfs_is_refused_at_open_and_leaves_nothing(shm_dir) -> None:
    free = free_bytes(shm_dir)
    with pytest.raises(maru.ConfigError) as refused:
        maru.open_store(shm_config("big", "256MiB"))
    message = str(refused.value)
    assert f"capacity = {256 * MIB}:" in message
    assert f"({free} bytes)" in message, "names the space available"
    assert "--shm-size" in message and "capacity that fits" in message
    assert list(shm_dir.iterdir()) == [] and free_bytes(shm_dir) == free


def test_a_child_writing_into_a_pool_that_does_not_fit_is_refused_not_killed(shm_dir) -> None:
    done = fill_in_child(shm_dir, "big", "256MiB")
    assert done.returncode == 3, f"exit {done.returncode} (-7 is SIGBUS): {done.stderr}"
    assert "--shm-size" in done.stdout


def test_a_pool_that_fits_fills_and_wraps_without_sigbus_beside_one_that_does_not(
    shm_dir,
) -> None:
    """The second pool fits the tmpfs only while the first is sparse: it is refused, and
    the first, whose memory is its own, is written three times over."""
    done = fill_in_child(shm_dir, "first", "40MiB")
    assert (done.returncode, done.stdout.split()[0]) == (0, "filled"), done.stderr
    assert int(done.stdout.split()[1]) > 0, "the pool wrapped"
    assert fill_in_child(shm_dir, "second", "40MiB").returncode == 3
    assert fill_in_child(shm_dir, "first", "40MiB").returncode == 0


def test_the_cxl_emulated_device_is_reserved_too(tmpfs) -> None:
    directory = tmpfs("64M")
    device = directory / "dax"
    with pytest.raises(maru.ConfigError, match=f"capacity = {256 * MIB}:.*--shm-size"):
        maru.open_store(
            maru.load_config(
                backend="cxl", capacity="256MiB", cxl={"mode": "emulated", "device": device}
            )
        )
    assert list(directory.iterdir()) == []
    config = maru.load_config(
        backend="cxl", capacity="32MiB", cxl={"mode": "emulated", "device": device}
    )
    with maru.open_store(config) as store:
        assert os.stat(device).st_blocks * 512 == os.stat(device).st_size
        assert memory_of(store.pool).populator.state == "yes", "populated before first use"


# --- attaching an existing region ----------------------------------------------------


def sparse_pool(name: str, capacity: str, monkeypatch) -> Path:
    """A pool made as maru made them before reserving: its file has holes."""
    with monkeypatch.context() as patch:
        patch.setattr(memory, "reserve", lambda *args: None)
        patch.setattr(memory, "_populate_new", lambda *args: None)
        patch.setattr(memory, "_collapse_new", lambda *args: None)
        with maru.open_store(shm_config(name, capacity)):
            pass
    path = shm.shm_path(name)
    assert os.stat(path).st_blocks * 512 < os.stat(path).st_size
    return path


def test_attaching_a_sparse_pool_that_cannot_be_backed_is_refused(shm_dir, monkeypatch) -> None:
    sparse_pool("old", "40MiB", monkeypatch)
    filler = shm_dir / "filler"
    with open(filler, "wb") as out:
        out.write(bytes(free_bytes(shm_dir) - 8 * MIB))
    with pytest.raises(maru.ConfigError, match=f"capacity = {40 * MIB}:.*--shm-size"):
        maru.open_store(shm_config("old", "40MiB"))


def test_attaching_a_sparse_pool_completes_its_backing(shm_dir, monkeypatch) -> None:
    path = sparse_pool("old", "40MiB", monkeypatch)
    with maru.open_store(shm_config("old", "40MiB")) as store:
        assert os.stat(path).st_blocks * 512 == os.stat(path).st_size
        assert store.put(b"k", b"v") and store.get(b"k") == b"v"


def test_no_room_names_a_memory_limit_when_memory_runs_out(tmp_path) -> None:
    with open(tmp_path / "f", "wb") as out:
        error = memory.no_room(out.fileno(), 5 * MIB, 4 * MIB, "pool x", errno.ENOMEM)
    assert "capacity = 4194304:" in str(error) and "memory limit" in str(error)


# --- populating ----------------------------------------------------------------------


def test_a_new_pool_is_populated_before_open_returns(shm_dir) -> None:
    with maru.open_store(shm_config("new", "32MiB")) as store:
        populator = memory_of(store.pool).populator
        assert (populator.state, populator.done) == ("yes", len(store.pool.region))


def mapped_at(address: int) -> int:
    """Bytes of the mapping at `address` that this process has mapped (its Rss)."""
    counting, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            counting = line.startswith(f"{address:x}-")
        elif counting and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_attaching_an_existing_pool_maps_only_the_objects_it_uses(shm_dir) -> None:
    """Attaching walks none of the pool (it used to map all of it, in a thread that
    competed with serving); an object's pages are mapped when it is first used."""
    with maru.open_store(shm_config("p", "48MiB")) as writer:
        writer.put(b"object", bytes(range(256)) * (12 * 4096))  # 12 MiB
    with maru.open_store(shm_config("p", "48MiB")) as store:
        populator = memory_of(store.pool).populator
        before = mapped_at(populator.address)
        assert populator.state == "no" and before < 4 * MIB, "only the tables it read"
        view = store.view(b"object")
        assert view is not None and bytes(view.data[:256]) == bytes(range(256))
        mapped = mapped_at(populator.address) - before
        assert 12 * MIB <= mapped <= 16 * MIB, "the object's granules, at once"
        assert populator.mapped_bytes <= 16 * MIB
        assert store.populate()["populated"] == "yes", "maru pool populate maps the rest"
        assert mapped_at(populator.address) >= 48 * MIB


def test_a_forked_child_starts_unpopulated(pool_names) -> None:
    """fork copies no page tables of a shared mapping: the child's pages are not mapped."""
    with maru.open_store(shm_config(pool_names(), "16MiB", prefault=True)) as store:
        populator = memory_of(store.pool).populator
        pid = os.fork()
        if pid == 0:
            os._exit(0 if (populator.state, populator.done) == ("no", 0) else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert populator.state == "yes"


def test_pool_create_reports_huge_pages_and_populated(shm_dir, tmp_path, capsys) -> None:
    config = tmp_path / "maru.yaml"
    config.write_text("backend: shm\ncapacity: 16MiB\nshm:\n  name: cli\n")
    assert main(["pool", "create", "--config", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["populated"] == "yes" and report["populated_bytes"] > 16 * MIB
    assert report["huge_pages"] in ("yes", "no") and report["huge_page_policy"]
    assert main(["pool", "create", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "populated" in text and "huge_pages" in text


# --- huge pages ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sysfs", "fs_type", "options", "mode"),
    [
        (SYSFS_NEVER, "tmpfs", "rw,size=24683656k", "never"),
        (SYSFS_NEVER, "tmpfs", "rw,size=65536k,huge=advise", "advise"),
        (SYSFS_NEVER, "tmpfs", "rw,huge=within_size", "within_size"),
        ("always within_size advise never [deny] force", "tmpfs", "rw,huge=always", "never"),
        ("always within_size advise never deny [force]", "tmpfs", "rw", "always"),
        ("always within_size [advise] never deny force", "ext4", "rw,huge=always", "never"),
        ("", "", "", "never"),
    ],
)
def test_huge_page_policy_from_sysfs_and_the_mount(sysfs, fs_type, options, mode) -> None:
    policy = memory.huge_policy(sysfs, fs_type, options)
    assert policy.mode == mode and policy.reason


def test_the_mount_of_a_file_is_found_by_its_device(tmp_path) -> None:
    with open(tmp_path / "f", "wb") as out:
        device = os.fstat(out.fileno()).st_dev
        here = f"{os.major(device)}:{os.minor(device)}"
        mountinfo = (
            "22 1 0:21 / /proc rw - proc proc rw\n"
            f"30 1 {here} / /some\\040where rw,relatime - tmpfs tmpfs rw,size=4k,huge=advise\n"
        )
        assert memory.mount_of(out.fileno(), mountinfo) == ("tmpfs", "rw,size=4k,huge=advise")
        assert memory.mount_of(out.fileno(), "22 1 0:21 / /proc rw - proc proc rw\n") == ("", "")


def thp_on_shmem() -> bool:
    return Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").exists()


@pytest.mark.parametrize("huge", ["always", "advise"])
def test_a_pool_gets_huge_pages_where_the_tmpfs_offers_them(tmpfs, monkeypatch, huge) -> None:
    """On a kernel without transparent huge pages, the same pool falls back to 4 KiB."""
    monkeypatch.setattr(shm, "SHM_DIR", tmpfs("64M", huge=huge))
    with maru.open_store(shm_config("huge", "32MiB", prefault=True)) as store:
        report = memory_of(store.pool).report()
        assert store.put(b"k", b"v") and store.get(b"k") == b"v"
    if thp_on_shmem():
        assert report["huge_pages"] == "yes" and report["huge_page_bytes"] >= 16 * MIB
        assert f"huge={huge}" in report["huge_page_policy"]
    else:
        assert (report["huge_pages"], report["huge_page_bytes"]) == ("no", 0)


def collapse_on_shmem() -> bool:
    """MADV_COLLAPSE of tmpfs pages: Linux 6.1 with transparent huge pages."""
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    return thp_on_shmem() and release >= (6, 1)


def test_a_pool_on_a_tmpfs_that_gives_small_pages_is_made_of_huge_pages(tmpfs, monkeypatch) -> None:
    """A plain /dev/shm gives 4 KiB pages; the new pool's are made huge, and a process
    that attaches maps them 2 MiB at a time (before, every process mapped 4 KiB pages)."""
    monkeypatch.setattr(shm, "SHM_DIR", tmpfs("64M", huge="never"))
    with maru.open_store(shm_config("small", "32MiB")) as writer:
        created = memory_of(writer.pool).report()
        assert writer.put(b"object", bytes(range(256)) * (8 * 4096))  # 8 MiB
    with maru.open_store(shm_config("small", "32MiB")) as store:
        populator = memory_of(store.pool).populator
        assert populator.address % HUGE_PAGE == 0, "mapped at a huge-page boundary"
        view = store.view(b"object")
        assert view is not None and bytes(view.data[-256:]) == bytes(range(256))
        attached = memory_of(store.pool).report()
        del view
    assert created["populated"] == "yes" and "huge=never" in created["huge_page_policy"]
    if collapse_on_shmem():
        assert created["huge_pages"] == "yes" and created["huge_page_bytes"] >= 32 * MIB
        assert "made huge at the pool's creation" in created["huge_page_policy"]
        assert attached["huge_pages"] == "yes" and attached["huge_page_bytes"] >= 8 * MIB
    else:
        assert (created["huge_pages"], attached["huge_pages"]) == ("no", "no")


def test_a_pool_whose_pages_cannot_be_made_huge_gets_small_ones(tmpfs, monkeypatch) -> None:
    """A kernel that refuses MADV_COLLAPSE (older than 6.1, or no free huge page): the
    pool is reserved and populated in small pages, and works."""
    monkeypatch.setattr(shm, "SHM_DIR", tmpfs("64M", huge="never"))
    monkeypatch.setattr(memory, "MADV_COLLAPSE", -1)  # advice no kernel knows: EINVAL
    with maru.open_store(shm_config("small", "32MiB")) as store:
        report = memory_of(store.pool).report()
        assert store.put(b"k", b"v") and store.get(b"k") == b"v"
    assert (report["huge_pages"], report["huge_page_bytes"]) == ("no", 0)
    assert report["populated"] == "yes"
    path = shm.shm_path("small")
    assert os.stat(path).st_blocks * 512 == os.stat(path).st_size, "reserved in full"


def test_a_pool_maps_where_the_kernel_puts_it_when_no_space_can_be_reserved(
    shm_dir, monkeypatch
) -> None:
    """Strict overcommit refuses the aligned mapping's reservation: the pool maps its
    file unaligned, as before, and works."""

    def refuse(length: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mapping, "address_space", refuse)
    with maru.open_store(shm_config("unaligned", "16MiB")) as store:
        assert store.put(b"k", b"v" * 4096) and store.get(b"k") == b"v" * 4096
        assert memory_of(store.pool).report()["populated"] == "yes"


def test_a_view_outlives_its_closed_store(shm_dir) -> None:
    """The mapping stays until the last view of it is released."""
    store = maru.open_store(shm_config("views", "16MiB"))
    assert store.put(b"k", bytes(range(256)) * 64)
    view = store.view(b"k")
    store.close()
    assert view is not None and bytes(view.data) == bytes(range(256)) * 64
