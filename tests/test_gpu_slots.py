"""A GPU for each run started at once on one machine (utils/slots.py): places are claimed GPU by GPU, held until the
process exits, freed when it does (also when it is killed), and ``train.device: auto`` trains on the claimed GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from fedsilo.client import data as client_data
from fedsilo.utils import slots
from fedsilo.utils.slots import GPU_SLOTS_ENV, claim_gpu, claim_slot


def test_places_spread_over_the_gpus_and_a_freed_place_is_taken_next(tmp_path):
    got = [claim_slot(tmp_path, 3) for _ in range(5)]
    assert [i for i, _ in got] == [0, 1, 2, 0, 1]  # every GPU's first place, then the second places
    got[1][1].close()  # the run on GPU 1 (first place) ends
    i, f = claim_slot(tmp_path, 3)
    assert i == 1 and (tmp_path / "cuda1.0.lock").exists()
    for _, h in [*got, (i, f)]:
        h.close()


def test_processes_at_once_get_different_gpus_and_a_killed_one_frees_its_place(tmp_path):
    hold = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from fedsilo.utils.slots import claim_slot
        i, f = claim_slot(Path({str(tmp_path)!r}), 2)
        print(i, flush=True)
        time.sleep(60)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        first = [int(p.stdout.readline()) for p in procs]
        assert sorted(first) == [0, 1]
        procs[0].kill()  # SIGKILL: the kernel drops its lock
        procs[0].wait()
        i, f = claim_slot(tmp_path, 2)
        assert i == first[0]
        f.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_auto_trains_on_the_claimed_gpu_and_keeps_it(tmp_path, monkeypatch):
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(slots, "_held", {})
    busy = [claim_slot(tmp_path, 4) for _ in range(2)]  # two runs already hold GPUs 0 and 1
    monkeypatch.setenv(GPU_SLOTS_ENV, str(tmp_path))
    assert client_data.pick_device("auto") == torch.device("cuda", 2) and chosen == [2]
    assert claim_gpu(4) == 2 and len(list(tmp_path.glob("*.lock"))) == 3  # asked again: the same place, no new one
    assert client_data.pick_device("cuda:3") == torch.device("cuda", 3)  # a device named in params is not shared out
    monkeypatch.delenv(GPU_SLOTS_ENV)
    monkeypatch.setattr(slots, "_held", {})
    assert client_data.pick_device("auto") == torch.device("cuda")  # outside a grid: the first GPU, as always
    for _, f in busy:
        f.close()


def test_one_gpu_or_none_claims_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(GPU_SLOTS_ENV, str(tmp_path / "slots"))
    monkeypatch.setattr(slots, "_held", {})
    assert claim_gpu(1) is None and claim_gpu(0) is None and not (tmp_path / "slots").exists()
    if not torch.cuda.is_available():
        assert client_data.pick_device("auto") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_on_a_multi_gpu_machine_auto_picks_a_free_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv(GPU_SLOTS_ENV, str(tmp_path))
    monkeypatch.setattr(slots, "_held", {})
    busy = claim_slot(tmp_path, torch.cuda.device_count())
    dev = client_data.pick_device("auto")
    assert dev.index == 1 and torch.cuda.current_device() == 1
    busy[1].close()


def test_places_are_named_by_the_gpus_cuda_visible_devices_lists(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    i, f = claim_slot(tmp_path, 2)
    j, g = claim_slot(tmp_path, 2)
    assert (i, j) == (0, 1) and sorted(p.name for p in tmp_path.glob("*.lock")) == ["cuda2.0.lock", "cuda3.0.lock"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")  # another grid shown GPUs 3 and 0: GPU 3 is taken, so 0 is its
    k, h = claim_slot(tmp_path, 2)
    assert k == 1 and (tmp_path / "cuda0.0.lock").exists()
    for x in (f, g, h):
        x.close()
