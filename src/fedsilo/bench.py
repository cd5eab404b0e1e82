"""``fedsilo bench``: the engine against the single-model limit, measured in one process.

For one backbone / image size / client count / samples per client / local epochs / batch size it measures:

(a) the *limit*: a plain training loop over one model and one optimizer, visiting every client's samples in turn with
    the same batches, the same on-device preprocessing and the same evaluation work (each client's test set once per
    round), with no state swapping, payloads, aggregation or checkpoints;
(b) fedsilo's FedAvg round throughput through the real engine (payload copies, byte accounting, client-store
    swapping, aggregation, evaluation and a checkpoint on disk after every round, ``checkpoint_every: 1``);
(c) the same for every other method asked for (``--methods``), and what one checkpoint write of each costs (seconds,
    MiB, share of a round: what ``train.checkpoint_every`` saves);

and prints samples/s for each, the ratios b/a and c/a, peak device and host memory, then a memory-flatness run (many
Simple-CNN clients over many rounds: host RSS and device memory per round) and the harmonize throughput (DICOM decode
+ normalize + resize on all cores, on mirror DICOMs of a realistic size). Nothing here is a test: it reports
numbers; docs/performance.md records them.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from pydantic import ValidationError
from torch import nn

from fedsilo.client.data import ClientData, to_float
from fedsilo.client.local import evaluate, make_generator, training_batches, use_bf16, use_channels_last
from fedsilo.config import ConfigError, TrainParams
from fedsilo.fl.engine import Engine
from fedsilo.methods import method_class
from fedsilo.models import build_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic_clients(n_clients: int, samples: int, test: int, channels: int, size: int, classes: int, device: torch.device, seed: int = 0) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_clients):
        def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randint(0, 256, (n, channels, size, size), generator=g, dtype=torch.uint8)
            y = torch.randint(0, classes, (n,), generator=g)
            return x.to(device), y.to(device)

        xtr, ytr = make(samples)
        xte, yte = make(test)
        out.append(ClientData(i, f"client{i}", xtr, ytr, xte, yte))
    return out


def single_model_loop(model: nn.Module, clients: list[ClientData], cfg: TrainParams, rounds: int, seed: int) -> list[float]:
    """The limit: one model, one optimizer, the same batches and evaluation; returns seconds per round."""
    device = clients[0].x_train.device
    bf16, cl = use_bf16(cfg, device), use_channels_last(cfg, device)
    if cl:
        model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for rnd in range(1, rounds + 1):
        _sync(device)
        t0 = time.perf_counter()
        for c in clients:
            model.train()
            gen = make_generator(seed, rnd, c.index)
            for _ in range(cfg.local_epochs):
                for x, y in training_batches(c, cfg, gen):  # train_local's batches, without its engine around it
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                        loss = loss_fn(model(x), y)
                    loss.backward()
                    opt.step()
        for c in clients:
            evaluate(model, c.x_test, c.y_test, cfg=cfg)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


# Methods with a phase schedule are timed in their federated phase, the part that repeats every round.
BENCH_METHOD_PARAMS: dict[str, dict[str, Any]] = {"pfeddb": {"two_phase": False}}


def engine_rounds(method: str, model: nn.Module, clients: list[ClientData], cfg: TrainParams, rounds: int, seed: int, checkpoint: Optional[Path],
                  keep: Optional[dict[str, Any]] = None, costs: Optional[dict[str, Any]] = None) -> list[float]:
    """Seconds of each of ``rounds`` engine rounds; ``keep`` receives the final server state when given; ``costs``
    receives each round's parts (``parts``: the whole step, its local training with transfers and aggregation, and
    the round with its evaluation, as the engine's history times them) and, when a checkpoint is kept, what one
    checkpoint of the final state costs (median seconds of three writes, MiB on disk)."""
    cls = method_class(method)
    times: list[float] = []
    device = clients[0].x_train.device
    params = cls.params_cls(**BENCH_METHOD_PARAMS.get(method, {}))
    engine = Engine(cls(params, cfg), model, clients, cfg, seed, checkpoint=checkpoint, config_hash=f"bench-{method}")
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if keep is not None:
        keep["server"] = engine.server
    if costs is not None:
        costs["parts"] = [(t, h["train_seconds"], h["seconds"]) for t, h in zip(times, engine.history[-rounds:])]
    if costs is not None and checkpoint is not None:
        writes = []
        for _ in range(3):
            t0 = time.perf_counter()
            engine.save()
            writes.append(time.perf_counter() - t0)
        costs.update(seconds=float(np.median(writes)), mib=checkpoint.stat().st_size / 2**20)
    return times


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_dev(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def parallel_gain(widths: dict[int, TrainParams], measure: Any, result: dict[str, Any], sequential: dict[str, Any],
                  build: Callable[[], nn.Module], data: list[ClientData], cfg: TrainParams, rounds: int, seed: int,
                  tmp: Optional[Path]) -> dict[int, dict[str, Any]]:
    """FedAvg with ``train.parallel_clients: K`` for each K (``widths``: K -> its validated training settings), against
    FedAvg one client at a time (the ``fedavg`` arm, measured before in the same process with the same data): the
    throughput ratio, and whether the final global model is bit-equal to a one-at-a-time run with as many threads per
    client (on the CPU that run is timed too, as ``fedavg[threads=T]``: it tells the gain of training clients at once
    from that of giving each fewer threads; on a GPU the ``fedavg`` arm is that run, and "identical" needs
    deterministic kernels: cuDNN's autotuned convolutions may differ between any two runs)."""
    dev = data[0].x_train.device
    threads = torch.get_num_threads()
    base = result["throughput"]["fedavg"]["samples_per_s"]
    out: dict[int, dict[str, Any]] = {}
    for k, pcfg in widths.items():
        par: dict[str, Any] = {}
        label = f"fedavg[parallel={k}]"
        measure(label, lambda k=k, pcfg=pcfg, par=par: engine_rounds("fedavg", build(), data, pcfg, rounds, seed,
                                                                     tmp / f"fedavg_p{k}.pt" if tmp else None, keep=par))
        per = max(1, threads // k) if dev.type == "cpu" else None
        row: dict[str, Any] = {"samples_per_s": result["throughput"][label]["samples_per_s"],
                               "over_one_at_a_time": result["throughput"][label]["samples_per_s"] / base, "threads_per_client": per}
        ref = sequential
        if per is not None and per != threads:
            ref = {}
            torch.set_num_threads(per)
            try:
                measure(f"fedavg[threads={per}]", lambda k=k, per=per, ref=ref: engine_rounds(
                    "fedavg", build(), data, cfg, rounds, seed, tmp / f"fedavg_p{k}_t{per}.pt" if tmp else None, keep=ref))
            finally:
                torch.set_num_threads(threads)
            row["over_one_at_a_time_same_threads"] = row["samples_per_s"] / result["throughput"][f"fedavg[threads={per}]"]["samples_per_s"]
        row["identical_to_one_at_a_time"] = _same(par["server"], ref["server"])
        out[k] = row
    return out


def harmonize_throughput(n_images: int, px: int, workers: int) -> dict[str, Any]:
    from fedsilo.config import MirrorParams
    from fedsilo.data.harmonize import decode_all
    from fedsilo.data.mirror.cxr import write_rsna, write_vinbigdata

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_vinbigdata(root / "vin", MirrorParams(patients=max(8, n_images // 2), image_px=px))
        write_rsna(root / "rsna", MirrorParams(patients=max(8, n_images - n_images // 2), image_px=px))
        half = n_images // 2
        files = sorted((root / "vin").rglob("*.dicom"))[:half] + sorted((root / "rsna").rglob("*.dcm"))[: n_images - half]
        jobs = [(str(p), "dicom", 224, "crop", "bit_depth", (0.5, 99.5)) for p in files]
        out = {"images": len(jobs), "source_px": px, "workers": workers}
        for label, w in (("one_core", 1), ("all_cores", workers)):
            t0 = time.perf_counter()
            res = decode_all(jobs, w)
            dt = time.perf_counter() - t0
            bad = [e for img, e in res if img is None]
            if bad:
                raise RuntimeError(f"decode failed during the benchmark: {bad[0]}")
            out[f"images_per_s_{label}"] = len(jobs) / dt
        return out


def run_bench(
    model: str = "simple_cnn",
    image_size: int = 28,
    channels: int = 3,
    num_classes: int = 10,
    clients: int = 5,
    samples: int = 743,
    test_samples: int = 256,
    batch_size: int = 32,
    local_epochs: int = 1,
    rounds: int = 2,
    warmup: int = 1,
    methods: tuple[str, ...] = ("fedavg", "pfeddb"),
    device: str = "auto",
    amp: str = "auto",
    channels_last: str = "auto",
    compile: bool = False,
    checkpoint: bool = True,
    memory_clients: int = 100,
    memory_rounds: int = 50,
    memory_samples: int = 16,
    memory_fraction: Optional[float] = None,
    harmonize_images: int = 32,
    harmonize_px: int = 1024,
    seed: int = 0,
    host_augment: tuple[dict[str, Any], ...] = (),
    parallel_clients: tuple[int, ...] = (),
) -> dict[str, Any]:
    from fedsilo.methods import REGISTRY

    if "all" in methods:
        methods = tuple(m for m, cls in REGISTRY.items() if m != "single" and not cls.stream_only)  # bench runs static clients
    if (host_augment or parallel_clients) and "fedavg" not in methods:  # both are FedAvg with them against without
        methods = ("fedavg", *methods)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    cfg = TrainParams(
        model=model, rounds=warmup + rounds, local_epochs=local_epochs, batch_size=batch_size, lr=0.01, momentum=0.0,
        device=str(dev), amp=amp, channels_last=channels_last, compile=compile,  # type: ignore[arg-type]
        count_flops=False,  # the FLOP counter's dispatch overhead would land in the last timed round
        checkpoint_every=1,  # a write in every timed round (auto's schedule would make the rounds' mix depend on this machine)
    )
    widths: dict[int, TrainParams] = {}
    for k in parallel_clients:  # validated before anything is timed (model_copy would not): K < 1, or with compile
        try:
            widths[k] = TrainParams.model_validate({**cfg.model_dump(), "parallel_clients": k})
        except ValidationError as err:
            raise ConfigError(f"--parallel-clients {k}: {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None

    def build() -> nn.Module:
        return build_model(model, channels, num_classes, seed=seed, image_size=image_size).to(dev)

    data = synthetic_clients(clients, samples, test_samples, channels, image_size, num_classes, dev, seed)
    per_round = clients * samples * local_epochs
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})",
        "torch": torch.__version__,
        "config": {"model": model, "image_size": image_size, "clients": clients, "samples": samples, "test_samples": test_samples,
                   "host_augment": [dict(h) for h in host_augment],
                   "batch_size": batch_size, "local_epochs": local_epochs, "rounds": rounds, "warmup": warmup,
                   "bf16": use_bf16(cfg, dev), "channels_last": use_channels_last(cfg, dev), "compile": compile, "checkpoint": checkpoint},
        "throughput": {},
    }

    def measure(label: str, fn) -> None:
        _reset_peak(dev)
        times = fn()[warmup:]
        result["throughput"][label] = {
            "samples_per_s": per_round / float(np.median(times)),
            "sec_per_round": float(np.median(times)),
            "peak_device_mib": _peak_dev(dev),
            "host_rss_mib": rss_mib(),
        }

    measure("single_model_loop", lambda: single_model_loop(build(), data, cfg, warmup + rounds, seed))
    own_limit: dict[str, str] = {}
    example = to_float(data[0].x_train[:2], cfg.normalize)
    for m in methods:
        cls = method_class(m)
        algo = cls(cls.params_cls(**BENCH_METHOD_PARAMS.get(m, {})), cfg)
        probe = build()
        if algo.transform_model(probe, example) is not probe:
            # a method that trains another model (pFedDB's two extractors) also gets the loop over that model
            label = f"single_model_loop[{m}]"
            measure(label, lambda algo=algo: single_model_loop(
                algo.transform_model(build(), example), data, cfg, warmup + rounds, seed))
            own_limit[m] = label
    kept: dict[str, Any] = {}
    costs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in methods:
            ck = Path(tmp) / f"{m}.pt" if checkpoint else None
            measure(m, lambda m=m, ck=ck: engine_rounds(m, build(), data, cfg, warmup + rounds, seed, ck,
                                                        keep=kept if m == "fedavg" else None, costs=costs.setdefault(m, {})))
        if checkpoint:  # what train.checkpoint_every saves: one write's seconds against the round it ends
            result["checkpoint"] = {m: {"seconds_per_write": c["seconds"], "mib": c["mib"],
                                        "share_of_round": c["seconds"] / result["throughput"][m]["sec_per_round"]}
                                    for m, c in costs.items()}
        # where a round's seconds go (medians of the measured rounds): the clients' local training with the payload
        # copies and the aggregation; the evaluation; the rest of the step (the checkpoint write, the history)
        result["round_parts"] = {}
        for m, c in costs.items():
            step, train, whole = (np.array(v) for v in zip(*c["parts"][warmup:]))
            result["round_parts"][m] = {"train_transfer_aggregate_s": float(np.median(train)),
                                        "evaluate_s": float(np.median(whole - train)),
                                        "checkpoint_and_bookkeeping_s": float(np.median(step - whole))}
        if widths:
            result["parallel_clients"] = parallel_gain(widths, measure, result, kept, build, data, cfg, warmup + rounds, seed,
                                                       Path(tmp) if checkpoint else None)
        if host_augment:  # what an albumentations policy (train.augment.host) costs: FedAvg with it against without it
            from fedsilo.config import AugmentParams

            hcfg = cfg.model_copy(update={"augment": AugmentParams(host=tuple(host_augment))})
            measure("fedavg+host_augment", lambda: engine_rounds(
                "fedavg", build(), data, hcfg,
                warmup + rounds, seed, Path(tmp) / "fedavg_host.pt" if checkpoint else None))
            plain, aug = result["throughput"]["fedavg"], result["throughput"]["fedavg+host_augment"]
            result["host_augment"] = {
                "policy": [dict(h) for h in host_augment],
                "seconds_per_round_added": aug["sec_per_round"] - plain["sec_per_round"],
                "throughput_with_over_without": aug["samples_per_s"] / plain["samples_per_s"],
            }
    limit = result["throughput"]["single_model_loop"]["samples_per_s"]
    measured = [m for m in result["throughput"] if not m.startswith("single_model_loop")]
    result["ratios"] = {m: result["throughput"][m]["samples_per_s"] / limit for m in measured}
    result["ratios_vs_own_model_loop"] = {
        m: result["throughput"][m]["samples_per_s"] / result["throughput"][own_limit.get(m, "single_model_loop")]["samples_per_s"]
        for m in measured
    }
    result["peak_host_rss_mib"] = peak_rss_mib()

    if memory_clients > 0 and memory_rounds > 0:
        frac = memory_fraction if memory_fraction is not None else (1.0 if dev.type == "cuda" else 0.1)
        # with --parallel-clients, its widest: the copies of the model made every round must not add up either
        width = max(widths, default=1)
        mcfg = cfg.model_copy(update={"model": "simple_cnn", "rounds": memory_rounds, "client_fraction": frac, "eval_every": memory_rounds,
                                      "parallel_clients": width})
        mdata = synthetic_clients(memory_clients, memory_samples, 8, 3, 28, 10, dev, seed + 1)
        rss, devmem = [], []
        cls = method_class("fedbn")
        eng = Engine(cls(cls.params_cls(), mcfg), build_model("simple_cnn", 3, 10, seed=seed).to(dev), mdata, mcfg, seed)
        t0 = time.perf_counter()
        for _ in range(memory_rounds):
            eng.step()
            _sync(dev)
            rss.append(rss_mib())
            devmem.append(torch.cuda.memory_allocated(dev) / 2**20 if dev.type == "cuda" else 0.0)
        # the first rounds warm the allocator up; the second half shows whether memory keeps growing
        half = memory_rounds // 2
        marks = sorted({1, max(1, memory_rounds // 5), half, memory_rounds})
        result["memory"] = {
            "method": "fedbn", "clients": memory_clients, "rounds": memory_rounds, "client_fraction": frac, "parallel_clients": width,
            "seconds": time.perf_counter() - t0,
            "host_rss_mib_at_round": {r: rss[r - 1] for r in marks},
            # a leak raises the second half's peak above the first half's; allocator jitter moves both a little
            "host_rss_peak_second_half_over_first": max(rss[half:]) / max(rss[:half]) if half >= 1 else 1.0,
            "device_mib_at_round": {r: devmem[r - 1] for r in marks},
        }
    if harmonize_images > 0:
        result["harmonize"] = harmonize_throughput(harmonize_images, harmonize_px, os.cpu_count() or 1)
    return result


def format_result(r: dict[str, Any]) -> str:
    lines = [f"fedsilo bench  {r['date']}  {r['device']}  torch {r['torch']}", f"config: {json.dumps(r['config'])}", ""]
    lines.append(f"{'what':<30}{'samples/s':>11}{'s/round':>9}{'vs loop':>9}{'vs own':>8}{'peak dev MiB':>14}{'host RSS MiB':>14}")
    limit = r["throughput"]["single_model_loop"]["samples_per_s"]
    for name, t in r["throughput"].items():
        dev = f"{t['peak_device_mib']:.0f}" if t["peak_device_mib"] is not None else "n/a"
        own = r["ratios_vs_own_model_loop"].get(name)
        own_s = f"{own:.3f}" if own is not None else ""
        lines.append(f"{name:<30}{t['samples_per_s']:>11.1f}{t['sec_per_round']:>9.3f}{t['samples_per_s'] / limit:>9.3f}{own_s:>8}{dev:>14}{t['host_rss_mib']:>14.0f}")
    lines.append(f"peak host RSS of the process: {r['peak_host_rss_mib']:.0f} MiB")
    if "memory" in r:
        m = r["memory"]
        lines.append(
            f"memory: {m['clients']} clients x {m['rounds']} rounds ({m['method']}, fraction {m['client_fraction']}"
            f"{', ' + str(m['parallel_clients']) + ' at once' if m.get('parallel_clients', 1) > 1 else ''}) in {m['seconds']:.0f} s: "
            "host RSS MiB at round " + ", ".join(f"{r}: {v:.0f}" for r, v in m["host_rss_mib_at_round"].items())
            + f" (peak of 2nd half / peak of 1st half x{m['host_rss_peak_second_half_over_first']:.3f}); device MiB at round "
            + ", ".join(f"{r}: {v:.0f}" for r, v in m["device_mib_at_round"].items())
        )
    for m, parts in r.get("round_parts", {}).items():
        lines.append(f"round parts, {m}: train + transfers + aggregation {parts['train_transfer_aggregate_s']:.3f} s, evaluation "
                     f"{parts['evaluate_s']:.3f} s, checkpoint + bookkeeping {parts['checkpoint_and_bookkeeping_s']:.3f} s")
    if "checkpoint" in r:
        lines.append("checkpoint per write (train.checkpoint_every: auto writes once 20 writes' time has passed since the last, k every k rounds): " + "; ".join(
            f"{m} {c['seconds_per_write']:.3f} s, {c['mib']:.1f} MiB ({100 * c['share_of_round']:.0f} % of its round, the write included)"
            for m, c in r["checkpoint"].items()))
    if "host_augment" in r:
        h = r["host_augment"]
        lines.append(
            f"host augmentation ({', '.join(p['name'] for p in h['policy'])}): +{h['seconds_per_round_added']:.3f} s per FedAvg round, "
            f"throughput x{h['throughput_with_over_without']:.3f} of FedAvg without it"
        )
    for k, p in r.get("parallel_clients", {}).items():
        same = f", x{p['over_one_at_a_time_same_threads']:.3f} of one at a time with {p['threads_per_client']} thread(s)" if "over_one_at_a_time_same_threads" in p else ""
        each = f" ({p['threads_per_client']} thread(s) each)" if p["threads_per_client"] else ""
        lines.append(
            f"parallel clients: FedAvg training {k} clients at once{each}: x{p['over_one_at_a_time']:.3f} the throughput of one at a "
            f"time{same}; final global model {'bit-equal to' if p['identical_to_one_at_a_time'] else 'DIFFERENT from'} one at a time"
        )
    if "harmonize" in r:
        h = r["harmonize"]
        lines.append(
            f"harmonize: {h['images']} DICOMs of {h['source_px']} px -> 224: {h['images_per_s_one_core']:.1f} img/s on one core, "
            f"{h['images_per_s_all_cores']:.1f} img/s on {h['workers']} cores"
        )
    return "\n".join(lines)
