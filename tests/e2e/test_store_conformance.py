"""RdzvStore against the behaviours torch checks for its own stores.

The checks follow ``StoreTestBase`` of torch's ``test/distributed/test_store.py`` (set/get/
check, compare_set, simple wait, append, multi_set, multi_get, clone) plus what
``TCPStoreTest`` checks of timeouts and deletes, run on ``RdzvStore`` directly and through
``PrefixStore`` (torch runs its base tests on PrefixFileStore / PrefixTCPStore the same
way: PrefixStore is C++, so every call goes through the Python trampoline). Then torch's
own C++-side check ``dist._test_python_store`` and a real gloo process group of two
processes whose only rendezvous is ``init_process_group(store=RdzvStore(...))``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from server_process import ServerProcess
from waiting import PATIENCE, wait_for_parked
from torch_feature import NO_ENTRY_POINTS, NO_STORE_CLONE, READS_ENTRY_POINTS

from rdzv_client.torchrun import RdzvStore

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PREFIX = "test_prefix"


def new_job() -> str:
    return f"conf-job-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module (conftest's is one per test): every test works
    in a job of its own and none stops the server or reads its log or metrics."""
    srv = ServerProcess(tmp_path_factory.mktemp("conformance-server"), durable=False)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def base(server: Any) -> Iterator[RdzvStore]:
    """A fresh job's store, as in the brief: ``RdzvStore(endpoint, job, create=True)``."""
    store = RdzvStore(server.endpoint, new_job(), create=True)
    store.set_timeout(timedelta(seconds=30))
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=["rdzv", "prefix"])
def fs(request: pytest.FixtureRequest, base: RdzvStore) -> dist.Store:
    """The store under test: RdzvStore itself, or torch's PrefixStore over it."""
    if request.param == "prefix":
        return dist.PrefixStore(PREFIX, base)
    return base


# -- StoreTestBase ------------------------------------------------------------------------


def test_set_get_check(fs: dist.Store) -> None:
    fs.add("key", 1)
    fs.add("key", 2)
    fs.add("key", 3)
    fs.set("key0", "value0")
    fs.add("key3", 1)
    fs.set("key1", "value1")
    fs.add("key3", 2)
    fs.set("key2", "value2")
    fs.add("key3", 3)
    fs.add("key3", 4)
    fs.add("key3", 5)
    fs.add("key3", 6)
    assert fs.num_keys() == 5  # a fresh job holds only these (no internal keys)
    assert fs.get("key") == b"6"
    assert fs.get("key0") == b"value0"
    assert fs.get("key1") == b"value1"
    assert fs.get("key2") == b"value2"
    assert fs.get("key3") == b"21"
    assert fs.check(["key3"]) is True
    assert fs.check(["Randomkey3"]) is False
    assert fs.check(["key0", "key3"]) is True
    assert fs.check(["key0", "Randomkey3"]) is False

    fs.set("-key3", "7")
    assert fs.get("-key3") == b"7"
    assert fs.delete_key("-key3") is True
    assert fs.num_keys() == 5


def test_add_returns_the_new_value(fs: dist.Store) -> None:
    assert fs.add("counter", 5) == 5
    assert fs.add("counter", -2) == 3
    assert fs.add("counter", 0) == 3
    assert fs.get("counter") == b"3"


def test_compare_set(fs: dist.Store) -> None:
    # missing key, non-empty expected: nothing is set, the expected value comes back
    assert fs.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    assert fs.check(["cs_key0"]) is False
    fs.set("cs_key0", "value0")
    assert fs.get("cs_key0") == b"value0"
    # wrong expected: unchanged, the current value comes back
    assert fs.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert fs.get("cs_key0") == b"value0"
    # right expected: swapped
    assert fs.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert fs.get("cs_key0") == b"new_value0"
    # missing key, empty expected: set
    assert fs.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert fs.get("cs_key1") == b"new_value1"


def test_simple_wait(fs: dist.Store) -> None:
    with pytest.raises(RuntimeError, match="[t -i]imeout"):
        fs.wait(["bad_key"], timedelta(seconds=0.25))
    fs.add("good_key", 1)
    fs.wait(["good_key"])  # the store's own timeout
    fs.wait(["good_key"], timedelta(seconds=1))


