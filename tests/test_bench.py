"""`fedsilo bench` runs and reports what it promises (structure only: timings are not asserted)."""

from fedsilo.bench import format_result, run_bench
from fedsilo.cli import build_parser


def test_bench_reports_ratios_memory_and_harmonize():
    r = run_bench(clients=2, samples=16, test_samples=8, batch_size=8, rounds=1, warmup=1, methods=("fedavg", "pfeddb"),
                  memory_clients=6, memory_rounds=4, memory_samples=4, harmonize_images=4, harmonize_px=128, device="cpu")
    assert set(r["ratios"]) == {"fedavg", "pfeddb"} and all(v > 0 for v in r["ratios"].values())
    assert "single_model_loop[pfeddb]" in r["throughput"], "pFedDB also gets a loop over its own dual-branch model"
    assert r["ratios_vs_own_model_loop"]["fedavg"] == r["ratios"]["fedavg"]
    assert set(r["memory"]["host_rss_mib_at_round"]) == {1, 2, 4}
    assert r["harmonize"]["images"] == 4 and r["harmonize"]["images_per_s_all_cores"] > 0
    text = format_result(r)
    assert "vs loop" in text and "harmonize:" in text
    # one checkpoint write per method, measured against its round (what train.checkpoint_every saves)
    assert set(r["checkpoint"]) == {"fedavg", "pfeddb"}
    assert all(c["seconds_per_write"] > 0 and c["mib"] > 0 and c["share_of_round"] > 0 for c in r["checkpoint"].values())
    assert r["checkpoint"]["pfeddb"]["mib"] > r["checkpoint"]["fedavg"]["mib"], "pFedDB's clients keep their own branch"
    assert "checkpoint per write" in text
    # where a round's seconds go: every part measured, none negative
    assert set(r["round_parts"]) == {"fedavg", "pfeddb"} and all(v >= 0 for p in r["round_parts"].values() for v in p.values())
    assert r["round_parts"]["fedavg"]["train_transfer_aggregate_s"] > 0 and "round parts, fedavg" in text


def test_bench_cli_help_documents_options():
    help_text = build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    for opt in ("--model", "--image-size", "--clients", "--samples", "--local-epochs", "--methods", "--memory-clients", "--harmonize-images",
                "--parallel-clients"):
        assert opt in help_text


def test_bench_times_clients_trained_at_once_and_checks_their_model():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        r = run_bench(clients=4, samples=16, test_samples=8, batch_size=8, rounds=1, warmup=1, methods=("fedavg",),
                      memory_clients=0, harmonize_images=0, device="cpu", parallel_clients=(2, 4))
    finally:
        torch.set_num_threads(before)
    for k in (2, 4):  # both against one at a time with one thread, each from its own checkpoint (not a resumed one)
        p = r["parallel_clients"][k]
        assert p["threads_per_client"] == 1 and p["over_one_at_a_time"] > 0 and p["over_one_at_a_time_same_threads"] > 0
        assert p["identical_to_one_at_a_time"] is True
    assert {"fedavg", "fedavg[parallel=2]", "fedavg[parallel=4]", "fedavg[threads=1]"} <= set(r["throughput"])
    assert "2 clients at once (1 thread(s) each)" in format_result(r)
