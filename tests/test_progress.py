"""Long work shows progress (issue 17.4): a live bar on a terminal, short plain lines in logs, nothing with -q."""

from __future__ import annotations

import io
import re
import shutil

import yaml

from fedsilo import cli
from fedsilo.utils.progress import Progress
from tests.conftest import small_params


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_live_bar_a_log_gets_lines_and_quiet_gets_nothing():
    term = _Terminal()
    with Progress(3, "train q/fedavg/seed0", "round", stream=term) as p:
        for r in range(3):
            p.update(1, f"loss 0.{r}, acc 0.5")
    assert "\r" in term.getvalue() and "3/3" in term.getvalue() and "loss 0.2, acc 0.5" in term.getvalue()

    log = io.StringIO()
    with Progress(100, "harmonize pacs photo", "image", stream=log, every_s=3600) as p:
        for i in range(100):
            p.update(1, line=(i == 49))  # a step that asks for a line; the rest wait for the interval or the end
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2
    assert lines[0].startswith("harmonize pacs photo: 50/100 images,") and "images/s" in lines[0]
    assert lines[1].startswith("harmonize pacs photo: 100/100 images,")

    quiet = _Terminal()
    with Progress(5, "x", "round", quiet=True, stream=quiet) as p:
        p.update(5, "info", line=True)
    assert quiet.getvalue() == ""