def test_append(fs: dist.Store) -> None:
    fs.set("foo", "po")
    fs.append("foo", "tato")
    fs.append("bar", "po")
    fs.append("bar", "tato")
    assert fs.get("foo") == b"potato"
    assert fs.get("bar") == b"potato"


def test_multi_set(fs: dist.Store) -> None:
    fs.multi_set(["foo", "bar"], ["po", "tato"])
    assert fs.get("foo") == b"po"
    assert fs.get("bar") == b"tato"


def test_multi_get(fs: dist.Store) -> None:
    fs.set("foo", "po")
    fs.set("bar", "tato")
    v0, v1 = fs.multi_get(["foo", "bar"])
    assert (v0, v1) == (b"po", b"tato")


def test_clone(fs: dist.Store) -> None:
    """StoreTestBase.test_clone: a clone is a Store that sees the same keys."""
    if not hasattr(fs, "clone"):  # torch's PrefixStore before Store.clone existed
        pytest.skip(NO_STORE_CLONE)
    b = fs.clone()
    assert isinstance(b, dist.Store)
    fs.set("foo", "bar")
    assert b.get("foo") == b"bar"


# -- timeouts, deletes, types (TCPStoreTest and the Store API) -------------------------


def test_numkeys_delkeys(fs: dist.Store) -> None:
    assert fs.num_keys() == 0
    fs.add("key", 1)
    fs.add("key", 2)
    fs.add("key", 3)
    fs.set("key0", "value0")
    fs.add("key3", 1)
    fs.set("key1", "value1")
    assert fs.num_keys() == 4
    assert fs.delete_key("key") is True
    assert fs.delete_key("key") is False
    assert fs.num_keys() == 3
    fs.set_timeout(timedelta(seconds=2))
    with pytest.raises(RuntimeError):
        fs.get("key")
    fs.delete_key("key0")
    fs.delete_key("key3")
    assert fs.num_keys() == 1
    fs.set("key4", "value2")
    assert fs.num_keys() == 2
    assert fs.get("key1") == b"value1"
    assert fs.get("key4") == b"value2"


def test_timeout_property(fs: dist.Store) -> None:
    fs.set_timeout(timedelta(seconds=7))
    assert fs.timeout == timedelta(seconds=7)
    fs.set_timeout(timedelta(milliseconds=1500))
    assert fs.timeout == timedelta(milliseconds=1500)


def test_get_timeout_raises_dist_store_error(fs: dist.Store) -> None:
    fs.set_timeout(timedelta(seconds=0.3))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        fs.get("never-set")
    waited = time.monotonic() - t0
    # The store's own timeout is the feature here: not before it, and wide on the late side.
    assert 0.25 <= waited < 10, waited
    with pytest.raises(dist.DistStoreError):
        fs.wait(["never-set"])  # wait without a timeout uses the store's
    with pytest.raises(dist.DistStoreError):
        fs.multi_get(["never-set", "also-never"])
    fs.set("then-set", "x")
    assert fs.get("then-set") == b"x"


def test_blocking_get_sees_another_clients_set(server: Any, fs: dist.Store, base: RdzvStore) -> None:
    """Like TCPStore clients: a get that waits is answered by a set from another client."""
    other = RdzvStore(server.endpoint, base.rdzv_id)
    writer_key = f"{PREFIX}/late" if isinstance(fs, dist.PrefixStore) else "late"
    got: list[bytes] = []
    try:
        getter = threading.Thread(target=lambda: got.append(fs.get("late")), daemon=True)
        getter.start()
        wait_for_parked(server, 1)  # the get waits: nothing to get yet
        other.set(writer_key, b"arrived")
        getter.join(PATIENCE)
        assert got == [b"arrived"]
        fs.wait(["late"], timedelta(seconds=1))
    finally:
        other.close()


