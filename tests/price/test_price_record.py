"""fxmem.price.price_record: kernel prices measured once are kept on disk, and a later timer (a new process:
this one's memory of them dropped) answers them without timing; a record that cannot be read is ignored
with one warning; `FXMEM_CACHE=0` keeps nothing."""
from __future__ import annotations

import pytest
import torch

from fxmem.price import kernel_timer, price_record
from fxmem.price.kernel_timer import KernelTimer
from tests.conftest import joint_of


def _mms():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    joint = joint_of(model, torch.randn(32, 64))[0]
    return [n for n in joint.graph.nodes if n.op == "call_function" and "mm" in str(n.target)]


def _as_a_new_process(monkeypatch):
    """Forget what this process measured and read; timing again fails the test."""
    monkeypatch.setattr(kernel_timer, "_MEASURED", {})
    monkeypatch.setattr(kernel_timer, "_TIMES_MEASURED", {})
    price_record.forget()

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")
    monkeypatch.setattr(KernelTimer, "_measure", no_timing)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    monkeypatch.setenv("FXMEM_CACHE", "1")
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_timer, "_MEASURED", {})
    monkeypatch.setattr(kernel_timer, "_TIMES_MEASURED", {})
    price_record.forget()
    yield tmp_path
    price_record.forget()


def test_a_later_timer_reads_the_prices_kept_instead_of_timing(kept, monkeypatch):
    nodes = _mms()
    first = {n.name: KernelTimer("cpu").seconds(n) for n in nodes}
    assert all(s and s > 0 for s in first.values())
    price_record.flush()
    assert list((kept / "prices").glob("*.json"))
    _as_a_new_process(monkeypatch)
    again = {n.name: KernelTimer("cpu").seconds(n) for n in nodes}
    assert again == first


def test_a_record_that_cannot_be_read_is_timed_again_with_one_warning(kept, monkeypatch):
    nodes = _mms()
    (kept / "prices").mkdir()
    (kept / "prices" / f"{price_record.device_name('cpu')}.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the kernel prices"):
        seconds = KernelTimer("cpu").seconds(nodes[0])
    assert seconds and seconds > 0
    price_record.flush()  # written anew, readable
    _as_a_new_process(monkeypatch)
    assert KernelTimer("cpu").seconds(nodes[0]) == seconds


def test_without_the_cache_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("FXMEM_CACHE", "0")
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))
    price_record.forget()
    KernelTimer("cpu").seconds(_mms()[0])
    price_record.flush()
    assert not (tmp_path / "prices").exists()