def test_train_and_harmonize_report_progress_on_stderr_and_q_silences_them(mirror_root, tmp_path, capsys):
    root = tmp_path / "p"
    shutil.copytree(mirror_root / "data" / "raw", root / "data" / "raw")
    raw = small_params(rounds=2, count_flops=False)
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    base = ["--root", str(root), "--params", str(root / "params.yaml")]
    assert cli.main([*base, "harmonize", "--dataset", "chest_xray4"]) == 0
    err = capsys.readouterr().err
    for dom in ("CheXpert", "OpenI", "RSNA", "VinBigData"):
        assert re.search(rf"harmonize chest_xray4 {dom}: (\d+)/\1 images, ([\d.]+ images/s|[\d.]+ s/image)", err), err
    assert cli.main([*base, "-q", "harmonize", "--dataset", "chest_xray4"]) == 0
    assert capsys.readouterr().err == ""

    assert cli.main([*base, "split", "--experiment", "quick"]) == 0
    assert cli.main([*base, "train", "--experiment", "quick", "--method", "fedavg", "--seed", "0"]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train quick/fedavg/seed0")]
    assert len(lines) == 2, lines  # eval_every 1: a line per round
    assert re.match(r"train quick/fedavg/seed0: 2/2 rounds, .*; loss [\d.]+, acc [\d.]+, [\d.]+ s, up [\d.]+ MiB down [\d.]+ MiB$", lines[1]), lines[1]


def test_a_slow_unit_is_shown_as_seconds_per_unit(monkeypatch):
    """A round of a minute reads "60.0 s/round", as tqdm shows slow units, not "0.0 rounds/s"."""
    import io

    from fedsilo.utils import progress as progress_mod

    now = [100.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: now[0])
    p = progress_mod.Progress(3, "train x", "round", stream=io.StringIO())
    now[0] += 120.0
    p.update(2)
    assert "2/3 rounds, 60.0 s/round, 120 s" in p.line()
    now[0] += 0.5
    p.update(1)
    assert "rounds/s" not in p.line() and "40.2 s/round" in p.line()
    q = progress_mod.Progress(100, "harmonize", "image", stream=io.StringIO())
    now[0] += 2.0
    q.update(50)
    assert "50/100 images, 25.0 images/s" in q.line()


def test_a_log_gets_a_line_once_every_every_s_seconds_not_every_step(monkeypatch):
    """Not on a terminal, a step that asks for no line is written once ``every_s`` has passed since the last line, and
    the next one only after as long again."""
    import io

    from fedsilo.utils import progress as progress_mod

    now = [100.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: now[0])
    log = io.StringIO()
    p = progress_mod.Progress(100, "scan t", "row", stream=log, every_s=30.0)
    for _ in range(10):  # 10 s a row
        now[0] += 10.0
        p.update(1)
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == ["scan t: 3/100 rows", "scan t: 6/100 rows", "scan t: 9/100 rows"]


def test_a_resumed_count_shows_the_rate_of_the_units_done_since_it_started(monkeypatch):
    """A run resumed after round 40 of 50 (``initial``): its rate counts the rounds this process trained, not the 40
    the killed one did."""
    import io

    from fedsilo.utils import progress as progress_mod

    now = [100.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: now[0])
    p = progress_mod.Progress(50, "train x", "round", initial=40, stream=io.StringIO())
    now[0] += 20.0
    p.update(2)
    assert "42/50 rounds, 10.0 s/round, 20 s" in p.line()


class _GoneReader(io.StringIO):
    """A pipe whose reader went away after ``after`` writes: every later write raises BrokenPipeError."""

    def __init__(self, after: int, tty: bool):
        super().__init__()
        self.after, self.tty, self.writes = after, tty, 0

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        self.writes += 1
        if self.writes > self.after:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(s)


def test_a_stream_whose_reader_went_away_silences_the_progress_and_the_work_goes_on():
    """A `| tee` killed with its job: the progress stops printing instead of raising into the run (which a SIGTERM
    must end as stopped, not failed: tests/test_run_integrity.py), for a log's lines and a terminal's bar alike."""
    for tty in (False, True):
        gone = _GoneReader(after=1, tty=tty)
        with Progress(4, "train q/fedavg/seed0", "round", stream=gone) as p:
            for r in range(4):
                p.update(1, f"loss 0.{r}", line=True)
        assert p.n == 4 and p.quiet and gone.getvalue()  # the first write printed; the rest were not tried
        tried = gone.writes
        p.update(1, "more", line=True)
        assert gone.writes == tried


def test_a_domains_decoding_clock_starts_before_its_first_image_is_decoded(monkeypatch):
    """harmonize's images/s per domain: the first domain's bar began at its first decoded image, so a pool that had
    decoded a small set before handing back the first result showed 25,000 images/s for 39 DICOMs. Each domain's bar
    now exists before its first image is decoded (the first one's before the decoding starts)."""
    import fedsilo.data.harmonize as harmonize

    events: list[str] = []

    class Spy(harmonize.Progress):
        def __init__(self, total, desc, *a, **k):
            events.append(f"bar {desc}")
            super().__init__(total, desc, *a, **k)

    monkeypatch.setattr(harmonize, "Progress", Spy)
    monkeypatch.setattr(harmonize, "_decode_safe", lambda job: events.append(f"decode {job[0]}") or (None, ""))
    out = list(harmonize.iter_decoded([("a1",), ("a2",), ("b1",)], workers=1, domains=["A", "A", "B"], quiet=True))
    assert len(out) == 3
    assert events == ["bar harmonize A", "decode a1", "decode a2", "bar harmonize B", "decode b1"]


def test_with_worker_processes_a_domains_jobs_go_to_them_once_the_previous_domain_is_done(monkeypatch):
    """A pool given every job at once decodes ahead into the next domain, whose images/s then counted the pool's lead:
    each domain's jobs are handed to the workers after the previous domain's, its clock started just before."""
    import fedsilo.data.harmonize as harmonize

    events: list[str] = []

    class Spy(harmonize.Progress):
        def __init__(self, total, desc, *a, **k):
            events.append(f"bar {desc} {total}")
            super().__init__(total, desc, *a, **k)

    class Pool:
        def map(self, fn, jobs, chunksize=1):
            events.append(f"map {len(jobs)}")
            return map(fn, jobs)

        def shutdown(self, wait=True, cancel_futures=False):
            events.append("shutdown")

    monkeypatch.setattr(harmonize, "Progress", Spy)
    monkeypatch.setattr(harmonize, "worker_pool", lambda workers: Pool())
    monkeypatch.setattr(harmonize, "_decode_safe", lambda job: (None, ""))
    jobs, domains = [(f"a{k}",) for k in range(10)] + [(f"b{k}",) for k in range(8)], ["A"] * 10 + ["B"] * 8
    assert len(list(harmonize.iter_decoded(jobs, workers=2, domains=domains, quiet=True))) == 18
    assert events == ["bar harmonize A 10", "map 10", "bar harmonize B 8", "map 8", "shutdown"]


def test_each_domains_bar_counts_every_image_decoded_of_it(monkeypatch):
    """iter_decoded's per-domain bars: each counts its domain's images as they are handed on, the last one too, and
    ends at the domain's total (the images/s a harmonize prints is that count over the bar's time)."""
    import fedsilo.data.harmonize as harmonize

    bars: list = []

    class Spy(harmonize.Progress):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            bars.append(self)

    monkeypatch.setattr(harmonize, "Progress", Spy)
    monkeypatch.setattr(harmonize, "_decode_safe", lambda job: (None, ""))
    assert len(list(harmonize.iter_decoded([("a1",), ("a2",), ("b1",)], workers=1, domains=["A", "A", "B"], quiet=True))) == 3
    assert [(b.desc, b.total, b.n) for b in bars] == [("harmonize A", 2, 2), ("harmonize B", 1, 1)]