def test_str_and_bytes(fs: dist.Store, base: RdzvStore) -> None:
    fs.set("s", "text")
    fs.set("b", b"\x00\xff\x80binary")
    fs.set("u", "h\u00e9llo \u2603")
    assert fs.get("s") == b"text"
    assert fs.get("b") == b"\x00\xff\x80binary"
    assert fs.get("u") == "h\u00e9llo \u2603".encode()
    assert all(isinstance(v, bytes) for v in fs.multi_get(["s", "b", "u"]))
    assert fs.compare_set("b", b"\x00\xff\x80binary", b"\x01") == b"\x01"
    fs.set("empty", b"")
    assert fs.get("empty") == b""
    assert fs.check(["empty"]) is True
    # RdzvStore itself also takes bytes keys (the Python API; PrefixStore only passes str)
    base.set(b"raw-\xc3\xa9", b"v")
    assert base.get("raw-\u00e9") == b"v"


def test_prefix_store_writes_under_the_prefix(base: RdzvStore) -> None:
    prefixed = dist.PrefixStore(PREFIX, base)
    prefixed.set("key0", "value0")
    prefixed.add("n", 2)
    assert base.get(f"{PREFIX}/key0") == b"value0"
    assert base.get(f"{PREFIX}/n") == b"2"
    assert base.check(["key0"]) is False
    assert prefixed.underlying_store is base
    nested = dist.PrefixStore("inner", prefixed)
    nested.set("k", "v")
    assert base.get(f"{PREFIX}/inner/k") == b"v"


def test_jobs_do_not_share_keys(server: Any, base: RdzvStore) -> None:
    other = RdzvStore(server.endpoint, new_job(), create=True, timeout=timedelta(seconds=0.3))
    try:
        base.set("shared-name", "mine")
        assert other.check(["shared-name"]) is False
        assert other.num_keys() == 0
        with pytest.raises(dist.DistStoreError):
            other.get("shared-name")
    finally:
        other.close()


# -- torch's C++ trampoline check and a real process group -------------------------------


def test_torch_test_python_store(base: RdzvStore) -> None:
    """torch's own C++-side check of Python stores (calls set/get/add and clone through C++)."""
    # torch is pinned (constraints-test.txt) to a version that has this check.
    assert hasattr(dist, "_test_python_store"), "the pinned torch should provide dist._test_python_store"
    dist._test_python_store(base)
    assert base.get("key") == b"6"


def test_importing_the_store_first_keeps_the_backend_registered() -> None:
    """A user script that imports rdzv_client.torchrun (for RdzvStore) before anything of
    torch.distributed.elastic must still have the ``rdzv-server`` torchrun backend, and no
    warning traceback from torch's plugin loader."""
    if not READS_ENTRY_POINTS:
        pytest.skip(NO_ENTRY_POINTS)
    code = (
        "import rdzv_client.torchrun\n"
        "from torch.distributed.elastic.rendezvous.registry import handler_registry\n"
        "print('registered' if handler_registry._registry.get('rdzv-server') else 'missing')\n"
    )
    # (a bound for a loaded machine: importing torch alone has taken over 60 s on 2 busy cores)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "registered", out.stderr[-3000:]
    assert "Exception while registering" not in out.stderr, out.stderr[-3000:]


def test_init_process_group_over_rdzv_store(server: Any, tmp_path: Path) -> None:
    job = new_job()
    worker = Path(__file__).with_name("store_pg_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        for rank in range(2):
            log = stack.enter_context(open(tmp_path / f"rank{rank}.log", "wb"))
            procs.append(subprocess.Popen(
                [sys.executable, str(worker), server.endpoint, job, str(rank), "2", str(tmp_path / f"rank{rank}.json")],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            ))
        try:
            codes = [p.wait(timeout=90) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    output = "\n".join(f"--- rank {r} ---\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}" for r in range(2))
    assert codes == [0, 0], output
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in records] == [0, 1], records
    for r in records:
        assert r["world_size"] == 2
        assert r["all_reduce"] == 3.0  # 1 + 2
        assert r["broadcast"] == 17.0  # rank 1's 1*10+7
        assert r["keys"] > 0  # gloo's rendezvous went through the server
