"""Start-up reports: byte sizes, the fetch bar on a terminal vs plain lines elsewhere, and the
load summary read from a real engine's memory stats."""
import io
import logging

from tokenmill.utils.progress import BarProgress, LogProgress, format_bytes, load_summary, timed_load

LOG = logging.getLogger("tokenmill.test_progress")


def test_format_bytes_is_decimal_like_pip():
    assert format_bytes(512) == "512 B"
    assert format_bytes(540_000) == "540 kB"
    assert format_bytes(92_871_040) == "93 MB"
    assert format_bytes(1_234_000_000) == "1.2 GB"


def _feed(progress, total, steps):
    progress.begin("fetching toy (toy==1.0, 1.0 MB) into /c ...", total)
    for done in steps:
        progress.update(done)
    progress.end("fetched toy in 0.1 s")


def test_log_progress_says_two_lines(caplog):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _feed(LogProgress(LOG), 1000, range(0, 1001, 100))
    assert [r.getMessage() for r in caplog.records] == [
        "fetching toy (toy==1.0, 1.0 MB) into /c ...", "fetched toy in 0.1 s"]


def test_bar_progress_off_a_terminal_prints_a_line_per_quarter(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _feed(BarProgress(LOG, stream), 1_000_000, range(0, 1_000_001, 50_000))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1:-1] == ["  250 kB of 1.0 MB (25 %)", "  500 kB of 1.0 MB (50 %)",
                           "  750 kB of 1.0 MB (75 %)"]
    assert stream.getvalue() == ""          # a StringIO is no terminal: no bar


def test_bar_progress_jumping_to_the_end_says_no_quarter(caplog):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _feed(BarProgress(LOG, io.StringIO()), 1000, [0, 1000])
    assert len(caplog.records) == 2


def test_bar_progress_on_a_terminal_draws_a_bar(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _feed(BarProgress(LOG, stream, interactive=True), 1_000_000, [0, 500_000, 1_000_000])
    assert "%|" in stream.getvalue() and "1.00M" in stream.getvalue()
    assert len(caplog.records) == 2          # the bar replaces the quarter lines


def test_bar_progress_is_silent_when_info_is_hidden(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        _feed(BarProgress(LOG, stream, interactive=True), 1000, [500])
    assert stream.getvalue() == "" and not caplog.records


def test_load_summary_from_a_real_engine(tiny_llama_dir, caplog):
    from tokenmill.entrypoints.llm import LLM
    with caplog.at_level(logging.INFO, logger=LOG.name):
        llm = timed_load("tiny", lambda: LLM(model=tiny_llama_dir, skip_tokenizer_init=True,
                                             num_kv_blocks=8, block_size=16), LOG)
    line = caplog.records[-1].getMessage()
    stats = llm.get_memory_stats()
    assert line.startswith("loaded tiny in ") and " s (weights " in line
    assert f"KV cache 8 blocks / 128 tokens, {format_bytes(stats['kv_cache'])})" in line
    assert line == load_summary("tiny", float(line.split()[3]), stats)


def test_load_summary_names_the_tensor_parallel_ranks():
    stats = {"model_weights": 2 << 20, "num_total_blocks": 4, "kv_capacity_tokens": 64,
             "kv_cache": 1 << 20, "tensor_parallel_size": 3}
    assert load_summary("m", 1.0, stats).endswith(", over 3 tensor-parallel ranks)")
    assert "ranks" not in load_summary("m", 1.0, {**stats, "tensor_parallel_size": 1})


def test_load_summary_counts_the_copies_made_at_load():
    """bf16 mode's tiles (or oneDNN's copy) are weights the line shows too: without them a
    bf16-mode SmolLM2 read "weights 4.3 MB" (its norms) for ~270 MB of tiles."""
    stats = {"model_weights": 4 << 20, "num_total_blocks": 4, "kv_capacity_tokens": 64,
             "kv_cache": 1 << 20}
    assert "(weights 4.2 MB, KV" in load_summary("m", 1.0, stats)
    line = load_summary("m", 1.0, {**stats, "prepacked_weights": 256 << 20})
    assert "(weights 4.2 MB + 268 MB tiled / prepacked, KV" in line
